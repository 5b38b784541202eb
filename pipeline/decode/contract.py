"""The decoder interface: what a caller hands a decoder, what it gets back, and how failure looks.

Decoders are pluggable (CPU, nvJPEG, DALI), so the server and the local loader talk only to this:
a list of `DecodeRequest` in, one `DecodeResult` per request out, in order. One bad image must
never fail a batch (a DDP job would stall on every rank), so a failed item comes back with
`image=None` and the reason in `error` instead of raising. Inside the CPU decoder every library's
failure on a bad file is turned into `DecodeError`, so callers can count and replace bad samples
without a catch-all.

The "verified intact" chain: no served pixel may come from a file the strict full decode
(`native.jpeg_roi.check_jpeg`: every libjpeg warning an error but stray header bytes,
arithmetic frames refused, restart structure checked) rejects, yet the fast paths read less
than the whole file. Each link says what it verifies and why that is enough:
1. `pipeline-prepare` records, per file, the checksum of the bytes it wrote (or, with
   `--checksums-only`, read) and `intact`: whether those bytes passed the strict full decode
   (a rewritten JPEG: the transcoder read it back strictly and compared coefficients and
   pixels; a JPEG copied as it was or only checksummed: `check_jpeg` itself; anything else, or
   a corrupt JPEG, or one over the pixel cap: false). Older manifests have no verdict: false.
2. The sample loader reads a whole file, checks its bytes against the checksum (a mismatch is
   a bad sample, replaced before any decode), and sets `DecodeRequest.intact` only when they
   match a record that says intact. Equal checksums mean the same bytes (xxh3_64: against
   accidents, not attackers), so those bytes passed the strict full decode.
3. CPU decoder (`cpu.decode_for_crop`): whole-image path, strict (TurboJPEG warnings re-judged
   by the strict check; OpenCV's JPEGs checked by it). Region path (every request not intact):
   the crop is decoded and the rest of the file entropy decoded too (`roi.ROI_VERIFY_TAIL`), so
   it rejects exactly what the strict full decode rejects. An intact request is verified no
   further than it reads (issue 32): a file without a restart layout is read down to the crop's
   last row (plus the EOI marker's presence); a restart-marked one takes the restart path
   (intact requests on restart-marked files only): decodes the crop's intervals and checks the
   scan's structure, not the other intervals nor whether the tables still decode them: a
   changed DHT byte can leave the crop's intervals decodable to wrong pixels. For intact bytes
   that cannot happen (they passed the full decode), and it is the same pixels for about 0.6
   the work.
4. GPU decoders (`fallback.GpuDecoderBase`): nvJPEG and DALI decode much damage without an
   error, so a request that is not intact is strictly checked whole on the CPU first (refused:
   it goes to the CPU decoder as it was, which refuses it); an intact one is not checked, so
   the GPU path has no CPU pass over the data. Either way only sound bytes are cut down to
   their crop's restart intervals (`restart.narrow_request`).
A request not known intact is therefore never less safe, only slower; a file recorded as not
intact is not re-decoded anywhere, it simply takes the strict paths and is rejected there if
it is bad. What no decoder can see (a bit flip that still decodes) is the checksum's job (2).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np
from batchwire.pipeline.decode.region import Box

if TYPE_CHECKING:  # annotations only: the contract itself imports no torch
    import torch


#: The names `--decoder` takes (`select.make_decoder` builds each): here, apart from the
#: decoders, so a command line lists them without importing torch or a GPU library.
DECODERS = ("auto", "cpu", "nvjpeg", "dali")


class DecodeError(Exception):
    """A file that cannot be decoded into an image (empty, not an image, corrupt, truncated)."""


#: `DecodedImage.route` / `DecodeResult.route`: how the CPU decoder read the file.
ROUTE_WHOLE = "whole"  # the whole image (TurboJPEG or OpenCV), strictly
ROUTE_REGION = "region"  # the ROI decoder reading the file itself, tail verified
ROUTE_RESTART = "restart"  # the ROI decoder trusting intact bytes: restart intervals, else no tail


@dataclass(frozen=True)
class DecodedImage:
    """Decoded, oriented pixels (HxWx3 uint8, C-contiguous), the crop box in their coords, and
    the `route` taken (a ROUTE_* name)."""

    pixels: np.ndarray
    box: Box
    route: str = ROUTE_WHOLE


@dataclass(frozen=True)
class ImageHeader:
    """What a file's header says (`headers.read_header` reads it; a `DecodeRequest` carries
    it, so it is the contract's). `height`/`width` are as displayed (after EXIF orientation).

    `kind` is "jpeg" for JPEGs TurboJPEG decodes to RGB (the fast, DCT-scalable path) and
    "other" for everything that goes through OpenCV (PNG, CMYK/YCCK JPEG, ...).
    """

    height: int
    width: int
    orientation: int
    kind: str

    @property
    def pixels(self) -> int:
        return self.height * self.width


@dataclass(frozen=True)
class DecodeRequest:
    """One image to decode: its bytes, its header, the crop (full-size oriented box), the output
    size it will be resized to (which bounds how far the decoder may reduce it).

    `intact`: these exact bytes are known to pass the strict full decode (the sample loader
    found them equal to a checksum that a manifest recorded for a file that passed it). Only
    then may a decoder read less than the whole file: the CPU decoder's restart path, the GPU
    decoders without their strict pre-check (see the module doc). False (the default) is
    always safe: every path is then as strict as the full decode."""

    index: int
    data: bytes
    header: ImageHeader
    box: Box
    out_hw: tuple[int, int]
    intact: bool = False


@dataclass(frozen=True)
class DecodeResult:
    """A decoded HWC uint8 image on the decoder's device and the box in its coords, or
    `image=None` and the reason in `error`. `transient` marks a failure that says nothing
    about the file (out of memory): the caller retries it rather than calling the file bad.
    `route`: the CPU decoder's ROUTE_* name for what it read ("" from a GPU decoder)."""

    image: torch.Tensor | None
    box: Box
    error: str | None = None
    transient: bool = False
    route: str = ""


@runtime_checkable
class BatchDecoder(Protocol):
    """Something that decodes a list of requests; one bad image never fails the batch.

    Optional, looked up by name: ``pool`` and ``threads`` (a `concurrent.futures.Executor`
    and its size, lent to the sample loader, which reads and checks a batch's files on it:
    `CpuBatchDecoder`), ``fallbacks`` (the total of images decoded on the CPU instead, which
    each batch reports: `GpuDecoderBase`), ``close``. The decoder is handed to the producer;
    nothing wraps it.
    """

    name: str
    device: torch.device

    def decode_batch(self, requests: Sequence[DecodeRequest]) -> list[DecodeResult]: ...
