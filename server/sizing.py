"""What the server's memory and queues are sized to: pure functions of its settings.

The shell (server/app.py) allocates what these say and nothing else decides them: how
--max-buffers divides between batch buffers and the producers' sample window, the lending
reserve, and each stage's capacity in the stats. Unit-tested in tests/unit/test_server_sizing.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchwire.server.bufpool import default_reserve
from batchwire.server.config import ServerConfig
from batchwire.server.sharing import sample_window_batches, sample_window_samples
from batchwire.wire import BatchSpec


@dataclass(frozen=True)
class BufferPlan:
    """--max-buffers divided: ``buffers`` batch buffers the budget lends (``reserve`` of them
    only to clients holding none) and ``sample_batches`` batches' bytes for the sample window
    (pipeline/sample_window.py), of which ``sample_window_nbytes`` hold its entries."""

    buffers: int
    reserve: int
    sample_batches: int
    sample_window_nbytes: int


def plan_buffers(config: ServerConfig, capacity: BatchSpec) -> BufferPlan:
    """The buffers of a server whose largest batch is ``capacity`` (`capacity_spec`).

    The sample window's bytes are taken out of --max-buffers (as that many batches of the
    largest size), so the memory bound holds. Past its bytes, each producer can pin up to
    2 x CHUNK - 1 more samples (its scratch chunk, and an evicted chunk a live entry still
    shares): those are taken from the window too.
    """
    cap = config.buffer_cap
    window = sample_window_batches(config, cap)
    buffers = cap - window
    sample_nbytes = capacity.nbytes // capacity.batch_size
    return BufferPlan(
        buffers=buffers,
        reserve=default_reserve(buffers, config.producers),
        sample_batches=window,
        sample_window_nbytes=sample_window_samples(config, cap) * sample_nbytes,
    )


def stage_capacities(producers: int, clients: int, prefetch_depth: int) -> dict[str, int]:
    """Each stage's bound in the stats (`StageStats.capacity`): the read queue holds a job in
    production and one queued per producer, decode and augment one batch per producer, and
    the ready queue --prefetch-depth batches per client (one, with none connected)."""
    return {
        "read": 2 * producers,
        "decode": producers,
        "augment": producers,
        "ready": max(1, clients) * prefetch_depth,
    }
