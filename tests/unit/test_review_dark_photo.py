"""A photo that is nearly black (its brightest pixel 2 of 255) through a transform returning
0..255 floats, into the default uint8 output: a real photo, served as it is on 9611bed."""

from __future__ import annotations

import numpy as np
import torch
from batchwire.pipeline.local import LocalLoader
from batchwire.pipeline.transforms import RandomResizedCropFlip
from oddfiles import jpeg_bytes

rrc = RandomResizedCropFlip(16)


def as_float(image: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A float pipeline in 0..255 (e.g. one that does its colour maths in float)."""
    return rrc(image, generator).float()


def test_a_near_black_photo_through_a_float_transform_is_served(tmp_path) -> None:
    for c in range(2):
        folder = tmp_path / f"c{c}"
        folder.mkdir()
        for i in range(4):
            (folder / f"{i}.jpg").write_bytes(jpeg_bytes(np.full((40, 48, 3), 2, np.uint8)))
    with LocalLoader(
        tmp_path, batch_size=4, image_size=16, output_dtype="uint8", transform=as_float
    ) as loader:
        images = torch.cat([x for x, _ in loader])
    assert images.shape[0] == 8 and 1 <= int(images.max()) <= 3
