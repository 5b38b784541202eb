"""Bad input in sources read from a real S3 store (SeaweedFS, tests/objectstore.py) is what it is
locally: a counted, replaced bad sample, never a read retried for ever, never a stall.

- A 0-byte member of a tar shard: obstore refuses an empty byte range ("Invalid range
  requested"), which was taken for a transient failure and retried until the batch failed;
  now it is an empty file, as locally, and the shard's other members read fine.
- Manifest rows leaving the manifest's own root (a bucket URL in a local CSV, another prefix
  or bucket in a bucket manifest) are refused at start naming file:line unless
  --allow-outside-root; allowed, a forbidden (403) or missing (404) object is a bad sample,
  counted once, never retried; no credentials at all is exit 2 at start.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from batchwire.pipeline.dataset import open_dataset
from batchwire.pipeline.local import LocalLoader
from batchwire.pipeline.sources.manifest import ManifestError
from batchwire.pipeline.synthetic import default_dataset
from serverproc import free_tcp_endpoint, running_server

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


# -- manifests that leave their root ------------------------------------------------------------


@pytest.fixture(scope="module")
def objects(seaweed) -> list[bytes]:
    """Six JPEGs as s3://open/m/0..5.jpg (the `reader` identity reads bucket `open`), one as
    s3://mixed/secret/x.jpg (which `reader` may not read: 403 from the store)."""
    jpegs = _jpegs(7)
    for i, data in enumerate(jpegs[:6]):
        seaweed.put("open", f"m/{i}.jpg", data)
    seaweed.put("mixed", "secret/x.jpg", jpegs[6])
    return jpegs


def test_a_bucket_manifest_keeps_to_its_prefix(seaweed, s3_env, objects):
    """URLs under the manifest's own prefix are its keys; another prefix or bucket is refused
    at start naming the line."""
    seaweed.put("open", "m/own.csv", b"path,label\n0.jpg,a\ns3://open/m/1.jpg,b\n")
    got = open_dataset("s3://open/m/own.csv", verify_checksums="off")
    assert list(got.paths) == ["s3://open/m/0.jpg", "s3://open/m/1.jpg"]
    assert got.read_many([0, 1]) == objects[:2]
    for n, row in enumerate(["s3://open/elsewhere/1.jpg", "s3://mixed/secret/x.jpg"]):
        seaweed.put("open", f"m/out{n}.csv", f"path,label\n0.jpg,a\n{row},b\n".encode())
        with pytest.raises(ManifestError, match=rf"out{n}\.csv:3: .* outside the manifest's"):
            open_dataset(f"s3://open/m/out{n}.csv", verify_checksums="off")


