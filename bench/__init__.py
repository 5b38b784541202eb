"""batchwire.bench."""
