"""batchwire.server: `pipeline-server`, the batch producer that trainers stream from.

Modules (one job each): `config` and `cli` (settings, the console script), `splits` (datasets,
decoder, producers), `workers` (producer threads and stage accounting), `streams` (per-client
asked batches, work-ahead, order), `bufpool` (batch buffers under one cap), `security` (bind
policy, owner-only ipc sockets), `metrics_http` (the /metrics endpoint), `app` (the ROUTER loop),
`telemetry` (measurements and Prometheus). The protocol itself is `batchwire.wire`, which the
clients import without this package.
"""
