"""batchwire.wire: the protocol every side speaks, and nothing else of batchwire.

Server, client, monitor, trainer, benchmarks and tests all speak through this package:

- `messages`: the message dataclasses (`Hello`, `Credit`, `Bye`, `StatsRequest`; `Welcome`,
  `ErrorReply`, `Shutdown`, `BatchHeader`, `StatsReply`) and `decode_client_message` /
  `decode_server_message`;
- `frames`: msgpack control frames with hard limits, and the labels frame; `send`: a batch's
  frames out of a socket without copying the images;
- `batch_spec`: `BatchSpec`, the one table of output formats (shape, dtype, layout, bytes,
  torch dtype, memory format), and `PADDING_INDEX`/`PADDING_LABEL`, a padded slot's index and
  label;
- `errors`: `ProtocolError` (and `VersionMismatch`), raised by either side for a bad frame;
- `stats`: the Stats schema (`ServerStats` and its parts, `LoaderReport`), typed and checked;
  `stats_client`: the one way to ask a server for it (`fetch_stats`, `StatsClient`);
- `keys`: CURVE keys (`pipeline-keys`), the client's and the server's side of them;
- `dns`: ``dns+tcp://NAME:PORT`` fleet names, parsed and looked up (the loader's discovery thread
  and the monitor both read them);
- `raw_client`: a client reduced to the wire, for tests, benchmarks and debugging.

It imports nothing else of batchwire, so a change to the wire is a change here and in the two
endpoints that handle the message, never a hunt through the server.
"""

from batchwire.wire.batch_spec import (
    DTYPES,
    LAYOUTS,
    MAX_BATCH_SIZE,
    PADDING_INDEX,
    PADDING_LABEL,
    BatchSpec,
    dtype_name,
    images_nbytes,
    itemsize,
    numpy_dtype,
    tensor_bytes,
    torch_dtype,
)
from batchwire.wire.errors import PROTOCOL_VERSION, ProtocolError, VersionMismatch, show
from batchwire.wire.frames import (
    LABELS_DTYPE,
    MAX_ARRAY_LEN,
    MAX_CLIENT_FRAME_BYTES,
    MAX_MAP_LEN,
    MAX_SERVER_FRAME_BYTES,
    MAX_STR_LEN,
    labels_from_frame,
    labels_to_frame,
    pack,
    unpack_frame,
)
from batchwire.wire.messages import (
    ERROR_REASONS,
    MAX_IMAGE_SIDE,
    MAX_JOB_LEN,
    MAX_PREFETCH,
    BatchHeader,
    Bye,
    ClientMessage,
    Credit,
    ErrorReply,
    Hello,
    ServerMessage,
    Shutdown,
    StatsReply,
    StatsRequest,
    Welcome,
    decode_client_message,
    decode_server_message,
)
from batchwire.wire.send import send_batch
from batchwire.wire.stats import (
    STATS_VERSION,
    BufferStats,
    ClientRow,
    Counters,
    LoaderReport,
    ServerStats,
    StageStats,
    Throughput,
    UnlistedClients,
)

__all__ = [
    "DTYPES",
    "ERROR_REASONS",
    "LABELS_DTYPE",
    "LAYOUTS",
    "MAX_ARRAY_LEN",
    "MAX_BATCH_SIZE",
    "MAX_CLIENT_FRAME_BYTES",
    "MAX_IMAGE_SIDE",
    "MAX_JOB_LEN",
    "MAX_MAP_LEN",
    "MAX_PREFETCH",
    "MAX_SERVER_FRAME_BYTES",
    "MAX_STR_LEN",
    "PADDING_INDEX",
    "PADDING_LABEL",
    "PROTOCOL_VERSION",
    "STATS_VERSION",
    "BatchHeader",
    "BatchSpec",
    "BufferStats",
    "Bye",
    "ClientMessage",
    "ClientRow",
    "Counters",
    "Credit",
    "ErrorReply",
    "Hello",
    "LoaderReport",
    "ProtocolError",
    "ServerMessage",
    "ServerStats",
    "Shutdown",
    "StageStats",
    "StatsReply",
    "StatsRequest",
    "Throughput",
    "UnlistedClients",
    "VersionMismatch",
    "Welcome",
    "decode_client_message",
    "decode_server_message",
    "dtype_name",
    "images_nbytes",
    "itemsize",
    "labels_from_frame",
    "labels_to_frame",
    "numpy_dtype",
    "pack",
    "send_batch",
    "show",
    "tensor_bytes",
    "torch_dtype",
    "unpack_frame",
]
