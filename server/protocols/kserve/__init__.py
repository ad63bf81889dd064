"""servex.server.protocols.kserve."""
