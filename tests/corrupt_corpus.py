"""A deterministic corpus of JPEGs with one byte damaged, for the strictness tests (issue 20).

Every seed file is written by PIL (noisy content, so damage shows in the pixels), in the layouts
the decoders treat differently: baseline 4:2:0, 4:2:2, 4:4:4 and greyscale, progressive 4:2:0,
and restart-marked 4:2:0 / 4:2:2 with one MCU per interval (what pipeline-prepare writes). Each
damaged file changes exactly one byte, in the header segments (lengths, tables, frame, scan)
or in the entropy-coded data, to a random value, a flipped bit, 0x00 or 0xFF. Files identical to
their seed are not produced. A few hundred files are generated in well under a second.

`strict_rejects(data)` is the reference: the native strict full decode (`check_jpeg`: every
libjpeg warning but stray header bytes is an error, arithmetic frames refused, restart structure
checked). Whatever it rejects, every decode path must reject.
"""

from __future__ import annotations

import io
import random
import struct
from dataclasses import dataclass

import numpy as np
from PIL import Image

# name -> PIL save options (quality 85 unless given)
LAYOUTS: dict[str, dict] = {
    "base420": {"subsampling": 2},
    "base422": {"subsampling": 1},
    "base444": {"subsampling": 0},
    "grey": {"mode": "L"},
    "prog420": {"subsampling": 2, "progressive": True},
    "rst420": {"subsampling": 2, "restart_marker_blocks": 1},
    "rst422": {"subsampling": 1, "restart_marker_blocks": 1},
}


@dataclass(frozen=True)
class Damaged:
    name: str  # layout, seed and what was changed, for messages
    layout: str
    intact: bytes
    data: bytes


def noisy_pixels(height: int, width: int, seed: int) -> np.ndarray:
    """Smooth gradients plus strong noise: every block has real AC content to damage."""
    rng = np.random.default_rng(seed)
    y = np.linspace(0, 255, height)[:, None, None]
    x = np.linspace(0, 255, width)[None, :, None]
    base = (y * rng.uniform(0.2, 0.8, 3) + x * rng.uniform(0.2, 0.8, 3)) / 1.6
    noise = rng.normal(0, 40, (height, width, 3))
    return np.clip(base + noise, 0, 255).astype(np.uint8)


def seed_jpeg(layout: str, height: int, width: int, seed: int) -> bytes:
    options = dict(LAYOUTS[layout])
    img = Image.fromarray(noisy_pixels(height, width, seed))
    mode = options.pop("mode", None)
    if mode:
        img = img.convert(mode)
    out = io.BytesIO()
    img.save(out, "JPEG", quality=options.pop("quality", 85), **options)
    return out.getvalue()


def segments(data: bytes) -> tuple[list[tuple[int, int, int]], int]:
    """([(marker, start of its length field, end)] of the header segments, start of the first
    scan's entropy-coded data)."""
    out, pos = [], 2
    while pos + 4 <= len(data):
        marker = data[pos + 1]
        (length,) = struct.unpack_from(">H", data, pos + 2)
        out.append((marker, pos + 2, pos + 2 + length))
        pos += 2 + length
        if marker == 0xDA:
            return out, pos
    raise ValueError("no scan")


def damage_positions(data: bytes, rng: random.Random, count: int) -> list[tuple[str, int]]:
    """`count` (where, offset) pairs: about a third in the header (lengths and payloads of
    DQT, DHT, SOF, SOS, DRI), the rest in the entropy-coded data (progressive files: anywhere
    after the first scan header, later scans' headers included)."""
    segs, scan = segments(data)
    header = [(f"{m:02x}", i) for m, a, b in segs if m != 0xE0 for i in range(a, b)]
    lengths = [(f"{m:02x}-length", i) for m, a, _ in segs for i in (a, a + 1)]
    body = [("scan", i) for i in range(scan, len(data) - 2)]
    picks = rng.sample(lengths, min(len(lengths), max(1, count // 8)))
    picks += rng.sample(header, count // 4)
    picks += rng.sample(body, count - len(picks))
    return picks


def damaged_variants(intact: bytes, rng: random.Random, count: int) -> list[tuple[str, bytes]]:
    out = []
    for where, at in damage_positions(intact, rng, count):
        old = intact[at]
        how = rng.choice(("random", "bitflip", "zero", "ff"))
        new = {
            "random": rng.randrange(256),
            "bitflip": old ^ (1 << rng.randrange(8)),
            "zero": 0x00,
            "ff": 0xFF,
        }[how]
        if new == old:
            new = old ^ 0x10
        data = bytearray(intact)
        data[at] = new
        out.append((f"{where}@{at}:{old:02x}->{new:02x}", bytes(data)))
    return out


def targeted_variants(intact: bytes) -> list[tuple[str, bytes]]:
    """Single-byte changes that fuzzing hits rarely but that once served garbage: the frame
    marker made arithmetic (SOF9, SOF10: libjpeg decodes Huffman data as arithmetic noise
    without a warning), and a DQT/DHT length one too long (the first warning is then the benign
    "extraneous bytes before marker", which TurboJPEG reports alone)."""
    segs, _ = segments(intact)
    out = []
    for marker, at, _end in segs:
        if marker in (0xC0, 0xC2):
            for new in (0xC9, 0xCA):
                data = bytearray(intact)
                data[at - 1] = new
                out.append((f"sof{marker:02x}->{new:02x}", bytes(data)))
        if marker in (0xDB, 0xC4):
            data = bytearray(intact)
            data[at + 1] += 1  # lengths here are < 256 * 256 - 1 and never end in 0xFF
            out.append((f"{marker:02x}-length+1@{at}", bytes(data)))
    return out


def corpus(
    seeds: int = 2, per_seed: int = 24, size: tuple[int, int] = (48, 64), seed: int = 20
) -> list[Damaged]:
    """`seeds` images per layout, each damaged `per_seed` ways, plus `targeted_variants` of the
    first: by default 7 x 2 x 24 + 54 = 390 files, deterministic."""
    rng = random.Random(seed)
    files = []
    for layout in LAYOUTS:
        for s in range(seeds):
            intact = seed_jpeg(layout, size[0] + 8 * s, size[1] + 5 * s, seed=1000 * s + 7)
            variants = damaged_variants(intact, rng, per_seed)
            if s == 0:
                variants += targeted_variants(intact)
            for how, data in variants:
                files.append(Damaged(f"{layout}/{s}/{how}", layout, intact, data))
    return files


def strict_rejects(data: bytes) -> str | None:
    """Why the native strict full decode rejects `data`, or None when it accepts it."""
    from batchwire.native.jpeg_roi import JpegRoiError, check_jpeg

    try:
        check_jpeg(data)
    except JpegRoiError as e:
        return str(e)
    return None
