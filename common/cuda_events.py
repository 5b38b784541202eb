"""Buffer reuse guarded by a CUDA event: the one rule every CUDA path of batchwire follows.

CUDA copies and kernels are queued on a stream and run later, so when a buffer changes hands
(from the stream that wrote it to the stream that reads it, or back for the next write, or to
the host) "I am done with it" means "everything I queued on my stream so far has run". The
contract:

- whoever is done with the buffer records the fence on the stream it used, at once, before the
  buffer changes hands (a lock or queue orders the two threads, so the next user always sees
  the latest record): `BufferFence.record(stream)`;
- whoever uses it next, before touching it, either makes its own stream wait for that record
  (`wait(stream)`: no host block, for GPU work) or blocks the host until it has run
  (`synchronize()`: when the host itself writes or sends the memory, e.g. ``recv_into`` into a
  pinned slot an asynchronous copy still reads);
- before the first record the buffer is free: `wait` and `synchronize` do nothing. After a
  `synchronize` the last use has run, so nothing is left to wait for.

`HandOff` is the round trip of one reusable buffer between a writer stream and the stream of
whoever consumes it: `RemoteLoader`'s `CudaStager` (host-to-device copy on a side stream) and
`LocalLoader` (production on a stream of its own) are both this. A one-way use (e.g. a
device-to-host copy the host then reads or sends) is a bare `BufferFence`: record, then
`synchronize`.

Nothing here touches CUDA before it is constructed (the module imports on CPU-only torch), and
`torch.cuda` is looked up at each call.
"""

from __future__ import annotations

import torch


class BufferFence:
    """The last use of one buffer on some CUDA stream, for its next user to wait for.

    torch creates the CUDA event itself at the first `record`, on the recording stream's device,
    so a fence may be made before any device is chosen.
    """

    def __init__(self) -> None:
        # A blocking-sync event: a host that waits for it sleeps. The default spins a core
        # (CUDA's automatic scheduling, with fewer contexts than cores), a core a producer
        # thread's CPU fallback and checks need.
        self.event = torch.cuda.Event(blocking=True)
        #: A use was recorded and the host has not waited for it since.
        self.recorded = False

    def record(self, stream: torch.cuda.Stream) -> None:
        """Everything queued on `stream` so far uses the buffer."""
        self.event.record(stream)
        self.recorded = True

    def wait(self, stream: torch.cuda.Stream) -> None:
        """Work queued on `stream` from now on runs after the recorded use."""
        if self.recorded:
            stream.wait_event(self.event)

    def synchronize(self) -> None:
        """Block the host until the recorded use has run."""
        if self.recorded:
            self.event.synchronize()
            self.recorded = False


class HandOff:
    """One reusable buffer going from a writer stream to a consumer's stream and back.

    ``ready``: recorded on the writer stream once it queued the buffer's contents; the
    consumer's stream waits on it at `hand_out`. ``freed``: recorded when the buffer is given
    back, on the stream it was handed out to (not whichever stream is current then); the writer
    stream waits on it before it writes the buffer again (`before_write`).
    """

    def __init__(self) -> None:
        self.ready = BufferFence()
        self.freed = BufferFence()
        #: The stream the buffer was handed out to, until it is given back.
        self.consumer: torch.cuda.Stream | None = None

    def before_write(self, writer: torch.cuda.Stream) -> None:
        """Writer thread, before queueing writes on `writer`: the last consumer comes first."""
        self.freed.wait(writer)

    def written(self, writer: torch.cuda.Stream) -> None:
        """Writer thread, after queueing the writes on `writer`."""
        self.ready.record(writer)

    def hand_out(self, consumer: torch.cuda.Stream) -> None:
        """Consumer thread: `consumer` waits for the writes; it guards the buffer until
        `give_back`."""
        self.ready.wait(consumer)
        self.consumer = consumer

    def give_back(self) -> None:
        """Consumer thread, before the buffer returns to its pool: its consumer's work so far
        comes before the next write. A buffer never handed out records nothing."""
        if self.consumer is not None:
            self.freed.record(self.consumer)
            self.consumer = None
