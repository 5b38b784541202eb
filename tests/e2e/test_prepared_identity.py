"""A `pipeline-prepare`d tree serves byte-identical batches to the original tree.

The promise that makes preparing safe: the server decodes a prepared file through its restart
markers (a small JPEG of the crop's intervals) and must produce exactly the batch bytes it
produces from the original file, for the same seed: train (random crops, flips, jitter, DCT
scales) and val (centre crops, padding), every wire dtype, on the embedded dataset (sizes 100
to 600 px, 4:2:0 / 4:2:2 / 4:4:4, greyscale, progressive) and on real ImageNet photos. Real
servers, a real `pipeline-prepare` run, real sockets.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from batchwire import native
from batchwire.client import RemoteLoader
from batchwire.native.jpeg_roi import restart_layout
from batchwire.pipeline.dataset import open_dataset
from batchwire.pipeline.synthetic import default_dataset
from batchwire.wire.batch_spec import torch_dtype
from serverproc import running_server

SAMPLE_DIR = Path(__file__).resolve().parents[3] / "shared" / "imagenet-sample"
PREPARE = Path(sys.executable).with_name("pipeline-prepare")

if not native.jpeg_roi_available():
    pytest.skip("the ROI JPEG decoder does not build here", allow_module_level=True)


def prepare(src: Path, dst: Path) -> Path:
    done = subprocess.run(
        [str(PREPARE), str(src), str(dst), "--quiet"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return dst


def assert_prepared(original: Path, prepared: Path) -> None:
    """Same listing, and every JPEG of the prepared tree can be entered at restart markers
    (else this test would compare the old decode path with itself)."""
    a, b = open_dataset(original), open_dataset(prepared)
    assert [Path(p).relative_to(original) for p in a.paths] == [
        Path(p).relative_to(prepared) for p in b.paths
    ]
    assert a.classes == b.classes and (a.labels == b.labels).all()
    for path in b.paths:
        data = Path(path).read_bytes()
        layout, why = restart_layout(data)
        assert layout is not None and layout["interval"] <= 4, (path, why)


@pytest.fixture(scope="module")
def trees(tmp_path_factory) -> dict[str, tuple[Path, Path, int]]:
    """name -> (original tree, prepared tree, output size)."""
    root = tmp_path_factory.mktemp("prepared")
    embedded = default_dataset().val_root  # 400 files, 10 classes
    out = {"embedded": (embedded, prepare(embedded, root / "embedded"), 48)}
    if SAMPLE_DIR.is_dir():
        photos = root / "photos"
        for k, src in enumerate(sorted(SAMPLE_DIR.glob("*.JPEG"))[:60]):
            cls = photos / f"class{k % 3}"
            cls.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, cls / src.name)
        out["photos"] = (photos, prepare(photos, root / "photos-prepared"), 112)
    for original, prepared, _ in out.values():
        assert_prepared(original, prepared)
    return out


def batches(endpoint: str, split: str, epoch: int) -> list[tuple[torch.Tensor, ...]]:
    loader = RemoteLoader(
        endpoint, split, rank=0, world_size=1, device="cpu", with_indices=True, timeout=60,
        normalize_on_device=False,  # the wire's bytes, compared as they are
    )  # fmt: skip
    loader.set_epoch(epoch)
    try:
        return [tuple(t.clone() for t in batch) for batch in loader]
    finally:
        loader.close()


# Two of the output dtypes: the conversion after the decode is shared by every dtype (each has its
# identity test in test_sources_identity and the unit tier); uint8 and bfloat16 keep both ends.
@pytest.mark.parametrize("dtype", ["uint8", "bfloat16"])
@pytest.mark.parametrize("name", ["embedded", "photos"])
def test_prepared_tree_serves_byte_identical_batches(trees, name, dtype):
    if name not in trees:
        pytest.skip("needs ../shared/imagenet-sample")
    original, prepared, size = trees[name]

    def args(root: Path) -> tuple[str, ...]:
        return (
            *("--train", str(root), "--val", str(root), "--batch-size", "16"),
            *("--image-size", str(size), "--output-dtype", dtype, "--seed", "15"),
            *("--workers", "1"),
        )

    with running_server(*args(original)) as a, running_server(*args(prepared)) as b:
        for split, epoch in (("train", 0), ("train", 1), ("val", 0)):
            want, got = batches(a.endpoint, split, epoch), batches(b.endpoint, split, epoch)
            assert len(want) == len(got) > 0
            for k, (x, y) in enumerate(zip(want, got, strict=True)):
                assert x[0].dtype == torch_dtype(dtype)
                for tx, ty in zip(x, y, strict=True):
                    assert tx.dtype == ty.dtype and tx.shape == ty.shape
                    assert torch.equal(tx.view(torch.uint8), ty.view(torch.uint8)), (
                        f"{split} epoch {epoch} batch {k} differs"
                    )
        assert a.stats()["counters"]["bad_total"] == b.stats()["counters"]["bad_total"] == 0
        assert "train: 16 of 16 sampled JPEGs have restart markers" in b.log()
        assert "train: no sampled JPEG has restart markers; `pipeline-prepare" in a.log()
