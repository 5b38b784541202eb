"""The unit tier, a package: its module names cannot clash with the end-to-end tier's when
`make test` runs both in one session."""
