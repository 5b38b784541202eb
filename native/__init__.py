"""batchwire.native."""
