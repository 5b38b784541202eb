"""batchwire.server: `pipeline-server`, the batch producer that trainers stream from.

Modules (one job each): `config` and `cli` (settings, the console script), `splits` (datasets,
decoder, producers), `core` (the protocol core: every decision, no I/O; events in, actions
out), `sessions` (one client's asked batches, work-ahead, order), `budget` (who may borrow a
batch buffer), `delivery` (sent batches ZeroMQ still holds, per peer), `jobs` (what producer
threads are handed and hand back), `workers` (producer threads and stage accounting),
`bufpool` (the batch buffers' memory under one cap), `router_socket` (the ROUTER's options,
binding and peer tracking), `memory` (the memory bounds said at start), `security` (bind
policy, owner-only ipc sockets), `metrics_http` (the /metrics endpoint), `app` (the loop that
carries out the core's actions), `telemetry` (measurements and Prometheus). The protocol itself
is `batchwire.wire`, which the clients import without this package.
"""
