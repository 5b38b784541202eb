"""The decoder interface: what a caller hands a decoder, what it gets back, and how failure looks.

Decoders are pluggable (CPU, nvJPEG, DALI), so the server and the local loader talk only to this:
a list of `DecodeRequest` in, one `DecodeResult` per request out, in order. One bad image must
never fail a batch (a DDP job would stall on every rank), so a failed item comes back with
`image=None` and the reason in `error` instead of raising. Inside the CPU decoder every library's
failure on a bad file is turned into `DecodeError`, so callers can count and replace bad samples
without a catch-all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np
import torch
from batchwire.pipeline.decode.region import Box

if TYPE_CHECKING:
    from batchwire.pipeline.decode.headers import ImageHeader


class DecodeError(Exception):
    """A file that cannot be decoded into an image (empty, not an image, corrupt, truncated)."""


@dataclass(frozen=True)
class DecodedImage:
    """Decoded, oriented pixels (HxWx3 uint8, C-contiguous) and the crop box in their coords."""

    pixels: np.ndarray
    box: Box


@dataclass(frozen=True)
class DecodeRequest:
    """One image to decode: its bytes, its header, the crop (full-size oriented box), the output
    size it will be resized to (which bounds how far the decoder may reduce it)."""

    index: int
    data: bytes
    header: ImageHeader
    box: Box
    out_hw: tuple[int, int]


@dataclass(frozen=True)
class DecodeResult:
    """A decoded HWC uint8 image on the decoder's device and the box in its coords, or
    `image=None` and the reason in `error`. `transient` marks a failure that says nothing
    about the file (out of memory): the caller retries it rather than calling the file bad."""

    image: torch.Tensor | None
    box: Box
    error: str | None = None
    transient: bool = False


@runtime_checkable
class BatchDecoder(Protocol):
    """Something that decodes a list of requests; one bad image never fails the batch."""

    name: str
    device: torch.device

    def decode_batch(self, requests: Sequence[DecodeRequest]) -> list[DecodeResult]: ...
