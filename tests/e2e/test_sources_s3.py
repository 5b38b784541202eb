"""Tar shards and Parquet on a real S3 object store (SeaweedFS, tests/objectstore.py) serve the
batches their local ImageFolder serves, byte for byte (train epochs 0 and 1, val; uint8), and a
mid-epoch resume from S3 shards gives exactly the rest of the epoch. `pipeline-prepare
--shards` writes its shards straight to the bucket: the bytes of the local run, read back by
the `webdataset` library itself (presigned URLs, its own curl reader) and served."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import obstore
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import webdataset as wds
from batchwire.pipeline.dataset import open_dataset
from batchwire.pipeline.synthetic import default_dataset
from loaderchecks import assert_identical, epoch, loader
from serverproc import running_server

# The SeaweedFS fixture (tests/objectstore.py) comes with the object-store backend.
seaweed = pytest.importorskip("objectstore", reason="needs tests/objectstore.py").seaweed

PREPARE = Path(sys.executable).with_name("pipeline-prepare")
BUCKET = "sources"


@pytest.fixture(scope="module")
def data(seaweed, tmp_path_factory) -> dict[str, str]:
    """kind -> --train argument: the local folder, shards and Parquet in the bucket."""
    root = tmp_path_factory.mktemp("s3src")
    folder = root / "folder"
    src = default_dataset().val_root
    for cls in sorted(p for p in src.iterdir() if p.is_dir())[:4]:
        (folder / cls.name).mkdir(parents=True)
        for f in sorted(cls.iterdir())[:12]:
            shutil.copyfile(f, folder / cls.name / f.name)
    ds = open_dataset(folder, verify_checksums="off")
    done = subprocess.run(
        [str(PREPARE), str(folder), str(root / "shards"), "--shards", "150KB", "--quiet"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    count = len(list((root / "shards").glob("train-*.tar")))
    assert count >= 3
    features = {"label": {"_type": "ClassLabel", "names": ds.classes}}
    (root / "pq").mkdir()
    pq.write_table(
        pa.table(
            {
                "image": [{"bytes": ds.read_bytes(i), "path": None} for i in range(len(ds))],
                "label": pa.array(ds.labels.tolist(), pa.int64()),
            }
        ).replace_schema_metadata({"huggingface": json.dumps({"info": {"features": features}})}),
        root / "pq" / "train.parquet",
        row_group_size=6,
    )
    seaweed.upload_folder(root / "shards", BUCKET, "shards")
    seaweed.upload_folder(root / "pq", BUCKET, "pq")
    return {
        "folder": str(folder),
        "s3-shards": f"s3://{BUCKET}/shards/train-{{000000..{count - 1:06d}}}.tar",
        "s3-shards-prefix": f"s3://{BUCKET}/shards",
        "s3-parquet": f"s3://{BUCKET}/pq/train.parquet",
    }


def args(source: str) -> tuple[str, ...]:
    return (
        *("--train", source, "--val", source, "--batch-size", "8", "--image-size", "32"),
        *("--output-dtype", "uint8", "--seed", "9", "--workers", "1"),
    )


@pytest.fixture(scope="module")
def want(data) -> dict:
    """The local ImageFolder's batches: (split, epoch) -> batches."""
    with running_server(*args(data["folder"])) as ref:
        return {
            (s, e): epoch(ref.endpoint, s, e) for s, e in (("train", 0), ("train", 1), ("val", 0))
        }


def test_shards_and_parquet_on_s3_serve_the_local_batches(seaweed, data, want, tmp_path):
    # The default cache folder (not a fresh one): it holds the built native extension, and
    # shard indexes are keyed by the store, key and ETag, so sharing it is safe.
    env = seaweed.env()
    for kind in ("s3-shards", "s3-parquet"):
        with running_server(*args(data[kind]), env=env) as srv:
            for (split, n), batches in want.items():
                assert_identical(
                    batches, epoch(srv.endpoint, split, n), f"{kind} {split} epoch {n}"
                )
            ld = loader(srv.endpoint, "val")
            try:
                assert ld.classes == sorted(ld.classes) and len(ld.classes) == 4, kind
            finally:
                ld.close()
            assert srv.stats()["counters"]["bad_total"] == 0
            # The start line's memory counts the read-ahead of tar shards in a bucket only.
            ahead = "MiB read-ahead (tar shards in a bucket)" in srv.log()
            assert ahead == (kind == "s3-shards"), srv.log()[-2000:]
            if kind == "s3-shards":
                first = loader(srv.endpoint, "train")
                first.set_epoch(1)
                it = iter(first)
                head = [tuple(t.clone() for t in next(it)) for _ in range(2)]
                state = first.state_dict()
                first.close()
                resumed = loader(srv.endpoint, "train")
                resumed.load_state_dict(state)
                try:
                    tail = [tuple(t.clone() for t in b) for b in resumed]
                finally:
                    resumed.close()
                assert_identical(want[("train", 1)], head + tail, "resumed from S3 shards")


