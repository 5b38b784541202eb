"""A shuffled batch's members of a tar shard on a real S3 store (SeaweedFS, tests/objectstore.py)
are read in the GETs the coalescing rule plans (`storage.coalesce`), as the store itself counts
them, with `ObjectStore.counters()` saying the same; the bytes are the local shard's."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest
from batchwire.pipeline.dataset import open_dataset
from batchwire.pipeline.storage.coalesce import GAP_BYTES, plan_requests

seaweed = pytest.importorskip("objectstore", reason="needs tests/objectstore.py").seaweed
BUCKET = "coalesce"
MEMBER = 700_000  # one between two of the batch's: a gap over GAP_BYTES, under 1 MiB


def _shard(count: int) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for k in range(count):
            for ext, data in ((".jpg", os.urandom(MEMBER)), (".cls", str(k % 3).encode())):
                info = tarfile.TarInfo(f"s{k:04d}{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def test_a_shuffled_batch_makes_the_planned_gets(seaweed, tmp_path: Path, monkeypatch):
    shard = _shard(10)
    (tmp_path / "shard-000.tar").write_bytes(shard)
    seaweed.put(BUCKET, "tars/shard-000.tar", shard)
    for name, value in seaweed.env().items():
        monkeypatch.setenv(name, value)
    local = open_dataset(str(tmp_path / "shard-000.tar"), verify_checksums="off")
    remote = open_dataset(f"s3://{BUCKET}/tars/shard-000.tar", verify_checksums="off")
    batch = [9, 3, 0, 6, 2]  # 2 and 3 adjacent; 0-2 one member apart (~0.7 MB), 3-6, 6-9 two
    reader = remote.reader
    ranges = [(int(reader.offsets[i]), int(reader.offsets[i] + reader.sizes[i])) for i in batch]
    assert GAP_BYTES < ranges[4][0] - ranges[2][1] < 1 << 20  # 0 to 2: obstore merged it
    plan = plan_requests(ranges)
    assert len(plan) == 4  # {0}, {2, 3}, {6}, {9}; obstore's 1 MiB rule made 3

    store = reader.located.store
    gets0, ours0 = seaweed.settled_requests("GET", BUCKET), store.counters()["requests"]
    got = reader.read_many(batch)
    gets = seaweed.settled_requests("GET", BUCKET) - gets0
    assert gets == len(plan)  # what the cost model planned, no more, no fewer
    assert store.counters()["requests"] - ours0 == gets  # the counter is the store's count
    assert got == [local.reader(i) for i in batch]
