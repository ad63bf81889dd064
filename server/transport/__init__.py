"""servex.server.transport."""
