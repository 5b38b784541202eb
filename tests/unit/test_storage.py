"""pipeline.storage, in-process: URLs and redaction, store errors as the loader's OSErrors, the
bucket listing's order against the folder walk's, list files, sizes, and CachedStore (LRU
bound, torn entries, stale temporaries, restart). The object store itself is exercised against
a real one in tests/e2e/test_object_store*.py."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import obstore
import pytest
from batchwire.pipeline.decode.files import is_transient
from batchwire.pipeline.index_cache import scan_image_folder
from batchwire.pipeline.storage import LocalStore, ObjectInfo, StoreOptions, open_store
from batchwire.pipeline.storage.cache import CachedStore, parse_size
from batchwire.pipeline.storage.errors import to_os_error
from batchwire.pipeline.storage.listing import listing_from_objects, parse_list_text
from batchwire.pipeline.storage.urls import parse_url, redact, redact_url


def test_urls_parse_and_never_show_credentials(monkeypatch):
    u = parse_url("s3://bucket/a/b/")
    assert (u.scheme, u.bucket, u.prefix, u.root) == ("s3", "bucket", "a/b", "s3://bucket/a/b")
    assert u.parent()[0].root == "s3://bucket/a" and u.parent()[1] == "b"
    with pytest.raises(ValueError, match="credentials in the URL") as err:
        parse_url("s3://AKID:topsecret@bucket/x")
    assert "topsecret" not in str(err.value)
    with pytest.raises(ValueError, match="unsupported URL scheme"):
        parse_url("ftp://host/x")
    assert redact_url("s3://k:s@b/p?X-Amz-Signature=abc") == "s3://b/p"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "sekrit-value-123")
    text = "GET http://u:p@host/b/k?sig=1 failed with key sekrit-value-123"
    assert redact(text) == "GET http://host/b/k failed with key <AWS_SECRET_ACCESS_KEY>"


def test_open_store_picks_by_location(tmp_path):
    assert isinstance(open_store(tmp_path), LocalStore)
    assert isinstance(open_store(f"file://{tmp_path}"), LocalStore)
    with pytest.raises(ValueError, match="credentials in the URL"):
        open_store("s3://a:b@bucket/p")


def _obstore_error(path: str) -> BaseException:
    store = obstore.store.MemoryStore()
    try:
        obstore.get(store, path)
    except Exception as exc:  # what obstore really raises for a missing object
        return exc
    raise AssertionError("no error")


class _Fake(Exception):
    """Stands for an obstore error text (the classification reads the status it quotes)."""


@pytest.mark.parametrize(
    ("text", "kind", "transient"),
    [
        ("Server returned non-2xx status code: 503 Service Unavailable: <Code>SlowDown</Code>",
         OSError, True),
        ("Server returned non-2xx status code: 500 Internal Server Error", OSError, True),
        ("HTTP error: error sending request", OSError, True),
        ("Server returned non-2xx status code: 403 Forbidden: <Code>AccessDenied</Code>",
         PermissionError, False),
        ("Server returned non-2xx status code: 404 Not Found: <Code>NoSuchBucket</Code>",
         FileNotFoundError, False),
        ("Server returned non-2xx status code: 416 Range Not Satisfiable", OSError, False),
        ("Error performing PUT http://169.254.169.254/latest/api/token", OSError, True),
    ],
)  # fmt: skip
def test_store_errors_become_the_loaders_oserrors(text, kind, transient):
    err = to_os_error(_Fake(text), "s3://b/k.jpg")
    assert isinstance(err, kind) and is_transient(err) is transient
    assert str(err).startswith("[Errno") and "s3://b/k.jpg" in str(err)


def test_a_missing_object_from_obstore_is_a_bad_sample():
    err = to_os_error(_obstore_error("nope.jpg"), "s3://b/nope.jpg")
    assert isinstance(err, FileNotFoundError) and err.errno == errno.ENOENT
    assert not is_transient(err) and "no such object" in str(err)


def test_bucket_listing_orders_like_the_folder_walk(tmp_path):
    names = ["b/x.jpg", "a/2.png", "a/sub/1.jpg", "a/10.JPG", "c/readme.txt", "a/.hidden.jpg",
             ".git/a.jpg", "top.jpg", "b/z/y/w.webp"]  # fmt: skip
    for name in names:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    walked = scan_image_folder(tmp_path)
    objects = sorted((ObjectInfo(n, 1, "v") for n in names), key=lambda o: o.key)
    listed = listing_from_objects(objects)
    assert listed.classes == walked.classes == ["a", "b", "c"]
    assert listed.keys == walked.rel_paths
    assert np.array_equal(listed.labels, walked.labels)


def test_list_text_keys_stay_in_the_folder():
    keys, labels = parse_list_text("# c\nn01/a b.jpg 3\n\n./x/../y.jpg 0\n", "s3://b/l.txt")
    assert keys == ["n01/a b.jpg", "y.jpg"] and labels.tolist() == [3, 0]
    for bad in ("../a.jpg 1", "/etc/passwd 1", "a.jpg", "a.jpg tench"):
        with pytest.raises(ValueError, match=r"s3://b/l\.txt:1"):
            parse_list_text(bad, "s3://b/l.txt")


def test_sizes():
    assert parse_size("500M") == 500 << 20 and parse_size("2G") == 2 << 30
    assert parse_size(123) == 123 and parse_size("1.5KiB") == 1536
    with pytest.raises(ValueError):
        parse_size("lots")
    with pytest.raises(ValueError, match="both a directory and a size"):
        StoreOptions(cache_dir="/tmp/x")


class CountingStore(LocalStore):
    """A LocalStore that counts the reads that reach it (its batched reads call these)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.reads = 0

    def read(self, key: str) -> bytes:
        self.reads += 1
        return super().read(key)

    def read_ranges(self, key: str, ranges):
        self.reads += 1
        return super().read_ranges(key, ranges)


