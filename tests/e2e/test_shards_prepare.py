"""`pipeline-prepare SRC DST --shards SIZE` (the real command): every source kind as SRC, shards
the `webdataset` library reads back sample for sample (bytes, labels, keys in order), bounded
in size, byte-identical on a second run, the usage and unreadable-sample exits, and each split
in a folder of its own: a folder of two prefixes refused by prepare and by pipeline-server."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import webdataset as wds
import zmq
from batchwire.pipeline.dataset import ImageDataset, open_dataset
from batchwire.pipeline.synthetic import default_dataset
from rawclient import SERVER_ARGS, RawTrainer
from serverproc import free_tcp_endpoint, running_server

PREPARE = Path(sys.executable).with_name("pipeline-prepare")
SIZE = 200_000


def prepare(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(PREPARE), *args, "--quiet"], capture_output=True, text=True, timeout=120
    )


def image_folder(root: Path, files: slice) -> Path:
    """5 classes of the embedded dataset's val split, `files` of each."""
    src = default_dataset().val_root
    for cls in sorted(p for p in src.iterdir() if p.is_dir())[:5]:
        (root / cls.name).mkdir(parents=True)
        for f in sorted(cls.iterdir())[files]:
            shutil.copyfile(f, root / cls.name / f.name)
    return root


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return image_folder(tmp_path_factory.mktemp("src") / "folder", slice(0, 6))


def read_back(dst: Path, prefix: str = "train") -> list[dict]:
    shards = sorted(dst.glob(f"{prefix}-*.tar"))
    assert shards
    return list(wds.WebDataset([str(s) for s in shards], shardshuffle=False))


def assert_holds(samples: list[dict], ds: ImageDataset) -> None:
    assert [s["__key__"] for s in samples] == [f"{i:09d}" for i in range(len(ds))]
    for i, s in enumerate(samples):
        assert s["jpg"] == ds.read_bytes(i), i
        assert int(s["cls"]) == int(ds.labels[i]), i


def test_every_source_kind_to_shards_read_by_webdataset(folder, tmp_path):
    ds = open_dataset(folder, verify_checksums="off")
    csv_path = folder.parent / "m.csv"
    csv_path.write_text(
        "path,label\n"
        + "".join(
            f"{Path(p).relative_to(folder.parent).as_posix()},{ds.classes[lab]}\n"
            for p, lab in zip(ds.paths, ds.labels, strict=True)
        )
    )
    features = {"label": {"_type": "ClassLabel", "names": ds.classes}}
    pq.write_table(
        pa.table(
            {
                "image": [{"bytes": ds.read_bytes(i), "path": None} for i in range(len(ds))],
                "label": pa.array(ds.labels.tolist(), pa.int64()),
            }
        ).replace_schema_metadata({"huggingface": json.dumps({"info": {"features": features}})}),
        folder.parent / "d.parquet",
        row_group_size=7,
    )
    first = tmp_path / "from-folder"
    done = prepare(str(folder), str(first), "--shards", str(SIZE))
    assert done.returncode == 0, done.stderr
    assert f"{len(ds)} samples from" in done.stdout
    assert_holds(read_back(first), ds)
    shards = sorted(first.glob("train-*.tar"))
    assert len(shards) > 1 and all(s.stat().st_size <= SIZE for s in shards)
    assert (first / "classes.txt").read_text().split() == ds.classes
    for name, src in (
        ("csv", csv_path),
        ("parquet", folder.parent / "d.parquet"),
        ("shards", first / f"train-{{000000..{len(shards) - 1:06d}}}.tar"),
    ):
        dst = tmp_path / f"from-{name}"
        done = prepare(str(src), str(dst), "--shards", str(SIZE))
        assert done.returncode == 0, (name, done.stderr)
        assert_holds(read_back(dst), ds)
        # Deterministic: the same SRC gives the same bytes, whatever its kind.
        for a, b in zip(shards, sorted(dst.glob("train-*.tar")), strict=True):
            assert a.read_bytes() == b.read_bytes(), (name, a.name)


