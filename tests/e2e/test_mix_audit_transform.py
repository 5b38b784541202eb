"""Audit of a user transform over a mixture served by a real `pipeline-server`
(docs/transforms.md, docs/mixtures.md): a transform that returns NaN on some files of one part
has each such sample counted, logged and replaced by a sample of the same part; no NaN is
served, and a mid-epoch resume yields the same batches.

The transform writes the decoded image's height as every pixel (float32 output), so each served
sample tells which kind of file it came from: part a's photos (their own heights), part b's
64x50 ones (50), never part b's 64x48 ones (48: the transform returns NaN on them).
"""

from __future__ import annotations

import os

import pytest
import torch
from batchwire.client import RemoteLoader
from jpegchecks import SAMPLE_DIR
from PIL import Image
from serverproc import running_server

SAMPLE = SAMPLE_DIR
TRANSFORM = '''
import torch


def height_or_nan(image, generator):
    """Every pixel the image's height; NaN for a 48-row image."""
    value = float("nan") if image.shape[0] == 48 else float(image.shape[0])
    return torch.full((3, 32, 32), value)
'''


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    files = sorted(SAMPLE.glob("*.JPEG"))[:16]
    if len(files) < 16:
        pytest.skip(f"{SAMPLE} holds too few JPEGs")
    tmp = tmp_path_factory.mktemp("mixxf")
    for k, f in enumerate(files[:8]):
        (tmp / "a" / f"c{k % 2}").mkdir(parents=True, exist_ok=True)
        os.symlink(f, tmp / "a" / f"c{k % 2}" / f.name)
    for k, f in enumerate(files[8:]):  # real photos, made small: 4 of 48 rows, 4 of 50
        folder = tmp / "b" / ("p" if k < 4 else "q")
        folder.mkdir(parents=True, exist_ok=True)
        with Image.open(f) as im:
            im.convert("RGB").resize((64, 48 if k < 4 else 50)).save(folder / f"{k}.jpg")
    (tmp / "xf.py").write_text(TRANSFORM)
    args = (
        "--train", f"mix:a=0.5@{tmp / 'a'},b=0.5@{tmp / 'b'}",
        "--transform", f"{tmp / 'xf.py'}:height_or_nan", "--output-dtype", "float32",
        "--batch-size", "4", "--image-size", "32", "--workers", "1", "--seed", "1",
    )  # fmt: skip
    with running_server(*args) as srv:
        yield srv


def _loader(srv) -> RemoteLoader:
    return RemoteLoader(
        srv.endpoint, "train", device="cpu", with_indices=True, with_metadata=True,
        normalize_on_device=False, prefetch_next_epoch=False, timeout=60,
    )  # fmt: skip


def _epoch(loader: RemoteLoader, epoch: int, stop: int | None = None) -> list[tuple]:
    loader.set_epoch(epoch)
    out = []
    for images, _, indices, metadata in loader:
        out.append((images.clone(), indices.clone(), [m["part"] for m in metadata]))
        if len(out) == stop:
            break
    return out


def test_nan_samples_are_replaced_within_their_part_counted_and_logged(server):
    with _loader(server) as loader:
        batches = _epoch(loader, 0) + _epoch(loader, 1)
    b_draws = 0
    for images, _, parts in batches:
        assert torch.isfinite(images).all(), "a NaN was served"
        for image, part in zip(images, parts, strict=True):
            height = float(image[0, 0, 0])
            assert torch.all(image == height)
            if part == "b":
                b_draws += 1
                assert height == 50, f"a part b sample served from a {height:g}-row image"
            else:
                assert height not in (48, 50), "a part a sample replaced from part b"
    assert b_draws == 2 * 8  # 0.5 of each 16-sample epoch
    errors = server.stats()["counters"]["transform_errors_total"]
    # Half of part b's files fail: each epoch draws all 8 of b's samples once.
    assert errors >= 2 * 4, errors
    assert "height_or_nan returned non-finite values" in server.log()


def test_a_resume_mid_epoch_yields_the_same_replaced_batches(server):
    with _loader(server) as loader:
        whole = _epoch(loader, 2)
    with _loader(server) as first:
        _epoch(first, 2, stop=2)
        state = first.state_dict()
    with _loader(server) as again:
        again.load_state_dict(state)
        rest = _epoch(again, 2)
    assert len(rest) == len(whole) - 2
    for (x, i, p), (y, j, q) in zip(rest, whole[2:], strict=True):
        assert torch.equal(i, j) and p == q and torch.equal(x, y)
