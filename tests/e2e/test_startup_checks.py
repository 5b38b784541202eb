"""Start-up checks that keep a run from training on inconsistent data.

- pipeline-server refuses (exit code 2) a val split whose classes are not train's, and names
  the classes that differ;
- pipeline-train against a server without a val split warns once and trains without
  validation, instead of training an epoch and then failing.

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
from batchwire.server.splits import class_mismatch
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
