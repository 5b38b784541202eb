"""A first-week user's transform, as transforms.md invites: the built-in recipe in plain torch
(`RandomResizedCropFlip`), given `mean`/`std` as a torchvision pipeline ends in `Normalize`."""

from __future__ import annotations

from pathlib import Path

import pytest
from batchwire.pipeline.local import LocalLoader
from batchwire.pipeline.transforms import RandomResizedCropFlip
from oddfiles import write_image_folder

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def test_a_normalising_transform_into_the_default_uint8_output_is_an_error(tmp_path: Path) -> None:
    """Its floats in about [-2.1, 2.6], rounded and clamped into uint8, are 0..3: a black batch
    sent as data, no log, no count. The error should say the output is uint8."""
    root = write_image_folder(tmp_path / "tree", classes=2, good_per_class=4)
    normalising = RandomResizedCropFlip(32, mean=IMAGENET_MEAN, std=IMAGENET_STD)
    loader = LocalLoader(
        root,
        split="train",
        batch_size=4,
        image_size=32,
        output_dtype="uint8",
        transform=normalising,
    )
    try:
        with pytest.raises(RuntimeError, match="uint8"):
            images, _ = next(iter(loader))
            print("values", images.unique().tolist())  # shown when the test fails
    finally:
        loader.close()
