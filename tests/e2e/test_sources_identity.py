"""The same 64 images as an ImageFolder, as tar shards (written by `pipeline-prepare --shards`
and by the `webdataset` library's own ShardWriter), as Parquet in the Hugging Face layout and as
a CSV manifest of class names serve byte-identical batches from real servers: train epochs 0
and 1 and val, uint8 and float16; `RemoteLoader.classes` names the classes; a mid-epoch resume
from tar shards gives exactly the rest of the epoch.

Photos from ../shared/imagenet-sample when present (else the embedded dataset's JPEGs), four
classes, batches of 16.
"""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import webdataset as wds
from batchwire.pipeline.dataset import open_dataset
from batchwire.pipeline.synthetic import default_dataset
from loaderchecks import assert_identical, epoch, loader
from serverproc import running_server

SAMPLE_DIR = Path(__file__).resolve().parents[3] / "shared" / "imagenet-sample"
PREPARE = Path(sys.executable).with_name("pipeline-prepare")
CLASSES = ["alpha", "bravo", "charlie", "delta"]
IMAGES = 64
B = 16


def _photos() -> list[Path]:
    if SAMPLE_DIR.is_dir():
        return sorted(SAMPLE_DIR.glob("*.JPEG"))[:IMAGES]
    return sorted(default_dataset().val_root.rglob("*.jpg"))[:IMAGES]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    """kind -> what --train/--val is given for it."""
    root = tmp_path_factory.mktemp("sources")
    folder = root / "folder"
    for k, src in enumerate(_photos()):
        cls = folder / CLASSES[k % len(CLASSES)]
        cls.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, cls / f"{k:03d}.jpg")
    ds = open_dataset(folder, verify_checksums="off")
    out = {"folder": str(folder)}

    # Shards of about a quarter of the images' bytes: several shards whether the photos are
    # ImageNet's (7 MB) or the embedded dataset's (0.9 MB, when ../shared is absent).
    total = sum(p.stat().st_size for p in folder.rglob("*.jpg"))
    shard_bytes = str(max(64 << 10, total // 4))
    done = subprocess.run(
        [str(PREPARE), str(folder), str(root / "prepared"), "--shards", shard_bytes, "--quiet"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    shards = sorted((root / "prepared").glob("train-*.tar"))
    assert len(shards) >= 3, shards
    out["prepared-shards"] = str(root / "prepared" / f"train-{{000000..{len(shards) - 1:06d}}}.tar")

    wds_dir = root / "wds"
    wds_dir.mkdir()
    with wds.ShardWriter(str(wds_dir / "shard-%04d.tar"), maxcount=20) as sink:
        for i in range(len(ds)):
            sink.write(
                {"__key__": f"sample{i:04d}", "jpg": ds.read_bytes(i), "cls": int(ds.labels[i])}
            )
    out["webdataset-shards"] = str(wds_dir / "shard-{0000..0003}.tar")

    features = {"image": {"_type": "Image"}, "label": {"_type": "ClassLabel", "names": ds.classes}}
    table = pa.table(
        {
            "image": [
                {"bytes": ds.read_bytes(i), "path": Path(ds.paths[i]).name} for i in range(len(ds))
            ],
            "label": pa.array(ds.labels.tolist(), pa.int64()),
        }
    ).replace_schema_metadata({"huggingface": json.dumps({"info": {"features": features}})})
    pq.write_table(table, root / "train.parquet", row_group_size=10)
    out["parquet"] = str(root / "train.parquet")

    manifest = root / "train.csv"
    with manifest.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["path", "label"])
        for p, lab in zip(ds.paths, ds.labels, strict=True):
            w.writerow([Path(p).relative_to(root).as_posix(), ds.classes[lab]])
    out["csv"] = str(manifest)
    return out


def server_args(source: str, dtype: str) -> tuple[str, ...]:
    return (
        *("--train", source, "--val", source, "--batch-size", str(B), "--image-size", "48"),
        *("--output-dtype", dtype, "--seed", "21", "--workers", "1"),
    )


@pytest.mark.parametrize("dtype", ["uint8", "float16"])
def test_every_source_kind_serves_the_same_batches(sources, dtype):
    with ExitStack() as stack:
        servers = {
            kind: stack.enter_context(running_server(*server_args(src, dtype)))
            for kind, src in sources.items()
        }
        ref = servers["folder"]
        wanted = {
            (s, e): epoch(ref.endpoint, s, e) for s, e in (("train", 0), ("train", 1), ("val", 0))
        }
        for kind, srv in servers.items():
            if kind == "folder":
                continue
            for (split, n), want in wanted.items():
                assert_identical(want, epoch(srv.endpoint, split, n), f"{kind} {split} epoch {n}")
            assert srv.stats()["counters"]["bad_total"] == 0, kind
        for kind, srv in servers.items():
            ld = loader(srv.endpoint, "val")
            try:
                names = CLASSES if kind != "webdataset-shards" else ["0", "1", "2", "3"]
                assert ld.classes == names, kind
                assert ld.class_to_idx == {c: i for i, c in enumerate(names)}
            finally:
                ld.close()


def test_resume_mid_epoch_from_tar_shards(sources):
    with running_server(*server_args(sources["prepared-shards"], "uint8")) as srv:
        whole = epoch(srv.endpoint, "train", 1)
        first = loader(srv.endpoint, "train")
        first.set_epoch(1)
        it = iter(first)
        head = [tuple(t.clone() for t in next(it)) for _ in range(2)]
        state = first.state_dict()
        first.close()
        assert state["epoch"] == 1 and state["next_batch"] == 2
        resumed = loader(srv.endpoint, "train")
        resumed.load_state_dict(state)
        try:
            tail = [tuple(t.clone() for t in batch) for batch in resumed]
        finally:
            resumed.close()
        assert_identical(whole, head + tail, "resumed epoch 1")
