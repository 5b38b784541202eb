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
do not match, samples do. `BatchProducer.produce` with a window (`reuse`) assembles its batch:
samples in the window are copied; of the missing ones it takes up to `CHUNK` that nobody is
making (`take`), makes them as one small batch into a scratch tensor and publishes them, and
again, until every sample is found or being made by another producer; then it waits for those
(a producer waits only when all it lacks is being made by producers that are making, never
waiting while holding samples, so no deadlock and no producer idles while work is left). Two
producers on overlapping batches thus split the missing samples between them chunk by chunk.

Cost: every sample of a batch through the window is copied once into the batch (a made one
from its scratch chunk, which the window keeps as is: no second copy to publish it). Measured on
the 2-core CPU machine (2026-11-25, loaded): one 224x224 uint8 sample (147 KiB) copies in 15-20
us, against about 6 ms of a core to read, decode and augment it (bench_sweep: ~300-430 images/s
on 2 cores): under 0.5 %, whether the sample was reused or made. Assembling would cost more than
it saves where a sample is cheap to make and dear to copy: on a `--device cuda` server decoding
and augmenting are on the GPU and the batch's host copy is the cost, so the server does not use
the window there; nor for multi-view batches or user transforms (not per-sample bytes of one
output). The server has a window only when told to expect a mix of batch sizes
(--max-batch-size above --batch-size); there every batch goes through it, since a job of another
batch size may ask for its samples a moment later: a lone job on such a server pays the copy
above, elsewhere nothing.

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

#: Samples a producer takes (and makes as one small batch) at a time: producers assembling
#: overlapping batches split the missing samples between them chunk by chunk.
CHUNK = 16
#: How long a producer waits at most for samples another producer is making before it looks
#: again (they are published chunk by chunk; a failed batch abandons its chunk at once).
WAIT_S = 1.0


@dataclass(frozen=True)
class SampleEntry:
    """One augmented sample: its output bytes (a [3, H, W] tensor as written in a batch), its
    label and the dataset index its pixels come from (a substitute's for a replaced one)."""

    image: torch.Tensor
    label: int
    pixel_index: int
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

    def take(self, keys: Iterable[Hashable], limit: int) -> list[Hashable]:
        """Up to ``limit`` of ``keys`` that are neither in the window nor being made: the
        caller makes them now and must `publish` or `abandon` each."""
        out: list[Hashable] = []
        with self._lock:
            for key in keys:
                if len(out) >= limit:
                    break
                if key in self._entries or key in self._pending:
                    continue
                self._pending[key] = threading.Event()
                out.append(key)
        return out

    def found(self, keys: Iterable[Hashable]) -> dict[Hashable, SampleEntry]:
        """The entries of ``keys`` in the window (their age unchanged: see `publish`)."""
        out: dict[Hashable, SampleEntry] = {}
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None:
                    out[key] = entry
        return out

    def events(self, keys: Iterable[Hashable]) -> list[threading.Event]:
        """The events of ``keys`` being made by other producers."""
        with self._lock:
            return [self._pending[k] for k in keys if k in self._pending]

    def publish(self, key: Hashable, entry: SampleEntry) -> None:
        """A taken sample is made: into the window (oldest out past `max_bytes`).

        First in, first out: an entry is a view of its chunk's scratch tensor, and a chunk's
        memory goes back once all its entries left. In publishing order they leave together
        (at most one partly gone chunk per producer), so the window's memory stays within
        `max_bytes` plus that; reordering on reads could pin a chunk per surviving entry."""
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
        """Taken samples that will not be published (the batch failed): others make them."""
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
