"""batchwire.client."""
