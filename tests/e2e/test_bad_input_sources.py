"""Bad input in sources read from a real S3 store (SeaweedFS, tests/objectstore.py) is what it is
locally: a counted, replaced bad sample, never a read retried for ever, never a stall.

- A 0-byte member of a tar shard: obstore refuses an empty byte range ("Invalid range
  requested"), which was taken for a transient failure and retried until the batch failed;
  now it is an empty file, as locally, and the shard's other members read fine.
"""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Iterator

import pytest
import torch
from batchwire.pipeline.dataset import open_dataset
from batchwire.pipeline.local import LocalLoader
from batchwire.pipeline.synthetic import default_dataset

seaweed = pytest.importorskip("objectstore", reason="needs tests/objectstore.py").seaweed

BUCKET = "badsrc"


@pytest.fixture
def s3_env(seaweed) -> Iterator[dict[str, str]]:
    """The store's AWS_* environment in this process (open_dataset reads it), then removed."""
    env = seaweed.env()
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield env
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _jpegs(count: int) -> list[bytes]:
    ds = open_dataset(default_dataset().val_root, verify_checksums="off")
    return [ds.read_bytes(i) for i in range(count)]


def _tar(members: list[tuple[str, bytes]]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 0
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def _epoch(data, **kw) -> tuple[list[tuple[torch.Tensor, ...]], dict[str, int]]:
    loader = LocalLoader(
        open_dataset(data, verify_checksums="off"),
        split="val",
        batch_size=4,
        image_size=24,
        output_dtype="uint8",
        threads=1,
        with_indices=True,
        **kw,
    )
    try:
        batches = [tuple(t.clone() for t in b) for b in loader]
        return batches, loader.counts()
    finally:
        loader.close()


def test_a_zero_byte_tar_member_on_s3_is_the_bad_sample_it_is_locally(seaweed, s3_env, tmp_path):
    jpegs = _jpegs(11)
    members: list[tuple[str, bytes]] = []
    for i, data in enumerate(jpegs):
        members += [(f"s{i:03d}.jpg", data), (f"s{i:03d}.cls", str(i % 3).encode())]
    members.insert(10, ("s005x.jpg", b""))  # the 0-byte member, mid-shard
    members.insert(11, ("s005x.cls", b"1"))
    shard = _tar(members)
    local = tmp_path / "shard-000.tar"
    local.write_bytes(shard)
    seaweed.put(BUCKET, "tars/shard-000.tar", shard)

    want, want_counts = _epoch(str(local))
    got, got_counts = _epoch(f"s3://{BUCKET}/tars/shard-000.tar")
    assert want_counts["bad_total"] == 1, want_counts  # the empty member, counted locally
    assert got_counts == want_counts  # the same on S3: no transient retries, one bad sample
    assert len(got) == len(want) == 3  # 12 samples, batches of 4: every slot served
    for k, (x, y) in enumerate(zip(want, got, strict=True)):
        for tx, ty in zip(x, y, strict=True):
            assert torch.equal(tx, ty), f"batch {k}"


def test_an_empty_range_is_empty_bytes_without_a_request(seaweed, s3_env):
    from batchwire.pipeline.storage.objects import ObjectStore

    seaweed.put(BUCKET, "ranges/obj.bin", b"0123456789")
    store = ObjectStore(f"s3://{BUCKET}/ranges")
    try:
        assert store.read_ranges("obj.bin", [(4, 4), (10, 10)]) == [b"", b""]
        assert store.counters()["requests"] == 0  # nothing asked of the store
        assert store.read_ranges("obj.bin", [(0, 2), (5, 5), (8, 10)]) == [b"01", b"", b"89"]
        got = store.read_ranges_many([("obj.bin", [(3, 3)]), ("obj.bin", [(3, 3), (1, 4)])])
        assert got == [[b""], [b"", b"123"]]
        assert store.counters()["requests"] == 2 and store.counters()["errors"] == 0
    finally:
        store.close()
