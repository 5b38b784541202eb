"""A bounded window of recently augmented samples, shared by batches of other compositions.

Why it works: a sample's output bytes are a pure function of (seed, epoch, sample index,
output config): `plan_samples` draws each sample's crop box, flip and jitter from a generator
seeded by (seed, epoch, index), the CPU decoder decodes each request on its own, and the fused
op (and its reference) writes each sample from that sample's image and parameters alone. So
the bytes of sample i do not depend on the batch it lands in, its batch size or its slot
(tests/unit/test_sample_window.py checks it: batches of 64 and of 32, and a shuffled subset,
give the same bytes per sample). A substituted sample (an unreadable file) is the same
substitute whatever its batch (the sequence depends on (seed, index) only), and a padding slot
repeats a real sample.

Jobs of a sweep with different batch sizes (32 and 64, or 64 and 128 at world sizes 1, 2, 4)
read the same epoch order, cut differently: batch k of 64 is batches 2k and 2k+1 of 32. Batches
do not match, samples do. `BatchProducer.produce` with a window (`reuse`) claims the samples of
its batch: those in the window are copied, those another producer is making are waited for
(after making its own, so two producers never wait on each other), the rest are decoded as a
smaller batch and published for the others.

Cost: publishing copies each produced sample once (a clone of its bytes) and assembling copies
each reused one into the batch. Measured on the 2-core CPU machine: one 224x224 uint8 sample
(147 KiB) copies in about 10-20 us, against 3-6 ms to read, decode and augment it: a reused
sample costs well under 1 % of producing it. Assembling costs more than it saves when few of a
batch's samples are there (the scratch batch and the copies buy little, and the waits may
stall a producer): with less than `MIN_REUSE` of the batch found or in production, the batch is
produced whole (and published). On a `--device cuda` server decoding and augmenting are on the
GPU and the batch's host copy is the cost, so the server does not use the window there; nor for
multi-view batches or user transforms. The server has a window only when told to expect a mix
of batch sizes (--max-batch-size above --batch-size); there every batch publishes its samples,
since a job of another batch size may ask for them a moment later: a lone job on such a server
pays one copy per sample for that insurance (the figure above), elsewhere nothing.

Bounded in bytes (`max_bytes`, the server sizes it from --share-window and charges it to
--max-buffers: server/app.py); oldest entries go first. A job lagging by more than the window
decodes its own samples, as a lagging job produces its own batches.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

import torch

#: Produce the batch whole when less than this fraction of its samples can be reused.
MIN_REUSE = 0.25
#: How long a producer waits for a sample another producer claimed before making it itself.
WAIT_S = 60.0


@dataclass(frozen=True)
class SampleEntry:
    """One augmented sample: its output bytes (a [3, H, W] tensor as written in a batch), its
    label and the dataset index its pixels come from (a substitute's for a replaced one)."""

    image: torch.Tensor
    label: int
    source: int
    replaced: bool

    @property
    def nbytes(self) -> int:
        return self.image.numel() * self.image.element_size()


class SampleWindow:
    """Thread-safe: producer threads claim, publish and read; the loop reads the totals."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max(0, int(max_bytes))
        self._lock = threading.Lock()
        self._entries: OrderedDict[Hashable, SampleEntry] = OrderedDict()
        self._pending: dict[Hashable, threading.Event] = {}
        self.bytes = 0
        self.reused_total = 0  # samples copied from the window instead of produced
        self.produced_total = 0  # samples produced by batches that used the window

    def claim(
        self, keys: Iterable[Hashable]
    ) -> tuple[dict[Hashable, SampleEntry], list[Hashable], dict[Hashable, threading.Event]]:
        """Sort ``keys`` (distinct) into: in the window (returned, marked recent), claimed now
        by the caller (it must `publish` or `abandon` each), and in production elsewhere (an
        event set when that producer published or gave up)."""
        found: dict[Hashable, SampleEntry] = {}
        mine: list[Hashable] = []
        theirs: dict[Hashable, threading.Event] = {}
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None:
                    self._entries.move_to_end(key)
                    found[key] = entry
                elif key in self._pending:
                    theirs[key] = self._pending[key]
                else:
                    self._pending[key] = threading.Event()
                    mine.append(key)
        return found, mine, theirs

    def publish(self, key: Hashable, entry: SampleEntry) -> None:
        """A claimed sample is made: into the window (oldest out past `max_bytes`)."""
        with self._lock:
            event = self._pending.pop(key, None)
            if entry.nbytes <= self.max_bytes and key not in self._entries:
                self._entries[key] = entry
                self.bytes += entry.nbytes
                while self.bytes > self.max_bytes and self._entries:
                    _, old = self._entries.popitem(last=False)
                    self.bytes -= old.nbytes
        if event is not None:
            event.set()

    def abandon(self, keys: Iterable[Hashable]) -> None:
        """Claimed samples that will not be published (the batch failed): waiters make them."""
        with self._lock:
            events = [self._pending.pop(k, None) for k in keys]
        for event in events:
            if event is not None:
                event.set()

    def get(self, key: Hashable) -> SampleEntry | None:
        with self._lock:
            return self._entries.get(key)

    def count(self, reused: int, produced: int) -> None:
        with self._lock:
            self.reused_total += int(reused)
            self.produced_total += int(produced)

    def clear(self) -> None:
        """Forget every entry (claims in production stay)."""
        with self._lock:
            self._entries.clear()
            self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)
