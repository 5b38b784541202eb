"""The GPU path's per-image Python, made cheaper (issue 30 item 6), gives the same bytes.

`narrow_request` (the small JPEG of a crop's restart intervals) and `has_end_of_image` were
rewritten for speed: these tests hold them to frozen copies of the code as it was before (below,
verbatim but for names), request by request: same identity (`is req` or not), same small
JPEG bytes, header, box and other fields. Inputs: pipeline-prepare's rewrite (4 MCUs per
interval at most, fitted to the rows) of real ImageNet photos when the shared sample is here,
PIL files with a marker after every MCU in every EXIF orientation, subsampling and greyscale,
and files the cut leaves alone (no restart markers, progressive, PNG); boxes from a fixed seed,
inside, across and outside the image, with output sizes from 1 px up.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import random
from pathlib import Path

import numpy as np
import pytest
from batchwire import native
from batchwire.native.jpeg_transcode import transcode_restart
from batchwire.pipeline.decode import read_header
from batchwire.pipeline.decode.contract import DecodeRequest
from batchwire.pipeline.decode.fallback import has_end_of_image
from batchwire.pipeline.decode.headers import ImageHeader
from batchwire.pipeline.decode.orientation import swaps_axes
from batchwire.pipeline.decode.region import reach_region
from batchwire.pipeline.decode.restart import EDGE_MARGIN, narrow_request
from oddfiles import exif_orientation_block, pil_jpeg, smooth_image
from PIL import Image

SAMPLE_DIR = Path(__file__).resolve().parents[3] / "shared" / "imagenet-sample"
PHOTOS = 40  # of the sample, rewritten as pipeline-prepare does (about 10 ms each)

if not native.jpeg_roi_available():
    pytest.skip("the ROI JPEG decoder does not build here", allow_module_level=True)

log = logging.getLogger(__name__)


# ---- frozen copies of the code before issue 30 item 6 (commit aec3d02) ----------------------


def _frozen_stored_region(orientation, stored_hw, region):
    from batchwire.pipeline.decode.orientation import orientation_ops

    ops = orientation_ops(orientation)
    y0, x0, y1, x1 = region
    r0, r1, c0, c1 = (x0, x1, y0, y1) if ops.transpose else (y0, y1, x0, x1)
    if ops.flip_rows:
        r0, r1 = stored_hw[0] - r1, stored_hw[0] - r0
    if ops.flip_cols:
        c0, c1 = stored_hw[1] - c1, stored_hw[1] - c0
    return r0, c0, r1, c1


def _frozen_displayed_region(orientation, stored_hw, region):
    from batchwire.pipeline.decode.orientation import orientation_ops

    ops = orientation_ops(orientation)
    r0, c0, r1, c1 = region
    if ops.flip_rows:
        r0, r1 = stored_hw[0] - r1, stored_hw[0] - r0
    if ops.flip_cols:
        c0, c1 = stored_hw[1] - c1, stored_hw[1] - c0
    return (c0, r0, c1, r1) if ops.transpose else (r0, c0, r1, c1)


def _frozen_narrow_request(req: DecodeRequest, *, upright_only: bool = False) -> DecodeRequest:
    from batchwire.native import jpeg_roi

    if req.header.kind != "jpeg" or (upright_only and req.header.orientation != 1):
        return req
    crop = jpeg_roi.crop_bitstream if jpeg_roi.jpeg_roi_available() else None
    if crop is None:
        return req
    h, w = req.header.height, req.header.width
    y0, x0, y1, x1 = reach_region(req.box, req.out_hw, (h, w))
    wanted = (
        max(0, y0 - EDGE_MARGIN),
        max(0, x0 - EDGE_MARGIN),
        min(h, y1 + EDGE_MARGIN),
        min(w, x1 + EDGE_MARGIN),
    )
    if wanted[2] <= wanted[0] or wanted[3] <= wanted[1]:
        return req
    transposed = swaps_axes(req.header.orientation)
    stored_hw = (w, h) if transposed else (h, w)
    found = crop(req.data, *_frozen_stored_region(req.header.orientation, stored_hw, wanted))
    if found is None:
        return req
    small, held = found
    top, left, bottom, right = _frozen_displayed_region(req.header.orientation, stored_hw, held)
    header = ImageHeader(
        height=bottom - top, width=right - left, orientation=req.header.orientation, kind="jpeg"
    )
    by0, bx0, by1, bx1 = (float(v) for v in req.box)
    box = (by0 - top, bx0 - left, by1 - top, bx1 - left)
    return dataclasses.replace(req, data=small, header=header, box=box)


def _frozen_has_end_of_image(data: bytes) -> bool:
    return data[-4096:].rstrip(b"\0").endswith(b"\xff\xd9")


# ---- inputs -----------------------------------------------------------------------------------


def _photos() -> list[bytes]:
    if not SAMPLE_DIR.is_dir():
        log.warning("%s missing: the real-photo half of this test is left out", SAMPLE_DIR)
        return []
    out = []
    for path in sorted(SAMPLE_DIR.glob("*.JPEG"))[:PHOTOS]:
        try:
            out.append(transcode_restart(path.read_bytes(), 4, fit_rows=True))
        except ValueError:  # the sample's few corrupt files: pipeline-prepare copies them
            continue
    return out


def _made() -> list[bytes]:
    pixels = smooth_image(203, 317, seed=5)
    out = [
        pil_jpeg(pixels, restart_marker_blocks=1, exif=exif_orientation_block(o))
        for o in range(1, 9)
    ]
    out.append(pil_jpeg(pixels, restart_marker_blocks=1, subsampling=0))  # 4:4:4
    out.append(pil_jpeg(pixels, restart_marker_blocks=1, subsampling=1))  # 4:2:2
    out.append(pil_jpeg(pixels, restart_marker_blocks=1, mode="L"))
    out.append(pil_jpeg(pixels))  # no restart markers: left alone
    out.append(pil_jpeg(pixels, progressive=True, restart_marker_blocks=1))  # left alone
    png = io.BytesIO()
    Image.fromarray(pixels).save(png, "PNG")
    out.append(png.getvalue())  # not a JPEG: left alone
    return out


@pytest.fixture(scope="module")
def files() -> list[bytes]:
    return _made() + _photos()


def _requests(data: bytes, rng: random.Random) -> list[DecodeRequest]:
    h = read_header(data)
    boxes = [(0.0, 0.0, float(h.height), float(h.width)), (-5.0, -5.0, -1.0, -1.0)]
    boxes.append((h.height - 0.5, h.width - 0.5, h.height + 3.0, h.width + 3.0))
    for _ in range(12):
        y0, x0 = rng.uniform(-8, h.height), rng.uniform(-8, h.width)
        boxes.append((y0, x0, y0 + rng.uniform(0.3, h.height), x0 + rng.uniform(0.3, h.width)))
    return [
        DecodeRequest(k, data, h, box, (rng.choice((1, 7, 64, 224)),) * 2, intact=k % 2 == 0)
        for k, box in enumerate(boxes)
    ]


def test_narrow_request_gives_the_same_request_as_before(files):
    rng = random.Random(30_6)
    narrowed = 0
    for data in files:
        for req in _requests(data, rng):
            for upright_only in (False, True):
                want = _frozen_narrow_request(req, upright_only=upright_only)
                got = narrow_request(req, upright_only=upright_only)
                assert (got is req) == (want is req), req.box
                assert got == want, (req.box, req.out_hw, upright_only)  # every field, bytes too
                narrowed += got is not req
    # The comparison covered real cuts, in every orientation (the frozen copy would otherwise
    # be compared with itself on requests handed back as they were).
    assert narrowed > 10 * len(files)  # 16 a file on the made-up ones alone, more on photos


def test_narrow_request_carries_every_field_of_the_request():
    """`narrow_request` builds its result field by field (see its comment): a field added to
    DecodeRequest must be added there too, and here."""
    assert [f.name for f in dataclasses.fields(DecodeRequest)] == [
        "index",
        "data",
        "header",
        "box",
        "out_hw",
        "intact",
    ]


@pytest.mark.parametrize(
    "data",
    [
        b"\xff\xd8abc\xff\xd9",
        b"\xff\xd8abc\xff\xd9" + b"\0" * 100,
        b"\xff\xd8abc\xff\xd9" + b"\0" * 5000,  # padding past the 4096 bytes looked at
        b"\xff\xd8abc\xff",
        b"\xff\xd8abc\x00\xd9",
        b"\xff\xd8abc\xff\xd9\x01",
        b"\xff\xd9",
        b"\0" * 10,
        b"",
        bytes(np.arange(9000, dtype=np.uint8)) + b"\xff\xd9\0",
    ],
)
def test_has_end_of_image_as_before(data):
    assert has_end_of_image(data) == _frozen_has_end_of_image(data)