def test_usage_and_unreadable_samples(folder, tmp_path):
    dst = tmp_path / "out"
    assert (
        prepare(str(folder), str(dst), "--shards", "1GB", "--shard-prefix", "val").returncode == 0
    )
    again = prepare(str(folder), str(dst), "--shards", "1GB", "--shard-prefix", "val")
    assert again.returncode == 2 and "already holds 1 shards named val-NNNNNN.tar" in again.stderr
    bad = prepare(str(folder), str(tmp_path / "x"), "--shards", "lots")
    assert bad.returncode == 2 and "--shards takes a size such as 1GB" in bad.stderr
    assert prepare(str(folder), "--shards", "1GB").returncode == 2
    listing = folder.parent / "with-missing.txt"
    ds = open_dataset(folder, verify_checksums="off")
    listing.write_text(f"{Path(ds.paths[0]).relative_to(folder.parent)} 0\nfolder/gone.jpg 1\n")
    done = prepare(str(listing), str(tmp_path / "partial"), "--shards", "1GB")
    assert done.returncode == 3, done.stdout + done.stderr
    assert "not written (unreadable):" in done.stdout and "gone.jpg" in done.stdout
    assert len(read_back(tmp_path / "partial")) == 1
    assert not list((tmp_path / "partial").glob(".*.tmp"))


def welcome_samples(endpoint: str, split: str) -> int:
    ctx = zmq.Context()
    try:
        trainer = RawTrainer(endpoint, f"bw-{split}".encode(), ctx, split=split)
        try:
            return trainer.start().num_samples
        finally:
            trainer.leave()
    finally:
        ctx.term()


def test_readme_splits_each_in_a_folder_of_its_own(folder, tmp_path):
    """The README's commands as a user types them: `pipeline-prepare data/train shards/train
    --shards 1GB`, the val split likewise into shards/val, served by `--train shards/train
    --val shards/val`: train serves train's 30 samples only. Val shards written into train's
    folder (the way val leaked into train) are refused by pipeline-prepare, and such a folder
    made by hand is refused by pipeline-server at start, naming each prefix's pattern."""
    val_src = image_folder(tmp_path / "val-src", slice(6, 8))
    shards = tmp_path / "shards"
    train = prepare(str(folder), str(shards / "train"), "--shards", "1GB")
    assert train.returncode == 0, train.stderr
    val = prepare(str(val_src), str(shards / "val"), "--shards", "1GB", "--shard-prefix", "val")
    assert val.returncode == 0, val.stderr
    leak = prepare(str(val_src), str(shards / "train"), "--shards", "1GB", "--shard-prefix", "val")
    assert leak.returncode == 2, leak.stdout + leak.stderr
    assert (
        f"DST {shards / 'train'} holds shards of another prefix (train-* (1 shard: "
        f"train-000000.tar)): each split's shards go in a folder of their own" in leak.stderr
    ), leak.stderr
    assert f"e.g. {shards / 'val'}" in leak.stderr
    assert [p.name for p in (shards / "train").glob("*.tar")] == ["train-000000.tar"]

    split_args = ("--train", str(shards / "train"), "--val", str(shards / "val"))
    with running_server(*split_args, *SERVER_ARGS) as srv:
        assert welcome_samples(srv.endpoint, "train") == 30
        assert welcome_samples(srv.endpoint, "val") == 10

    shutil.copyfile(shards / "val" / "val-000000.tar", shards / "train" / "val-000000.tar")
    refused = subprocess.run(
        [str(PREPARE.with_name("pipeline-server")), "--train", str(shards / "train"),
         "--bind", free_tcp_endpoint(), *SERVER_ARGS],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60,
    )  # fmt: skip
    out = refused.stdout
    assert refused.returncode == 2, out
    assert "holds shards of 2 prefixes (the name before the shard number)" in out, out
    assert f"'{shards / 'train'}/train-000000.tar' or '{shards / 'train'}/val-000000.tar'" in out, (
        out
    )
    assert "serving" not in out
