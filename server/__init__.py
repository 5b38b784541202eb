"""batchwire.server."""
