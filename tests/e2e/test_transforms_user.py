"""User transforms the transform tests hand to servers as ``file.py:callable`` (no tests here).

They draw from the generator only, so a sample's output is a function of (seed, epoch, sample),
but for `hostile_global_rng`, which also draws from torch's global RNG.
"""

from __future__ import annotations

import os
import sys

import torch
from batchwire.pipeline.transforms import RandomResizedCropFlip

#: The fused op's recipe in plain torch, at the tests' 32 px.
rrc32 = RandomResizedCropFlip(32)
#: Rectangular: 24 high, 40 wide.
rrc24x40 = RandomResizedCropFlip((24, 40))

#: How `hostile` misbehaves on the sample whose generator has this seed (a test fills it, or the
#: environment variable BW_TEST_HOSTILE="SEED:KIND,..." does in a server process): raise
#: (RuntimeError), exit (sys.exit), interrupt (KeyboardInterrupt), or return nan, inf, int300 or
#: int70000 (an int32 tensor full of that), meta (a tensor on the meta device).
HOSTILE: dict[int, str] = {
    int(seed): kind
    for seed, kind in (v.split(":") for v in os.environ.get("BW_TEST_HOSTILE", "").split(",") if v)
}


def hostile(image: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """`rrc32`, but misbehaves as `HOSTILE` says on the samples it names."""
    kind = HOSTILE.get(generator.initial_seed())
    if kind == "raise":
        raise RuntimeError("this transform cannot handle that sample")
    if kind == "exit":
        sys.exit("this transform quits on that sample")
    if kind == "interrupt":
        raise KeyboardInterrupt
    if kind == "meta":
        return torch.empty(3, 32, 32, device="meta")
    if kind in ("int300", "int70000"):
        return torch.full((3, 32, 32), int(kind[3:]), dtype=torch.int32)
    out = rrc32(image, generator)
    if kind in ("nan", "inf"):
        out[1, 3:9, 4:6] = float(kind)
    return out


def hostile_global_rng(image: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """`hostile`, with a brightness jitter from torch's global RNG (no ``generator=``)."""
    out = hostile(image, generator)
    if out.is_floating_point() and out.device.type == "cpu":
        out = (out * (0.8 + 0.4 * torch.rand(1))).clamp_(0, 255)
    return out


def wrong_shape(image: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Always 16 px: the server must refuse it by shape."""
    return torch.zeros(3, 16, 16)
