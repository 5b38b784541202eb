"""`pipeline-prepare`: rewrite a dataset's JPEGs losslessly with restart markers, for fast crops."""
