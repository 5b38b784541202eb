"""Writes through the `Store` interface on a real S3 store (SeaweedFS, `objectstore.py`) and
a local folder: `put` and the streaming `open_writer` (a multipart upload past one part), the
object visible only once committed, nothing at all after an abort, and errors that name the
URL but never the secret key."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from batchwire.pipeline.storage import LocalStore, open_store
from batchwire.pipeline.storage.objects import PART_BYTES
from bitflips import photos
from objectstore import ADMIN_KEY, seaweed  # noqa: F401  (the fixture)

PREPARE = Path(sys.executable).with_name("pipeline-prepare")

BUCKET = "writes"


@pytest.fixture
def s3_env(seaweed, monkeypatch):  # noqa: F811
    for name, value in seaweed.env().items():
        monkeypatch.setenv(name, value)
    seaweed.put(BUCKET, "probe", b"x")  # the bucket exists (created on first put)
    return seaweed


def _stores(tmp_path):
    yield "local", LocalStore(tmp_path / "out")
    yield "s3", open_store(f"s3://{BUCKET}/w")


def test_put_and_a_streamed_multipart_object(s3_env, tmp_path):
    big = os.urandom(PART_BYTES * 2 + 12345)  # three parts: a real multipart upload
    for kind, store in _stores(tmp_path):
        store.put("a/small.txt", b"hello")
        assert store.read("a/small.txt") == b"hello", kind
        with store.open_writer("shard.tar") as w:
            for start in range(0, len(big), 1 << 20):
                w.write(big[start : start + (1 << 20)])
                with pytest.raises(FileNotFoundError):
                    store.head("shard.tar")  # nothing visible before the commit
            assert w.tell() == len(big)
            assert w.commit() == len(big)
        assert store.head("shard.tar").size == len(big), kind
        assert [o.key for o in store.list("sh")] == ["shard.tar"], kind  # a string prefix
        assert store.read("shard.tar") == big, kind
        with store.open_writer("empty.bin") as w:
            assert w.commit() == 0
        assert store.read("empty.bin") == b"", kind


def test_an_aborted_writer_leaves_nothing(s3_env, tmp_path):
    for kind, store in _stores(tmp_path):
        for size in (1000, PART_BYTES + 1000):  # a single PUT, a started multipart upload
            key = f"torn-{size}.tar"
            with pytest.raises(RuntimeError, match="boom"), store.open_writer(key) as w:
                w.write(os.urandom(size))
                raise RuntimeError("boom")
            with pytest.raises(FileNotFoundError):
                store.head(key)
            assert [o.key for o in store.list("torn")] == [], kind
            with store.open_writer(key) as w:
                w.write(b"abc")
                # a clean exit without commit is an abort too: committing is explicit
            with pytest.raises(FileNotFoundError):
                store.head(key)
    assert not [p for p in (tmp_path / "out").rglob("*") if p.name.endswith(".tmp")]


def test_write_errors_name_the_url_never_the_secret(seaweed, monkeypatch):  # noqa: F811
    env = seaweed.env("reader")  # may read bucket `open` only: writes are refused (403)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    store = open_store(f"s3://{BUCKET}/denied")
    for big in (False, True):
        with pytest.raises(PermissionError) as got, store.open_writer("x.tar") as w:
            w.write(os.urandom(PART_BYTES * 2 if big else 10))
            w.commit()
        text = str(got.value)
        assert f"s3://{BUCKET}/denied/x.tar" in text, text
        assert env["AWS_SECRET_ACCESS_KEY"] not in text and ADMIN_KEY[1] not in text


def test_prepare_shards_to_a_bucket_it_may_not_write(seaweed, tmp_path):  # noqa: F811
    """`pipeline-prepare SRC s3://... --shards`: a refused write (the reader identity may list
    bucket `open` but not write it) ends the run with exit 3 naming the shard's URL, leaves no
    shard, and shows no credential; a URL with credentials in it is refused (exit 2)."""
    src = tmp_path / "src"
    for rel, data in photos(4).items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    seaweed.put("open", "existing.txt", b"x")
    env = {**os.environ, **seaweed.env("reader")}

    def prepare(dst: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(PREPARE), str(src), dst, "--shards", "1GB", "--quiet"],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )

    done = prepare("s3://open/shards")
    out = done.stdout + done.stderr
    assert done.returncode == 3, out
    assert "s3://open/shards/train-000000.tar: access denied" in out, out
    # Nothing written where it was refused (the bucket is shared with other tests of this
    # worker's store: only this test's keys are compared).
    assert [
        k for k in keys_in(seaweed, "open") if k == "existing.txt" or k.startswith("shards")
    ] == ["existing.txt"]
    bad = prepare(f"s3://{ADMIN_KEY[0]}:{ADMIN_KEY[1]}@open/shards")
    assert bad.returncode == 2 and "credentials in the URL are not accepted" in bad.stderr
    for text in (out, bad.stdout + bad.stderr):
        assert (
            ADMIN_KEY[1] not in text and seaweed.env("reader")["AWS_SECRET_ACCESS_KEY"] not in text
        )


def keys_in(store, bucket: str) -> list[str]:
    """Every key in `bucket`, listed by the test's own client."""
    import obstore

    return sorted(m["path"] for chunk in obstore.list(store.client(bucket)) for m in chunk)


def test_checksums_only_of_a_bucket_folder(s3_env, tmp_path):
    """`pipeline-prepare --checksums-only s3://bucket/prefix` (an ImageFolder in a bucket):
    the manifest goes into the bucket beside the classes (not taken for a sample), every
    object is checked at open with `verify_checksums="on"`, and an object overwritten with
    other bytes since is a checksum mismatch."""
    from batchwire.pipeline.checksums import CHECKSUMS_MANIFEST
    from batchwire.pipeline.dataset import open_dataset
    from batchwire.prepare.cli import main as prepare_main

    files = photos(4)
    for rel, data in files.items():
        s3_env.put(BUCKET, f"folder/{rel}", data)
    url = f"s3://{BUCKET}/folder"
    assert prepare_main(["--checksums-only", url, "--quiet", "--jobs", "1"]) == 0
    assert f"folder/{CHECKSUMS_MANIFEST}" in keys_in(s3_env, BUCKET)
    ds = open_dataset(url, tmp_path / "cache", verify_checksums="on")
    assert len(ds) == 4 and ds.checksums is not None and ds.checksums.count == 4
    assert all(ds.checksum_verdict(i, ds.read_bytes(i)).intact for i in range(4))
    first = sorted(files)[0]
    s3_env.put(BUCKET, f"folder/{first}", files[sorted(files)[1]])  # other bytes
    again = open_dataset(url, tmp_path / "cache2", verify_checksums="on")
    problems = [again.checksum_problem(i, again.read_bytes(i)) for i in range(4)]
    assert [i for i, p in enumerate(problems) if p] == [again.paths.index(f"{url}/{first}")]
