"""servex.server.config."""
