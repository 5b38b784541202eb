"""A dataset read through a `Store` (`listing.ObjectReader`) in the sample loader: the same
samples as the files themselves; a missing object is a bad sample, replaced; a transient store
error is retried and never makes a sample bad. Where the sample loader fetches a batch's samples
in one `read_many` (the batched read for object stores), these hold on that path too."""

from __future__ import annotations

import errno
import threading
from pathlib import Path

import torch
from batchwire.pipeline.augment_plan import AugmentConfig
from batchwire.pipeline.dataset import open_dataset
from batchwire.pipeline.decode import CpuBatchDecoder
from batchwire.pipeline.samples import SampleLoader
from batchwire.pipeline.storage import LocalStore
from batchwire.pipeline.storage.listing import ObjectReader
from batchwire.pipeline.synthetic import default_dataset

CONFIG = AugmentConfig(image_size=24, train=True)


class FlakyStore(LocalStore):
    """A LocalStore whose `flaky` keys fail once with EIO (a store's 503 after its retries)."""

    def __init__(self, root: Path, flaky: set[str]) -> None:
        super().__init__(root)
        self.flaky = set(flaky)
        self.batched = 0
        self._lock = threading.Lock()

    def read(self, key: str) -> bytes:
        with self._lock:
            if key in self.flaky:
                self.flaky.discard(key)
                raise OSError(errno.EIO, f"{key}: HTTP 503 SlowDown (transient)")
        return super().read(key)

    def read_many(self, keys):
        self.batched += 1
        return super().read_many(keys)


def _store_dataset(flaky: set[int], extra_keys: list[str] = ()):
    """(the embedded val split as files, the same read through a FlakyStore, the store);
    `flaky`: indices whose first read fails transiently; `extra_keys` replace the first keys."""
    local = open_dataset(default_dataset().val_root)
    root = Path(default_dataset().val_root)
    keys = [Path(p).relative_to(root).as_posix() for p in local.paths]
    keys[: len(extra_keys)] = list(extra_keys)
    store = FlakyStore(root, {keys[i] for i in flaky})
    ds = open_dataset(root)
    ds.reader = ObjectReader(store, keys)
    ds.paths = [f"s3://b/{k}" for k in keys]
    return local, ds, store


def test_store_reads_give_the_files_samples_and_survive_transient_errors():
    local, remote, _ = _store_dataset({7, 14})
    indices = list(range(0, 400, 7))
    with CpuBatchDecoder(threads=2) as dec:
        want = SampleLoader(local, CONFIG, seed=5, decoder=dec, check_start=False).load(0, indices)
        loader = SampleLoader(
            remote, CONFIG, seed=5, decoder=dec, check_start=False, sleep=lambda s: None
        )
        got = loader.load(0, indices)
    assert [s.index for s in got] == [s.index for s in want] == indices
    assert all(torch.equal(a.image, b.image) for a, b in zip(want, got, strict=True))
    assert loader.counts()["bad_total"] == 0 and loader.counts()["transient_total"] == 2


def test_a_missing_object_is_a_replaced_bad_sample():
    _, remote, _ = _store_dataset(set(), extra_keys=["nowhere/missing.jpg"])
    with CpuBatchDecoder(threads=1) as dec:
        loader = SampleLoader(remote, CONFIG, seed=5, decoder=dec, check_start=False)
        got = loader.load(0, [0, 1, 2])
    assert got[0].replaced and not got[1].replaced and got[0].index != 0
    assert loader.bad_files() == ["s3://b/nowhere/missing.jpg"]
