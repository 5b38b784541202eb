"""pipeline-bench's tuned DataLoader and SPDL rows (bench/tuned_baselines.py): the crop each
draws is the crop it serves, at the output size, uint8, and a row that cannot run says why."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from batchwire.bench.baselines import RowLoop, rrc_box
from batchwire.bench.tuned_baselines import (
    PilDraftTransform,
    dataloader_tuned,
    spdl_missing,
    spdl_pipeline,
)
from oddfiles import jpeg_bytes, smooth_image
from PIL import Image

SIZE = 32
LOOP = RowLoop(batch_size=4, image_size=SIZE, measure_images=8, warmup=1)


def photo(tmp_path: Path, name: str, height: int, width: int, seed: int) -> Path:
    path = tmp_path / name
    path.write_bytes(jpeg_bytes(smooth_image(height, width, seed=seed)))
    return path


def full_decode_crop(path: Path, seed: int) -> np.ndarray:
    """The same draw as PilDraftTransform's, cut from the full-size decode."""
    torch.manual_seed(seed)
    with Image.open(path) as img:
        left, top, w, h = rrc_box(*img.size)
        out = img.convert("RGB").resize(
            (SIZE, SIZE), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h)
        )
        flip = torch.rand(1).item() < 0.5
    pixels = np.asarray(out)
    return pixels[:, ::-1] if flip else pixels


@pytest.mark.parametrize("seed", range(6))
def test_the_draft_decode_serves_the_crop_it_drew(tmp_path: Path, seed: int) -> None:
    path = photo(tmp_path, "big.jpg", 600, 800, seed)
    torch.manual_seed(seed)
    with Image.open(path) as img:
        got = PilDraftTransform(SIZE)(img)
        drafted = img.size != (800, 600)
    assert got.dtype == torch.uint8 and tuple(got.shape) == (3, SIZE, SIZE)
    want = full_decode_crop(path, seed).astype(np.int16)
    diff = np.abs(got.permute(1, 2, 0).numpy().astype(np.int16) - want)
    # A reduced-scale decode differs from the full one by a few levels, not by another region.
    assert diff.mean() < 6, (seed, drafted, diff.mean())
    assert drafted  # 800 x 600 cut to 32 px: at least one crop side allows 1/2


def test_the_tuned_dataloader_delivers_uint8_batches(tmp_path: Path) -> None:
    paths = [str(photo(tmp_path, f"{i}.jpg", 90 + i, 120, i)) for i in range(6)]
    measured = dataloader_tuned(paths, [0] * 6, LOOP, workers=0)
    assert measured.images >= 8 and measured.seconds > 0


def test_the_spdl_row_runs_or_says_why_not(tmp_path: Path) -> None:
    missing = spdl_missing()
    if missing is not None:  # this machine's SPDL or FFmpeg is absent: the reason is the row's
        assert missing.startswith("SPDL ") and ("pip install" in missing or "FFmpeg" in missing)
        return
    paths = [str(photo(tmp_path, f"{i}.jpg", 90 + i, 120, i)) for i in range(6)]
    measured = spdl_pipeline(paths, LOOP, threads=2)
    assert measured.images >= 8 and measured.seconds > 0
