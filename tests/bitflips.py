"""A bit flip no decoder can see: one bit of a JPEG's entropy-coded data changed such that the
file still decodes without a warning (PIL, batchwire's full decode, and the strict native
transcoder, which turns every libjpeg warning into an error), to other pixels. Only a checksum
catches it (pipeline/checksums.py).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from batchwire.native.jpeg_transcode import JpegTranscodeError, transcode_restart
from batchwire.pipeline.decode import DecodeError, decode_full
from oddfiles import pil_jpeg, scan_data_span, smooth_image
from PIL import Image

SAMPLE_DIR = Path(__file__).resolve().parents[2] / "shared" / "imagenet-sample"


def _pil_pixels(data: bytes) -> np.ndarray | None:
    try:
        with Image.open(io.BytesIO(data)) as img:
            return np.asarray(img.convert("RGB"))
    except (OSError, SyntaxError, ValueError):
        return None


def decodes_cleanly(data: bytes) -> bool:
    """PIL, `decode_full` and the strict native decode (every libjpeg warning an error) all
    decode `data` without complaint."""
    if _pil_pixels(data) is None:
        return False
    try:
        decode_full(data)
        transcode_restart(data, 1)
    except (DecodeError, JpegTranscodeError):
        return False
    return True


def clean_bit_flip(data: bytes, where: float = 0.5) -> bytes:
    """`data` with one entropy-data bit flipped (searching from `where`, a fraction of the scan
    data) such that it `decodes_cleanly` to pixels that differ from the original's.
    AssertionError when no such bit is found."""
    start, end = scan_data_span(data)
    original = _pil_pixels(data)
    first = start + int((end - start) * where)
    for pos in range(first, end - 1):
        if 0xFF in (data[pos - 1], data[pos], data[pos + 1]):
            continue  # never make or break a marker or a stuffed byte
        for bit in range(8):
            flipped = data[:pos] + bytes([data[pos] ^ (1 << bit)]) + data[pos + 1 :]
            if not decodes_cleanly(flipped):
                continue
            pixels = _pil_pixels(flipped)
            if pixels is not None and original is not None and not np.array_equal(pixels, original):
                return flipped
    raise AssertionError("no bit flip in the scan data decodes cleanly")


def photos(n: int) -> dict[str, bytes]:
    """n JPEGs for two classes: real photos where the sample is present, else noisy ones."""
    if SAMPLE_DIR.is_dir():
        sources = [p.read_bytes() for p in sorted(SAMPLE_DIR.iterdir())[:n]]
    else:
        rng = np.random.default_rng(0)
        sources = [
            pil_jpeg(
                np.clip(
                    smooth_image(96, 128, seed=k) + rng.integers(0, 40, (96, 128, 3)), 0, 255
                ).astype(np.uint8)
            )
            for k in range(n)
        ]
    return {f"class{k % 2}/img{k}.jpg": data for k, data in enumerate(sources)}