def _server_env(seaweed, identity: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    return {**env, **seaweed.env(identity), "OMP_NUM_THREADS": "1"}


def _local_csv(folder: Path) -> Path:
    """A local CSV naming bucket objects: four readable, one forbidden, one missing."""
    rows = [f"s3://open/m/{i}.jpg,{i % 2}" for i in range(4)]
    rows.insert(2, "s3://mixed/secret/x.jpg,1")
    rows.append("s3://open/m/missing.jpg,0")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "remote.csv"
    path.write_text("path,label\n" + "\n".join(rows) + "\n")
    return path


def test_a_local_manifest_of_bucket_urls_needs_allow_outside_root(seaweed, objects, tmp_path):
    """Refused at start naming the line; with --allow-outside-root served, the forbidden and
    the missing object counted as bad samples once each, nothing retried as transient."""
    path = _local_csv(tmp_path)
    env = _server_env(seaweed, "reader")
    args = ("--train", str(path), "--batch-size", "2", "--image-size", "24", "--workers", "1")
    done = subprocess.run(
        [str(Path(sys.executable).with_name("pipeline-server")), *args, "--bind",
         free_tcp_endpoint()],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    assert f"{path}:2: 's3://open/m/0.jpg' is outside the manifest's folder" in out
    assert "--allow-outside-root" in out and "Traceback" not in out

    from batchwire.client import RemoteLoader

    with running_server(*args, "--allow-outside-root", "--seed", "3", env=env) as srv:
        loader = RemoteLoader(srv.endpoint, "train", rank=0, world_size=1, device="cpu",
                              timeout=30)  # fmt: skip
        try:
            assert sum(len(b[0]) for b in loader) == 6  # every slot served
        finally:
            loader.close()
        counters = srv.stats()["counters"]
        log = srv.log()
    assert counters["bad_total"] == 2, log
    assert "s3://mixed/secret/x.jpg" in log and "access denied (HTTP 403" in log
    assert "s3://open/m/missing.jpg" in log and "no such object" in log
    assert "transient" not in log, log


def test_no_credentials_for_url_rows_is_a_setup_error(seaweed, objects, tmp_path, monkeypatch):
    """With --allow-outside-root but no credentials anywhere (the chain ends at a closed
    instance-metadata port): an error at start naming the line, not reads retried for ever."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    env = seaweed.env()
    for name in ("AWS_REGION", "AWS_ENDPOINT_URL", "AWS_ALLOW_HTTP"):
        monkeypatch.setenv(name, env[name])
    monkeypatch.setenv("AWS_METADATA_ENDPOINT", "http://127.0.0.1:9")
    path = _local_csv(tmp_path)
    with pytest.raises(PermissionError, match=r"remote\.csv:2: s3://open: .*no credentials found"):
        open_dataset(path, allow_outside_root=True, verify_checksums="off")


# -- a Parquet row group that declares gigabytes ------------------------------------------------

_PARQUET_CHILD = r"""
import json, resource, sys
from batchwire.pipeline.dataset import open_dataset
from batchwire.pipeline.local import LocalLoader

before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
ds = open_dataset(sys.argv[1], verify_checksums="off")
loader = LocalLoader(ds, split="val", batch_size=8, image_size=24, output_dtype="uint8",
                     threads=1, with_indices=True)
served = [i for b in loader for i in b[2].tolist() if i >= 0]
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"served": len(served), **loader.counts(), "grew_kib": after - before}))
"""


def _hostile_parquet(path: Path, good: list[bytes], rows: int, size: int) -> None:
    """Row group 0: `good` JPEGs; row group 1: `rows` values of `size` zero bytes, zstd (the
    values share one buffer here and compress to almost nothing: a few KB declaring
    rows * size bytes)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def images(values: list[bytes]) -> pa.StructArray:
        return pa.StructArray.from_arrays(
            [pa.array(values, pa.binary()), pa.array([None] * len(values), pa.string())],
            names=["bytes", "path"],
        )

    zero = images([bytes(size)])  # one row, written `rows` times (chunks share its buffer)
    with pq.ParquetWriter(path, pa.schema([("image", zero.type), ("label", pa.int64())]),
                          compression="zstd", use_dictionary=False) as writer:  # fmt: skip
        writer.write_table(
            pa.table({"image": images(good), "label": pa.array([0] * len(good), pa.int64())})
        )
        bomb = pa.table(
            {
                "image": pa.chunked_array([zero] * rows),
                "label": pa.chunked_array([pa.array([1], pa.int64())] * rows),
            }
        )
        writer.write_table(bomb, row_group_size=rows)


def test_a_parquet_row_group_declaring_gigabytes_is_bad_samples_not_memory(tmp_path):
    """64 photos, then 128 rows of 16 MiB of zeros in one row group: 2 GiB declared in ~80 KB
    of zstd. Reading it
    once took the whole column and a combined copy of it (5.9 GB RSS for the server). Now it
    is not read: its samples are bad samples, counted and replaced, and memory stays flat."""
    import pyarrow.parquet as pq

    path = tmp_path / "bomb.parquet"
    _hostile_parquet(path, _jpegs(64), rows=128, size=16 << 20)
    md = pq.ParquetFile(path).metadata
    assert md.num_row_groups == 2 and path.stat().st_size < 1 << 20
    declared = sum(md.row_group(1).column(j).total_uncompressed_size for j in range(3))
    assert declared > 2 << 30 - 1
    done = subprocess.run(
        [sys.executable, "-c", _PARQUET_CHILD, str(path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["served"] == 192  # every slot of the val epoch, the bad ones replaced
    assert got["bad_total"] == 128 and got["transient_total"] == 0, got
    assert got["grew_kib"] < 300 << 10, f"peak RSS grew {got['grew_kib'] >> 10} MiB"
    assert "row group 1 declares" in done.stderr  # named once, at open
