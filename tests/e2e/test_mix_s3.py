"""A mixture of a local folder and tar shards on a real S3 store (SeaweedFS, tests/objectstore.py)
serves, byte for byte, the batches of the same mix from local copies (issue 33's test list):
train epochs 0 and 1 in the mix's order and the val mix, images (uint8), labels and indices;
the server's per-part counts agree, and no credential reaches its log."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from batchwire.pipeline.synthetic import default_dataset
from loaderchecks import assert_identical, counting_loader, epoch
from serverproc import running_server

seaweed = pytest.importorskip("objectstore", reason="needs tests/objectstore.py").seaweed

PREPARE = Path(sys.executable).with_name("pipeline-prepare")
BUCKET = "mixes"


@pytest.fixture(scope="module")
def sources(seaweed, tmp_path_factory) -> dict[str, str]:
    """Part a, a local folder (classes 0-3); part b (classes 2-4) as tar shards written by
    `pipeline-prepare --shards`, kept locally and uploaded: the local and the S3 mix texts."""
    root = tmp_path_factory.mktemp("mixs3")
    classes = sorted(p for p in default_dataset().val_root.iterdir() if p.is_dir())
    for name, picked, count in (("a", classes[:4], 6), ("b", classes[2:5], 8)):
        for cls in picked:
            (root / name / cls.name).mkdir(parents=True)
            for f in sorted(cls.iterdir())[:count]:
                shutil.copyfile(f, root / name / cls.name / f.name)
    done = subprocess.run(
        [str(PREPARE), str(root / "b"), str(root / "shards"), "--shards", "70KB", "--quiet"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    count = len(list((root / "shards").glob("train-*.tar")))
    assert count >= 2  # a part over several shards
    seaweed.upload_folder(root / "shards", BUCKET, "b")
    shards = f"train-{{000000..{count - 1:06d}}}.tar"
    return {
        "local": f"mix:a=0.6@{root / 'a'},b=0.4@{root / 'shards' / shards}",
        "s3": f"mix:a=0.6@{root / 'a'},b=0.4@s3://{BUCKET}/b/{shards}",
    }


def args(mix: str) -> tuple[str, ...]:
    return (
        *("--train", mix, "--val", mix, "--batch-size", "8", "--image-size", "32"),
        *("--output-dtype", "uint8", "--seed", "4", "--workers", "1"),
    )


@pytest.mark.timeout(180)
def test_a_mix_with_a_part_on_s3_serves_the_local_copies_batches(seaweed, sources):
    with running_server(*args(sources["local"])) as ref:
        want = {(s, e): epoch(ref.endpoint, s, e) for s, e in (("train", 0), ("train", 1))}
        want["val", 0] = epoch(ref.endpoint, "val", 0)
    env = seaweed.env()
    with running_server(*args(sources["s3"]), env=env) as srv:
        for (split, n), batches in want.items():
            got = epoch(srv.endpoint, split, n, counting_loader)  # its sends are counted
            assert_identical(batches, got, f"S3 mix {split} {n}")
        stats = srv.stats()
        log = srv.log()
    assert stats["counters"]["bad_total"] == 0
    train = next(m for m in stats["mixes"] if m["split"] == "train")
    served = {p["name"]: p["served_total"] for p in train["parts"]}
    sent = sum(len(b[2]) for (s, _), batches in want.items() if s == "train" for b in batches)
    assert sum(served.values()) == sent and served["b"] > 0
    assert f"s3://{BUCKET}/b/" in log and env["AWS_SECRET_ACCESS_KEY"] not in log
