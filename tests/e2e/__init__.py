"""The end-to-end tier, a package: its module names cannot clash with the unit tier's when
`make test` runs both in one session."""
