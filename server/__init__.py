"""batchwire.server: `pipeline-server`, the batch producer that trainers stream from.

Modules (one job each): `protocol` (wire protocol v1, shared with the client), `config` and
`cli` (settings, the console script), `splits` (datasets, decoder, producers), `workers`
(producer threads and stage accounting), `streams` (per-client credits, work-ahead, order),
`bufpool` (batch buffers), `sender` (the zero-copy send path), `app` (the ROUTER loop),
`telemetry` (measurements and Prometheus). Kept import-light: `pipeline-server --help` and the
client's use of `protocol` do not pull in torch through this package.
"""
