"""servex.server.protocols."""
