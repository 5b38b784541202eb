"""User transforms the transform tests hand to servers as ``file.py:callable`` (no tests here).

They draw from the generator only, so a sample's output is a function of (seed, epoch, sample).
"""

from __future__ import annotations

import os

import torch
from batchwire.pipeline.transforms import RandomResizedCropFlip

#: The fused op's recipe in plain torch, at the tests' 32 px.
rrc32 = RandomResizedCropFlip(32)
#: Rectangular: 24 high, 40 wide.
rrc24x40 = RandomResizedCropFlip((24, 40))

#: `fails_on_seed` raises on the sample whose generator has this seed (a test sets it, or the
#: environment variable BW_TEST_FAIL_SEED does in a server process).
FAIL_SEEDS: set[int] = {int(v) for v in os.environ.get("BW_TEST_FAIL_SEED", "").split(",") if v}


def fails_on_seed(image: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """`rrc32`, but raises on the samples whose generator seed is in `FAIL_SEEDS`."""
    if generator.initial_seed() in FAIL_SEEDS:
        raise RuntimeError("this transform cannot handle that sample")
    return rrc32(image, generator)


def wrong_shape(image: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Always 16 px: the server must refuse it by shape."""
    return torch.zeros(3, 16, 16)
