"""servex.server.protocols.tfserving."""
