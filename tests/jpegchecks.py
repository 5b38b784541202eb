"""Independent checks of JPEG bytes for the transcoder and prepare tests: a marker parser
(`parse_jpeg`, `assert_restart_layout`) and decoders that are not ours (PIL, djpeg) to compare
pixels with, plus `pil_jpeg` to encode test images, and the real photos of the shared
ImageNet sample (`sample_photos`). Shared by the transcoder, prepare and decode tests."""

from __future__ import annotations

import io
import math
import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageOps

#: The 1,000 ImageNet JPEGs beside the checkout (../shared; never copied into it).
SAMPLE_DIR = Path(__file__).resolve().parents[2] / "shared" / "imagenet-sample"

HAS_DJPEG = shutil.which("djpeg") is not None


# ---- an independent JPEG marker parser ---------------------------------------------------------


@dataclass
class Layout:
    """What a JPEG's markers say: header segments (marker, payload) before the first scan in
    order, the frame, the restart interval, and every scan's component count and RSTn codes."""

    segments: list[tuple[int, bytes]] = field(default_factory=list)
    sof: int = 0
    width: int = 0
    height: int = 0
    sampling: list[tuple[int, int]] = field(default_factory=list)  # (h, v) per component
    restart_interval: int = 0
    scan_components: list[int] = field(default_factory=list)
    restarts: list[int] = field(default_factory=list)  # RSTn marker codes, in order
    ends_with_eoi: bool = False

    def app_and_com(self) -> list[tuple[int, bytes]]:
        return [(m, p) for m, p in self.segments if 0xE0 <= m <= 0xEF or m == 0xFE]

    def mcu_grid(self) -> tuple[int, int]:
        """(MCU rows, MCUs per row) of the first scan."""
        hmax = max(h for h, _ in self.sampling)
        vmax = max(v for _, v in self.sampling)
        if self.scan_components == [1]:  # non-interleaved: one block per MCU
            h, v = self.sampling[0]
            cols = math.ceil(math.ceil(self.width * h / hmax) / 8)
            return math.ceil(math.ceil(self.height * v / vmax) / 8), cols
        return math.ceil(self.height / (8 * vmax)), math.ceil(self.width / (8 * hmax))

    def mcus(self) -> int:
        rows, cols = self.mcu_grid()
        return rows * cols


def parse_jpeg(data: bytes) -> Layout:
    assert data[:2] == b"\xff\xd8", "no SOI"
    out = Layout()
    i = 2
    in_header = True
    while i < len(data):
        assert data[i] == 0xFF, f"expected a marker at {i}"
        while data[i] == 0xFF:  # fill bytes
            i += 1
        marker = data[i]
        i += 1
        if marker == 0xD9:
            out.ends_with_eoi = i == len(data)
            return out
        length = int.from_bytes(data[i : i + 2], "big")
        payload = data[i + 2 : i + length]
        i += length
        if marker in (0xC0, 0xC1, 0xC2, 0xC3, 0xC9, 0xCA):
            out.sof = marker
            out.height = int.from_bytes(payload[1:3], "big")
            out.width = int.from_bytes(payload[3:5], "big")
            n = payload[5]
            out.sampling = [(payload[7 + 3 * c] >> 4, payload[7 + 3 * c] & 15) for c in range(n)]
        elif marker == 0xDD:
            out.restart_interval = int.from_bytes(payload[:2], "big")
        if marker == 0xDA:
            in_header = False
            out.scan_components.append(payload[0])
            while True:  # entropy-coded data up to the next marker that is not RSTn
                j = data.index(b"\xff", i)
                follower = data[j + 1]
                if follower == 0x00:
                    i = j + 2
                elif 0xD0 <= follower <= 0xD7:
                    out.restarts.append(follower)
                    i = j + 2
                elif follower == 0xFF:
                    i = j + 1
                else:
                    i = j
                    break
        elif in_header:
            out.segments.append((marker, payload))
    raise AssertionError("no EOI")


def assert_restart_layout(data: bytes, interval: int | None = 1) -> Layout:
    """One baseline scan of every component, DRI = interval (None: pipeline-prepare's auto,
    the largest of 1 to 4 that divides the MCUs per row), an RSTn (cycling 0..7) after every
    interval of MCUs but the last, EOI at the end."""
    layout = parse_jpeg(data)
    assert layout.sof == 0xC0, hex(layout.sof)
    assert layout.scan_components == [len(layout.sampling)]
    if interval is None:
        per_row = layout.mcu_grid()[1]
        interval = max(d for d in range(1, 5) if per_row % d == 0)
    assert layout.restart_interval == interval
    expected = math.ceil(layout.mcus() / interval) - 1
    assert len(layout.restarts) == expected
    assert layout.restarts == [0xD0 + k % 8 for k in range(expected)]
    assert layout.ends_with_eoi
    return layout


# ---- independent decoders ----------------------------------------------------------------------


def sample_photos(names: Iterable[str]) -> list[bytes]:
    """The bytes of these files of the shared sample; the test skips where it is absent."""
    paths = [SAMPLE_DIR / name for name in names]
    if not all(p.is_file() for p in paths):
        pytest.skip(f"real-photo sample {SAMPLE_DIR} not present on this machine")
    return [p.read_bytes() for p in paths]


def pil_rgb(data: bytes, *, reduce: int = 1, transpose: bool = True) -> np.ndarray:
    """PIL's decode (its own libjpeg) as RGB, at 1/``reduce`` through `draft` (libjpeg's scaled
    IDCT, as TurboJPEG's), EXIF-oriented unless ``transpose`` is False."""
    with Image.open(io.BytesIO(data)) as img:
        if reduce > 1:
            img.draft("RGB", (img.width // reduce, img.height // reduce))
        shown = ImageOps.exif_transpose(img) if transpose else img
        return np.asarray(shown.convert("RGB"))


def pil_pixels(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as img:
        return np.asarray(img)


def djpeg_pixels(data: bytes) -> bytes:
    return subprocess.run(
        ["djpeg", "-dct", "int", "-pnm"], input=data, capture_output=True, check=True
    ).stdout


def assert_same_pixels(a: bytes, b: bytes, djpeg: bool = True) -> None:
    pa, pb = pil_pixels(a), pil_pixels(b)
    assert pa.shape == pb.shape and pa.dtype == pb.dtype
    np.testing.assert_array_equal(pa, pb)
    if djpeg and HAS_DJPEG:
        assert djpeg_pixels(a) == djpeg_pixels(b)


def pil_jpeg(pixels: np.ndarray, **options) -> bytes:
    img = Image.fromarray(pixels)
    mode = options.pop("mode", None)
    if mode:
        img = img.convert(mode)
    out = io.BytesIO()
    img.save(out, "JPEG", **{"quality": 88, **options})
    return out.getvalue()
