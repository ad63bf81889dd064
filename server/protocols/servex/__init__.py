"""servex.server.protocols.servex."""
