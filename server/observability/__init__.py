"""servex.server.observability."""
