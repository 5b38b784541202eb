"""The CPU decoder: `decode_for_crop` for one image, `CpuBatchDecoder` for a batch on threads.

`decode_for_crop` decodes just enough of an image to cut a crop from it: the native
region-of-interest decoder where it is built (`roi.py`), else the whole image (`whole.py`) at the
smallest DCT scale that still covers the output. `CpuBatchDecoder` runs it on a thread pool
(TurboJPEG, libjpeg and OpenCV release the GIL) and keeps the decoder contract: one bad image
comes back as an error result, never as an exception that fails the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import cv2
import torch
from batchwire.common.cores import available_cores
from batchwire.pipeline.decode.contract import (
    ROUTE_WHOLE,
    DecodedImage,
    DecodeError,
    DecodeRequest,
    DecodeResult,
)
from batchwire.pipeline.decode.headers import ImageHeader
from batchwire.pipeline.decode.region import Box
from batchwire.pipeline.decode.roi import decode_roi
from batchwire.pipeline.decode.whole import choose_dct_scale, decode_pixels


def decode_for_crop(
    data: bytes,
    header: ImageHeader,
    box: Box,
    out_hw: tuple[int, int],
    *,
    roi: bool = True,
    intact: bool = False,
) -> DecodedImage:
    """Decode just enough of the image to cut `box` (full-size oriented coords) at `out_hw`.

    Returns the decoded, oriented image (possibly DCT-reduced, possibly only the region around
    the box that the resize reads), the box re-expressed in it and the route taken.
    `roi=False` decodes the whole image (benchmarks and tests compare the two). `intact`
    (`DecodeRequest.intact`: the bytes are known to pass the strict full decode) lets the ROI
    decoder read only what the crop needs: a restart-marked file entered at its markers, any
    other file without its tail (`roi.ROI_VERIFY_TAIL`); otherwise it reads the file itself with
    the tail verified, which rejects whatever the strict full decode rejects.
    """
    y0, x0, y1, x1 = (float(v) for v in box)
    scale = (1, 1)
    if header.kind == "jpeg":
        scale = choose_dct_scale(y1 - y0, x1 - x0, int(out_hw[0]), int(out_hw[1]))
        if roi:
            out = (int(out_hw[0]), int(out_hw[1]))
            decoded = decode_roi(data, header, (y0, x0, y1, x1), scale, out, intact=intact)
            if decoded is not None:
                return decoded
    pixels = decode_pixels(data, header, scale)
    # Ratio of actual to header size (not num/denom): TurboJPEG rounds scaled sizes up, and
    # this maps the full image extent onto the full decoded extent either way.
    sy = pixels.shape[0] / header.height
    sx = pixels.shape[1] / header.width
    return DecodedImage(pixels, (y0 * sy, x0 * sx, y1 * sy, x1 * sx), ROUTE_WHOLE)


def _decode_request(req: DecodeRequest) -> DecodeResult:
    try:
        decoded = decode_for_crop(req.data, req.header, req.box, req.out_hw, intact=req.intact)
        image = torch.from_numpy(decoded.pixels)  # inside: whatever it refuses is this image's
    except DecodeError as e:
        return DecodeResult(image=None, box=req.box, error=str(e))
    except MemoryError as e:  # the machine's state, not the file's (headers bound the size)
        return DecodeResult(image=None, box=req.box, error=f"MemoryError: {e}", transient=True)
    except (ValueError, OSError, cv2.error) as e:
        return DecodeResult(image=None, box=req.box, error=f"{type(e).__name__}: {e}")
    return DecodeResult(image=image, box=decoded.box, route=decoded.route)


_CHUNKS_PER_THREAD = 4


def chunked(items: Sequence, threads: int) -> list[Sequence]:
    """``items`` in chunks for a pool of ``threads``: about `_CHUNKS_PER_THREAD` chunks per
    thread, not one future each. A future's handoff costs tens of microseconds of GIL-holding
    Python, a noticeable share of the per-image overhead, while a few chunks per thread still
    balance images of uneven decode cost. The sample loader cuts its reads so too."""
    size = max(1, -(-len(items) // (max(1, threads) * _CHUNKS_PER_THREAD)))
    return [items[i : i + size] for i in range(0, len(items), size)]


def _map_chunk(fn: Callable, chunk: Sequence) -> list:
    return [fn(item) for item in chunk]


class CpuBatchDecoder:
    """TurboJPEG/OpenCV decoding on a thread pool (both release the GIL while decoding).

    Results come back in request order whatever the thread count, and decoding is a pure
    function of the bytes, so 1 and N threads give bit-identical images. `pool` (None for one
    thread) is lent to the sample loader for its reads (`SampleLoader._each`).
    """

    name = "cpu"

    def __init__(self, threads: int | None = None) -> None:
        self.threads = max(1, int(threads if threads is not None else available_cores()))
        self.device = torch.device("cpu")
        self.pool: ThreadPoolExecutor | None = None
        if self.threads > 1:
            self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="bw-decode")

    def map(self, fn: Callable, items: Sequence) -> list:
        """Run `fn` over `items` on the decode threads, results in order (`chunked`)."""
        if self.pool is None or len(items) <= 1:
            return [fn(item) for item in items]
        out: list = []
        chunks = chunked(items, self.threads)
        for part in self.pool.map(_map_chunk, [fn] * len(chunks), chunks):
            out.extend(part)
        return out

    def decode_batch(self, requests: Sequence[DecodeRequest]) -> list[DecodeResult]:
        return self.map(_decode_request, requests)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None

    def __enter__(self) -> CpuBatchDecoder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CpuBatchDecoder(threads={self.threads})"
