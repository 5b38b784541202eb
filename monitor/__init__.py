"""batchwire.monitor."""
