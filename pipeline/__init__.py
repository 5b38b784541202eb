"""batchwire.pipeline."""
