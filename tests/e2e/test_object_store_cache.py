"""The local object cache (--cache-dir, --cache-size): a second epoch reads nothing from the
store (counted by the store itself) and gives the same batches; a process killed while writing
entries leaves none that is torn or wrong."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from batchwire.client import RemoteLoader
from batchwire.pipeline.storage import LocalStore
from batchwire.pipeline.storage.cache import CachedStore, _read_entry
from batchwire.pipeline.synthetic import default_dataset
from objectstore import seaweed  # noqa: F401  (the fixture)
from serverproc import running_server


def _epoch(endpoint: str, epoch: int) -> list[tuple[torch.Tensor, ...]]:
    loader = RemoteLoader(
        endpoint, "train", rank=0, world_size=1, device="cpu", with_indices=True, timeout=60,
        prefetch_next_epoch=False,  # epoch 1's batches only once epoch 0 is done
    )  # fmt: skip
    loader.set_epoch(epoch)
    try:
        return [tuple(t.clone() for t in b) for b in loader]
    finally:
        loader.close()


def test_second_epoch_reads_nothing_from_the_store(seaweed, tmp_path):  # noqa: F811
    local = default_dataset().val_root  # 400 images: batches of 16 take every one each epoch
    seaweed.upload_folder(local, "cached", "val")
    args = (
        *("--batch-size", "16", "--image-size", "32", "--seed", "3", "--workers", "1"),
        *("--listing-ttl", "0"),
    )
    cache = ("--cache-dir", str(tmp_path / "cache"), "--cache-size", "64M")
    with (
        running_server("--train", str(local), *args) as a,
        running_server("--train", "s3://cached/val", *args, *cache, env=seaweed.env()) as b,
    ):
        first = _epoch(b.endpoint, 0)
        gets = seaweed.settled_requests("GET", "cached")
        second = _epoch(b.endpoint, 1)
        assert seaweed.settled_requests("GET", "cached") == gets, "epoch 1 read from the store"
        for epoch, got in ((0, first), (1, second)):
            want = _epoch(a.endpoint, epoch)
            assert len(want) == len(got) == 25
            for x, y in zip(want, got, strict=True):
                assert all(torch.equal(p, q) for p, q in zip(x, y, strict=True))
        assert b.stats()["counters"]["bad_total"] == 0
    entries = [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    assert len(entries) == 400
    # A restarted server finds its cache: once it has listed the prefix, no read of an object.
    with running_server("--train", "s3://cached/val", *args, *cache, env=seaweed.env()) as c:
        gets = seaweed.settled_requests("GET", "cached")
        _epoch(c.endpoint, 2)
        assert seaweed.settled_requests("GET", "cached") == gets


_WRITER = """
import itertools, sys
from batchwire.pipeline.storage import LocalStore
from batchwire.pipeline.storage.cache import CachedStore
round_ = [0]
src, root = LocalStore(sys.argv[1]), sys.argv[2]
store = CachedStore(src, root, 1 << 30, versions=lambda k: str(round_[0]))
print("ready", flush=True)
for r in itertools.count():  # a new version of every object each round: writes never stop
    round_[0] = r
    for i in range(12):
        store.read(f"{i}.bin")
"""


@pytest.mark.parametrize("delay", [0.05, 0.13, 0.31])
def test_a_kill_mid_write_leaves_no_torn_entry(tmp_path, delay):
    """A child writes 4 MB entries in a loop (each write takes a while) and is SIGKILLed at
    some point of one: every entry under its final name is whole and right, and a new cache
    over the folder serves every object correctly."""
    src = tmp_path / "objects"
    src.mkdir()
    for i in range(12):
        (src / f"{i}.bin").write_bytes(os.urandom(4 << 20))
    root = tmp_path / "cache"
    child = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(src), str(root)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        # `delay` counts from the first whole entry, so a loaded machine (a slow first write)
        # still kills the child in the middle of a later one.
        deadline = time.monotonic() + 60
        while not any(p.is_file() and not p.name.endswith(".tmp") for p in root.rglob("*")):
            assert time.monotonic() < deadline, "the writer wrote nothing in 60 s"
            time.sleep(0.005)
        time.sleep(delay)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    entries = [p for p in root.rglob("*") if p.is_file() and not p.name.endswith(".tmp")]
    assert entries, "killed before any entry was written: the test proves nothing"
    for path in entries:
        assert _read_entry(path) is not None, f"torn entry {path}"
    cache = CachedStore(LocalStore(src), root, 1 << 30, versions=lambda key: "0")
    for i in range(12):  # round 0's entries where written, fetched again where not
        assert cache.read(f"{i}.bin") == (src / f"{i}.bin").read_bytes()
    assert cache.counters()["corrupt"] == 0 and cache.counters()["hits"] > 0


def test_a_shard_rewritten_in_the_bucket_is_not_served_from_the_cache(
    seaweed,  # noqa: F811  (the fixture)
    tmp_path,
    monkeypatch,
):
    """Tar shards behind the local cache: a shard overwritten in place in the bucket (same
    size and members, one byte changed: a new ETag) is fetched again at the next open, not
    served from the entries of its old version, so its checksum manifest catches the change."""
    from batchwire.pipeline.dataset import open_dataset
    from batchwire.pipeline.storage import StoreOptions, set_default_options
    from batchwire.prepare.shards import write_shards
    from bitflips import photos

    for name, value in seaweed.env().items():
        monkeypatch.setenv(name, value)
    src = tmp_path / "src"
    for rel, data in photos(4).items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    url = "s3://cachedshards/s"
    seaweed.put("cachedshards", "other.txt", b"x")  # the bucket exists (created on first put)
    write_shards(str(src), url, 1 << 30, jobs=1)  # one shard, with its checksums
    options = StoreOptions(cache_dir=str(tmp_path / "cache"), cache_size=64 << 20)
    set_default_options(options)
    try:
        first = open_dataset(url, tmp_path / "index", verify_checksums="on")
        before = [first.read_bytes(i) for i in range(len(first))]
        assert first.reader.located.store.counters()["misses"] > 0  # entries now cached
        shard = seaweed.client("cachedshards")
        import obstore

        data = bytearray(obstore.get(shard, "s/train-000000.tar").bytes())
        at = int(first.reader.offsets[2]) + 100
        data[at] ^= 0x01
        obstore.put(shard, "s/train-000000.tar", bytes(data))
        again = open_dataset(url, tmp_path / "index", verify_checksums="on")
        after = [again.read_bytes(i) for i in range(len(again))]
    finally:
        set_default_options(StoreOptions())
    assert after[2] != before[2] and after[:2] == before[:2] and after[3:] == before[3:]
    problems = [again.checksum_problem(i, after[i]) for i in range(len(after))]
    assert [i for i, p in enumerate(problems) if p] == [2]
