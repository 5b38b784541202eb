"""batchwire.train."""