@pytest.fixture
def objects(tmp_path) -> CountingStore:
    root = tmp_path / "objects"
    root.mkdir()
    for i in range(10):
        (root / f"{i}.bin").write_bytes(os.urandom(1000 + i))
    return CountingStore(root)


def test_cache_serves_a_second_read_locally(objects, tmp_path):
    cache = CachedStore(objects, tmp_path / "cache", 1 << 20)
    keys = [f"{i}.bin" for i in range(10)]
    first = cache.read_many([*keys, "missing.bin"])
    assert isinstance(first[-1], FileNotFoundError)  # errors pass through, are not cached
    assert objects.reads == 11
    assert cache.read_many(keys) == first[:-1] and objects.reads == 11
    assert cache.read("3.bin") == (objects.root / "3.bin").read_bytes() and objects.reads == 11
    ranges = [(0, 10), (500, 600)]
    want = [(objects.root / "4.bin").read_bytes()[a:b] for a, b in ranges]
    assert cache.read_ranges("4.bin", ranges) == want
    reads = objects.reads
    assert cache.read_ranges("4.bin", ranges) == want
    assert objects.reads == reads
    assert cache.counters()["hits"] >= 13


def test_cache_evicts_least_recently_used_within_its_bound(objects, tmp_path):
    entry = 24 + 1000  # header + payload of 0.bin (others are a few bytes larger)
    cache = CachedStore(objects, tmp_path / "cache", 3 * entry + 20)
    for key in ("0.bin", "1.bin", "2.bin"):
        cache.read(key)
    cache.read("0.bin")  # 0 is now the most recent
    cache.read("3.bin")  # evicts 1, the least recently used
    assert cache.counters()["evicted"] >= 1 and cache.counters()["bytes"] <= 3 * entry + 20
    reads = objects.reads
    cache.read("0.bin")
    assert objects.reads == reads  # kept
    cache.read("1.bin")
    assert objects.reads == reads + 1  # evicted, fetched again
    files = [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= 3 * entry + 20


def test_cache_survives_a_restart_and_drops_torn_entries(objects, tmp_path):
    root = tmp_path / "cache"
    cache = CachedStore(objects, root, 1 << 20)
    keys = [f"{i}.bin" for i in range(10)]
    want = cache.read_many(keys)
    entries = sorted(p for p in root.rglob("*") if p.is_file())
    assert len(entries) == 10
    # A crash mid-write leaves a temporary (never an entry's name); a power loss after the
    # rename may leave an entry torn: both are found and never served.
    stale = entries[0].parent / f".{entries[0].name}.999.1.tmp"
    stale.write_bytes(b"partial")
    os.utime(stale, (1, 1))
    torn = entries[3]
    torn.write_bytes(torn.read_bytes()[:-7])
    reads = objects.reads
    again = CachedStore(objects, root, 1 << 20)
    assert not stale.exists()
    assert again.read_many(keys) == want
    assert objects.reads == reads + 1  # only the torn one fetched again
    assert again.counters()["corrupt"] == 1


def test_cache_is_keyed_by_the_objects_version(objects, tmp_path):
    version = {"0.bin": "etag-1"}
    cache = CachedStore(objects, tmp_path / "cache", 1 << 20, versions=version.get)
    old = cache.read("0.bin")
    (objects.root / "0.bin").write_bytes(b"rewritten")
    assert cache.read("0.bin") == old  # same version: the cached copy
    version["0.bin"] = "etag-2"
    assert cache.read("0.bin") == b"rewritten"  # a listing with a new ETag: fetched again


def test_pinned_versions_key_ranges_too(objects, tmp_path):
    cache = CachedStore(objects, tmp_path / "cache", 1 << 20)
    cache.pin_versions({"0.bin": "v1"})
    old = cache.read_ranges("0.bin", [(0, 9)])
    (objects.root / "0.bin").write_bytes(b"rewritten" + os.urandom(991))
    assert cache.read_ranges("0.bin", [(0, 9)]) == old  # same version: the cached range
    cache.pin_versions({"0.bin": "v2"})  # opened again, the shard's HEAD saw a new version
    assert cache.read_ranges("0.bin", [(0, 9)]) == [b"rewritten"]


def test_local_writes_appear_whole_or_not_at_all(tmp_path):
    store = LocalStore(tmp_path / "out")
    store.put("a/b.txt", b"hello")
    assert store.read("a/b.txt") == b"hello"
    with store.open_writer("s.tar") as w:
        w.write(b"x" * 1000)
        assert w.tell() == 1000 and not (tmp_path / "out" / "s.tar").exists()
        assert w.commit() == 1000
    assert store.head("s.tar").size == 1000
    with pytest.raises(RuntimeError), store.open_writer("torn.tar") as w:
        w.write(b"y" * 10)
        raise RuntimeError
    with store.open_writer("uncommitted.tar") as w:
        w.write(b"z")
    assert sorted(o.key for o in store.list()) == ["a/b.txt", "s.tar"]  # no temporaries left
    assert [o.key for o in store.list("s")] == ["s.tar"]
    with pytest.raises(PermissionError):
        store.open_writer("../escape.tar")