def test_a_prefix_of_shards_opens_as_shards(seaweed, data, tmp_path, monkeypatch):
    """`s3://bucket/shards` (a prefix holding only shards) is the shards, in name order."""
    for name, value in seaweed.env().items():
        monkeypatch.setenv(name, value)
    local = open_dataset(data["folder"], verify_checksums="off")
    got = open_dataset(data["s3-shards-prefix"], tmp_path / "cache", verify_checksums="off")
    assert got.kind == "tar" and got.classes == local.classes
    # Shown as the URL, not a Path's "s3:/sources/..." (logs, errors, stats).
    assert got.root == f"{data['s3-shards-prefix']}/train-000000.tar"
    assert "'s3://sources/shards/train-000000.tar'" in repr(got)
    pq_ds = open_dataset(data["s3-parquet"], tmp_path / "cache", verify_checksums="off")
    assert pq_ds.root == data["s3-parquet"] and "s3://" in repr(pq_ds)
    assert (got.labels == local.labels).all()
    assert got.reader.read_many(list(range(len(got)))) == [
        local.read_bytes(i) for i in range(len(local))
    ]


def prepare_to(dst: str, src: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(PREPARE), src, dst, "--shards", "150KB", "--quiet"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )


def test_prepare_writes_shards_to_s3(seaweed, data, want):
    """`pipeline-prepare FOLDER s3://bucket/made --shards 150KB`: the local run's shards, byte
    for byte, that `webdataset` reads back sample for sample and a server serves as the
    folder; a second run refuses to overwrite them; no credential in any output."""
    env = seaweed.env()
    folder = data["folder"]
    dst = f"s3://{BUCKET}/made"
    done = prepare_to(dst, folder, env)
    ds = open_dataset(folder, verify_checksums="off")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(ds)} samples from {folder}" in done.stdout and dst in done.stdout
    local = sorted((Path(folder).parent / "shards").glob("train-*.tar"))
    client = seaweed.client(BUCKET)
    keys = sorted(m["path"] for chunk in obstore.list(client, prefix="made/") for m in chunk)
    names = [f"made/train-{k:06d}.tar" for k in range(len(local))]
    assert keys == ["made/.batchwire-prepare-checksums.jsonl", "made/classes.txt", *names]
    for path, key in zip(local, names, strict=True):
        assert bytes(obstore.get(client, key).bytes()) == path.read_bytes(), key
    assert bytes(obstore.get(client, "made/classes.txt").bytes()).decode().split() == ds.classes

    # An independent reader: webdataset over presigned http URLs (its curl handler).
    urls = [str(obstore.sign(client, "GET", key, timedelta(minutes=10))) for key in names]
    samples = list(wds.WebDataset(urls, shardshuffle=False))
    assert [s["__key__"] for s in samples] == [f"{i:09d}" for i in range(len(ds))]
    for i, s in enumerate(samples):
        assert s["jpg"] == ds.read_bytes(i) and int(s["cls"]) == int(ds.labels[i]), i

    with running_server(*args(dst), env=env) as srv:
        for (split, n), batches in want.items():
            assert_identical(batches, epoch(srv.endpoint, split, n), f"{dst} {split} epoch {n}")
        assert srv.stats()["counters"]["bad_total"] == 0
        log = srv.log()
    # The members' checksums written beside the shards, found there and checked every read.
    assert f"{dst}: checking {len(ds)} of {len(ds)} samples against the checksums" in log, log
    again = prepare_to(dst, folder, env)
    assert again.returncode == 2, again.stdout + again.stderr
    assert f"DST {dst} already holds {len(names)} shards" in again.stderr
    secret = env["AWS_SECRET_ACCESS_KEY"]
    for text in (done.stdout, done.stderr, again.stdout, again.stderr, log):
        assert secret not in text
