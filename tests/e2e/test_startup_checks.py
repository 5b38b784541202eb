"""Start-up checks that keep a run from training on inconsistent data.

- pipeline-server refuses (exit code 2) a val split whose classes are not train's, and names
  the classes that differ;
- pipeline-train against a server without a val split warns once and trains without
  validation, instead of training an epoch and then failing;
- pipeline-server warns at start, one line each, of a split served without a checksum manifest
  (naming the command that writes one) and of a batch size larger than a split (a train split
  would refuse every loader at that size; a val split's batches would be mostly padding).

Real server and trainer processes on the embedded dataset (class folders linked into a tmp
tree); each test takes seconds.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from batchwire.pipeline.dataset import ImageDataset
from batchwire.pipeline.synthetic import default_dataset
from batchwire.prepare.run import Options
from batchwire.prepare.run import run as prepare_run
from batchwire.server.splits import batch_size_warning, class_mismatch
from serverproc import free_tcp_endpoint, running_server, small_server_args

BIN = Path(sys.executable).parent


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def _linked_split(src: Path, dst: Path, drop: set[str] = frozenset(), add: dict | None = None):
    """An ImageFolder at ``dst`` whose class folders link to ``src``'s, minus ``drop``, plus
    ``add`` (new name -> existing class whose images it links)."""
    dst.mkdir()
    for cls in sorted(os.listdir(src)):
        if cls not in drop:
            (dst / cls).symlink_to(src / cls, target_is_directory=True)
    for name, like in (add or {}).items():
        (dst / name).symlink_to(src / like, target_is_directory=True)
    return dst


@pytest.mark.timeout(120)
def test_server_refuses_val_classes_unlike_train(tmp_path: Path) -> None:
    ds = default_dataset()
    val = _linked_split(ds.val_root, tmp_path / "val", drop={"ring"}, add={"zebra": "circle"})
    done = subprocess.run(
        [
            str(BIN / "pipeline-server"), "--train", str(ds.train_root), "--val", str(val),
            "--bind", free_tcp_endpoint(), "--workers", "1", "--batch-size", "8",
            "--image-size", "32",
        ],
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=100,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout
    assert "its classes are not --train's" in done.stdout, done.stdout
    assert "missing in val: ['ring']" in done.stdout, done.stdout
    assert "extra in val: ['zebra']" in done.stdout, done.stdout
    assert "train has 10 classes, val 10" in done.stdout, done.stdout
    assert "serving" not in done.stdout  # it never started


def _dataset(classes: list[str], labels: list[int], kind: str = "folder") -> ImageDataset:
    paths = [f"/x/{i}.jpg" for i in range(len(labels))]
    return ImageDataset(
        paths=paths, labels=np.asarray(labels), classes=classes, root=Path("/x"), kind=kind
    )


def test_class_mismatch_rules() -> None:
    train = _dataset(["a", "b", "c"], [0, 1, 2])
    assert class_mismatch(train, _dataset(["a", "b", "c"], [2, 1])) is None
    assert class_mismatch(train, _dataset(["a", "c"], [0, 1])) == (
        "missing in val: ['b']; train has 3 classes, val 2"
    )
    assert class_mismatch(train, _dataset(["c", "b", "a"], [0])) == (
        "same names in another order: class 0 is 'a' in train, 'c' in val; "
        "train has 3 classes, val 3"
    )
    # List files name classes by id: a val list may lack the last classes, not exceed them.
    listed = _dataset(["0", "1"], [0, 1], kind="list")
    assert class_mismatch(train, listed) is None
    assert "label ids up to 3" in class_mismatch(train, _dataset(list("0123"), [3], "list"))
    # Any source whose classes are only its integer ids (a tar or CSV with integer labels): the
    # same rule as a list file, whatever its kind.
    ids = _dataset(["0", "1", "2"], [0, 2], kind="tar")
    assert class_mismatch(ids, _dataset(["0", "1"], [1], kind="csv")) is None
    assert "label ids up to 3" in class_mismatch(ids, _dataset(list("0123"), [3], "parquet"))


@pytest.mark.timeout(120)
def test_train_without_val_split_warns_once_and_skips_validation() -> None:
    """A server started with --train only: pipeline-train says so before its first step and
    trains; the epoch line says validation was skipped."""
    with running_server(*small_server_args(seed=0), "--log-level", "WARNING") as srv:
        done = subprocess.run(
            [
                str(BIN / "pipeline-train"), "--server", srv.endpoint, "--model", "small",
                "--device", "cpu", "--epochs", "1", "--max-steps", "2", "--log-every", "1",
                "--timeout", "30",
            ],
            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            timeout=100,
        )  # fmt: skip
    out = done.stdout
    assert done.returncode == 0, out
    warning = "serves no val split"
    assert out.count(warning) == 1, out
    assert "unknown split 'val'" in out and "training without validation" in out, out
    assert out.index(warning) < out.index("step 1 (epoch 0"), out
    assert "epoch 0: val skipped" in out and "step 2 (" in out, out


@pytest.mark.timeout(120)
def test_server_warns_of_unchecked_splits_and_batches_larger_than_a_split(tmp_path: Path) -> None:
    """train: 400 images, no manifest, clients may ask batches up to 512; val: one image of
    each of its 10 classes with a `pipeline-prepare --checksums-only` manifest, batch 16."""
    ds = default_dataset()
    val = tmp_path / "val"
    for cls in sorted(os.listdir(ds.val_root)):
        (val / cls).mkdir(parents=True)
        first = sorted(os.listdir(ds.val_root / cls))[0]
        (val / cls / first).write_bytes((ds.val_root / cls / first).read_bytes())
    prepare_run(Options(src=str(val), dst=None, jobs=1, quiet=True, checksums_only=True))
    args = (*small_server_args(seed=0, root=str(ds.val_root)), "--val", str(val))
    with running_server(*args, "--max-batch-size", "512") as srv:
        log = srv.log()
    unchecked = [line for line in log.splitlines() if "no checksum manifest" in line]
    assert len(unchecked) == 1 and "WARNING" in unchecked[0], log
    assert f"train: no checksum manifest for {ds.val_root}" in unchecked[0]
    assert "22 of 100" in unchecked[0] and "all 300 were caught" in unchecked[0]
    assert f"`pipeline-prepare --checksums-only {ds.val_root}`" in unchecked[0]
    assert "checking 10 of 10 files against the checksums" in log, log  # val has one
    assert (
        "train has 400 samples: a loader asking for a batch size above 400 "
        "(--max-batch-size allows up to 512) is refused"
    ) in log, log
    assert (
        "val has 10 samples, fewer than one batch of 16 (--batch-size): its batches are "
        "padded (6 of 16 slots at world size 1, label -100)"
    ) in log, log


def test_batch_size_warning_rules() -> None:
    assert batch_size_warning("train", 64, True, 64, 64) is None
    assert batch_size_warning("val", 10, False, 8, 8) is None
    refused = batch_size_warning("train", 40, True, 64, 64)
    assert refused is not None and "fewer than one batch of 64 (--batch-size)" in refused
    assert "is refused" in refused and "lower --batch-size" in refused
    padded = batch_size_warning("val", 10, False, 8, 32)
    assert padded is not None and "fewer than one batch of 32 (--max-batch-size)" in padded
