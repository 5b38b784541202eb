"""Issue 32, item 2: the restart path's own entropy decoder against libjpeg-turbo's.

The restart path decodes its small JPEG with batchwire's baseline Huffman decoder
(csrc/jpeg_fast_huffman.h); `fast_entropy=False` selects libjpeg's own, the reference: every
request must give the same region, size and pixels, or the same error. The decoder hands
anything that is not a sound interval back to libjpeg, so a bug in it could hide behind that
fallback: the tests also check that sound files never take it (`fast_entropy_gave_up`), and that
the damaged ones here do.
"""

from __future__ import annotations

import io
import random
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from batchwire import native
from batchwire.native import jpeg_roi
from oddfiles import noise_image, pil_restart_jpeg
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
SAMPLE_DIR = ROOT.parent / "shared" / "imagenet-sample"
PREPARED_DIR = ROOT / ".cache" / "prepared" / "imagenet-sample"  # pipeline-prepare's copy
SCALES = (1, 2, 4, 8)

if not native.jpeg_roi_available():
    pytest.skip("the ROI JPEG decoder does not build here", allow_module_level=True)


def gave_up() -> int:
    return jpeg_roi.native_function("fast_entropy_gave_up")()


def outcome(data: bytes, region: tuple[int, int, int, int], denom: int, fast: bool):
    """(pixels, region, size) of the restart path's decode, or the error's message."""
    try:
        return jpeg_roi.decode_jpeg_roi(data, *region, denom, fast_entropy=fast)
    except jpeg_roi.JpegRoiError as exc:
        return str(exc)


def differences(data: bytes, regions, denom: int) -> list:
    """The requests whose outcome differs between the two entropy decoders."""
    bad = []
    for region in regions:
        ours, theirs = outcome(data, region, denom, True), outcome(data, region, denom, False)
        if isinstance(ours, str) or isinstance(theirs, str):
            same = ours == theirs
        else:
            same = ours[1:] == theirs[1:] and np.array_equal(ours[0], theirs[0])
        if not same:
            bad.append((region, denom, ours if isinstance(ours, str) else "pixels"))
    return bad


def random_regions(rng: random.Random, height: int, width: int, count: int):
    """Random-resized-crop-like regions (8 % to all of the area), and one 1x1 at a corner."""
    yield (height - 1, width - 1, height, width)
    for _ in range(count):
        h, w = rng.randint(1, height), rng.randint(1, width)
        if rng.random() < 0.8:
            h, w = (
                max(1, int(height * rng.uniform(0.28, 1))),
                max(1, int(width * rng.uniform(0.28, 1))),
            )
        y, x = rng.randint(0, height - h), rng.randint(0, width - w)
        yield (y, x, y + h, x + w)


def full_size(data: bytes, denom: int) -> tuple[int, int]:
    return jpeg_roi.decode_jpeg_roi(data, 0, 0, 1, 1, denom, fast_entropy=False)[2]


def prepared_photos() -> list[bytes]:
    """pipeline-prepare's copy of the sample where it was made (all 1,000 files), else the first
    150 photos rewritten here as pipeline-prepare rewrites them."""
    if PREPARED_DIR.is_dir():
        files = sorted(p for p in PREPARED_DIR.iterdir() if p.suffix.lower() in (".jpeg", ".jpg"))
        if files:
            return [p.read_bytes() for p in files]
    if not SAMPLE_DIR.is_dir():
        pytest.skip("needs the shared imagenet-sample")
    from batchwire.native.jpeg_transcode import transcode_restart
    from batchwire.prepare.job import indexed
    from batchwire.prepare.restarts import AUTO_MOST

    files = sorted(p for p in SAMPLE_DIR.rglob("*") if p.suffix.lower() in (".jpeg", ".jpg"))
    return [
        indexed(transcode_restart(p.read_bytes(), AUTO_MOST, fit_rows=True)) for p in files[:150]
    ]


def test_prepared_photos_decode_alike_and_never_fall_back():
    photos = prepared_photos()
    rng = random.Random(32)
    before = gave_up()
    entered = 0
    for data in photos:
        if jpeg_roi.restart_layout(data)[0] is None:
            continue
        entered += 1
        for denom in SCALES:
            height, width = full_size(data, denom)
            assert differences(data, random_regions(rng, height, width, 1), denom) == []
    assert entered >= 0.9 * len(photos)
    assert gave_up() == before


def cjpeg_restart_jpeg(pixels: np.ndarray, sample: str, quality: int, restart: str) -> bytes:
    """cjpeg writes the samplings PIL cannot (1x2 = 4:4:0, 4x1 = 4:1:1)."""
    ppm = io.BytesIO()
    Image.fromarray(pixels).save(ppm, "PPM")
    return subprocess.run(
        ["cjpeg", "-sample", f"{sample},1x1,1x1", "-restart", restart, "-quality", str(quality)],
        input=ppm.getvalue(),
        capture_output=True,
        check=True,
    ).stdout


def synthetic_files() -> list[tuple[str, bytes]]:
    """Noise (every block busy, long codes and big values) at every sampling the tests of the
    restart path use, at two qualities, one MCU per interval and (cjpeg) several."""
    files = []
    for layout in ("444", "422", "420", "grey"):
        for quality in (50, 95):
            files.append(
                (
                    f"{layout} q{quality}",
                    pil_restart_jpeg(noise_image(53, 61, seed=quality), layout, quality),
                )
            )
    if shutil.which("cjpeg") is not None:
        for sample in ("1x2", "4x1", "2x2", "2x1", "1x1"):
            for restart in ("1B", "3B"):
                pixels = noise_image(45, 96, seed=len(sample))  # 3 divides every MCU row
                files.append(
                    (f"cjpeg {sample} {restart}", cjpeg_restart_jpeg(pixels, sample, 90, restart))
                )
    return files


@pytest.mark.parametrize(
    ("name", "data"), synthetic_files(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_every_sampling_decodes_alike_at_every_scale(name, data):
    assert jpeg_roi.restart_layout(data)[0] is not None, name
    rng = random.Random(name)
    before = gave_up()
    for denom in SCALES:
        height, width = full_size(data, denom)
        regions = [(0, 0, height, width), *random_regions(rng, height, width, 12)]
        assert differences(data, regions, denom) == []
    assert gave_up() == before


def interval_spans(data: bytes) -> list[tuple[int, int]]:
    """[begin, end) of each interval's entropy-coded bytes, from the restart markers."""
    sos = data.index(b"\xff\xda")
    start = sos + 2 + int.from_bytes(data[sos + 2 : sos + 4], "big")
    spans, begin, i = [], start, start
    while i < len(data) - 1:
        if data[i] == 0xFF and data[i + 1] != 0 and data[i + 1] != 0xFF:
            spans.append((begin, i))
            begin = i + 2
            if data[i + 1] == 0xD9:
                break
            i += 2
            continue
        i += 1
    return spans


def mutations(data: bytes, rng: random.Random):
    """Damage inside intervals that keeps the markers where they are (so the restart path
    reads it): flipped bits, bytes dropped, bytes added, an interval's end cut, a stuffed FF,
    a marker inside an interval, a restart marker of the wrong number."""
    spans = [s for s in interval_spans(data) if s[1] - s[0] >= 4]
    for _ in range(40):
        begin, end = rng.choice(spans)
        at = rng.randrange(begin, end)
        kind = rng.randrange(8)
        out = bytearray(data)
        if kind == 0:
            out[at] ^= 1 << rng.randrange(8)
        elif kind == 1:
            out[at] = rng.randrange(256) & 0xFE  # no new 0xFF: any byte but a marker
        elif kind == 2:
            del out[at]
        elif kind == 3:
            out[at:at] = bytes([rng.randrange(0xFF)])
        elif kind == 4:
            del out[at:end]  # the interval ends early: decoding runs into its marker
        elif kind == 5:
            out[end:end] = bytes([0x55] * rng.randint(1, 3))  # a leftover byte or more at its end
        elif kind == 6:
            out[at:at] = b"\xff\x00" if rng.random() < 0.5 else b"\xff\xd9"
        else:
            out[end + 1] = 0xD0 + (out[end + 1] - 0xD0 + 1) % 8 if out[end + 1] != 0xD9 else 0xD9
        yield bytes(out)


def test_damaged_intervals_give_libjpegs_verdict_and_fall_back():
    rng = random.Random(2032)
    before = gave_up()
    checked = 0
    for name, data in synthetic_files()[:8]:
        for damaged in mutations(data, rng):
            height, width = full_size(data, 1)
            for denom in (1, 8):
                regions = [(0, 0, -(-height // denom), -(-width // denom))]
                assert differences(damaged, regions, denom) == [], name
                checked += 1
    assert checked > 500
    assert gave_up() > before  # the damage reached the decoder and it handed it back


def test_truncated_files_fail_alike():
    rng = random.Random(7)
    for name, data in synthetic_files()[:8]:
        height, width = full_size(data, 1)
        for cut in sorted(rng.sample(range(len(data) // 2, len(data)), 12)):
            assert differences(data[:cut], [(0, 0, height, width)], 1) == [], name


# --- Streams no encoder writes: hostile (but libjpeg-valid) tables and odd entropy-coded data ---


def random_code_lengths(rng: random.Random, count: int, long: bool) -> list[int]:
    """bits[0..16] for `count` symbols as libjpeg accepts them (no code of all ones); `long`
    puts every code at 11 bits or more, past the decoder's lookahead."""
    while True:
        bits, code, left = [0] * 17, 0, count
        for length in range(1, 17):
            room = (1 << length) - 1 - code
            if length == 16:
                take = min(left, room)  # the rest, when they fit: else try again
            elif (long and length < 11) or rng.random() < 0.5:
                take = 0
            else:
                take = rng.randint(0, min(left, room))
            bits[length], left, code = take, left - take, code + take
            code <<= 1
        if left == 0:
            return bits


def canonical_codes(bits: list[int], symbols: list[int]) -> dict[int, tuple[int, int]]:
    """symbol -> (code, length), as jdhuff.c assigns them."""
    codes, code, p = {}, 0, 0
    for length in range(1, 17):
        for _ in range(bits[length]):
            codes[symbols[p]] = (code, length)
            code, p = code + 1, p + 1
        code <<= 1
    return codes


class BitWriter:
    """Entropy-coded bytes: FF stuffed as FF 00, or now and then FF FF 00 (libjpeg reads both as
    one FF), and an interval's last byte padded with ones or, at times, anything."""

    def __init__(self, rng: random.Random):
        self.rng, self.acc, self.count, self.out = rng, 0, 0, bytearray()

    def put(self, value: int, length: int) -> None:
        for i in range(length - 1, -1, -1):
            self.acc, self.count = (self.acc << 1) | ((value >> i) & 1), self.count + 1
            if self.count == 8:
                self.out += (
                    b"\xff\xff\x00"
                    if self.acc == 0xFF and self.rng.random() < 0.3
                    else (b"\xff\x00" if self.acc == 0xFF else bytes([self.acc]))
                )
                self.acc = self.count = 0

    def pad(self) -> bytes:
        if self.count:
            free = 8 - self.count
            self.put(
                (1 << free) - 1 if self.rng.random() < 0.6 else self.rng.getrandbits(free), free
            )
        return bytes(self.out)


def write_block(rng: random.Random, out: BitWriter, dc: dict, ac: dict) -> None:
    """One block of random symbols: DC sizes up to 15, any AC symbol (0x10..0xE0 end the block
    as EOB does), runs past the 64th coefficient, ZRL up to the block's end."""
    size = rng.choice(list(dc))
    out.put(*dc[size])
    out.put(rng.getrandbits(size), size)
    k, symbols = 1, list(ac)
    while k < 64:
        symbol = 0 if 0 in ac and rng.random() < 0.2 else rng.choice(symbols)
        out.put(*ac[symbol])
        run, size = symbol >> 4, symbol & 15
        if size == 0 and run != 15:
            break
        out.put(rng.getrandbits(size), size)
        k += 16 if size == 0 else run + 1


HOSTILE_SAMPLINGS = (
    ((1, 1),),
    ((1, 1),) * 3,
    ((2, 2), (1, 1), (1, 1)),
    ((4, 1), (1, 1), (1, 1)),
    ((1, 2), (1, 1), (1, 1)),
    ((2, 1), (1, 2), (1, 1)),
)


def segment(marker: int, payload: bytes) -> bytes:
    return bytes([0xFF, marker]) + (2 + len(payload)).to_bytes(2, "big") + payload


def hostile_tables(rng: random.Random, count: int) -> tuple[bytes, dict]:
    """`count` DC and AC tables (the DHT segments, and their codes by (class, number)): any DC
    size, any of the 256 AC symbols, codes as long as 16 bits, at times none shorter than 11."""
    long = rng.random() < 0.3
    segments, codes = b"", {}
    for t in range(count):
        dc_symbols = rng.sample(range(16), rng.randint(1, 16))
        ac_symbols = list(set(rng.sample(range(256), rng.randint(1, 255))) | {0, 0xF0})
        for cls, symbols in ((0, dc_symbols), (1, ac_symbols)):
            rng.shuffle(symbols)
            bits = random_code_lengths(rng, len(symbols), long)
            segments += segment(0xC4, bytes([(cls << 4) | t, *bits[1:], *symbols]))
            codes[(cls, t)] = canonical_codes(bits, symbols)
    return segments, codes


def hostile_jpeg(rng: random.Random) -> bytes:
    """A baseline JPEG with restart intervals that tile its MCU rows, random tables and random
    symbol streams that libjpeg decodes without a warning; fill bytes before some markers."""
    sampling = rng.choice(HOSTILE_SAMPLINGS)
    width, height = rng.randint(1, 60), rng.randint(1, 40)
    grey = len(sampling) == 1
    mcu_w = 8 * (1 if grey else max(h for h, _ in sampling))
    mcu_h = 8 * (1 if grey else max(v for _, v in sampling))
    per_row, mcus = -(-width // mcu_w), -(-width // mcu_w) * -(-height // mcu_h)
    interval = rng.choice([d for d in range(1, per_row + 1) if per_row % d == 0])
    tables, codes = hostile_tables(rng, min(len(sampling), 2))
    frame = bytes([8, *height.to_bytes(2, "big"), *width.to_bytes(2, "big"), len(sampling)])
    frame += b"".join(bytes([c + 1, (h << 4) | v, 0]) for c, (h, v) in enumerate(sampling))
    scan = bytes([len(sampling)])
    scan += b"".join(bytes([c + 1, min(c, 1) * 0x11]) for c in range(len(sampling)))
    quant = bytes([0, *(rng.choice([1, 2, 16]) for _ in range(64))])
    out = bytearray(b"\xff\xd8" + segment(0xDB, quant))
    out += segment(0xC0, frame) + tables + segment(0xDD, interval.to_bytes(2, "big"))
    out += segment(0xDA, scan + b"\x00\x3f\x00")
    blocks = [min(c, 1) for c, (h, v) in enumerate(sampling) for _ in range(1 if grey else h * v)]
    intervals = -(-mcus // interval)
    for i in range(intervals):
        writer = BitWriter(rng)
        for _ in range(min(interval, mcus - i * interval)):
            for t in blocks:
                write_block(rng, writer, codes[(0, t)], codes[(1, t)])
        out += writer.pad() + b"\xff" * rng.choice([0, 0, 1, 3])
        out += bytes([0xFF, 0xD0 + i % 8]) if i < intervals - 1 else b"\xff\xd9"
    return bytes(out)


def test_hostile_tables_and_odd_streams_decode_alike():
    """Codes up to 16 bits (all of them past the lookahead at times), DC sizes to 15, runs past
    the 64th coefficient, ZRL at a block's end, EOB-like symbols, padding bits not all ones,
    FF FF 00 stuffing and fill bytes before markers: our decoder reads every one of these
    sound files itself, with libjpeg's pixels."""
    rng = random.Random(3202)
    before = gave_up()
    for _ in range(150):
        data = hostile_jpeg(rng)
        assert jpeg_roi.restart_layout(data)[0] is not None
        for denom in SCALES:
            height, width = full_size(data, denom)
            regions = [(0, 0, height, width), *random_regions(rng, height, width, 1)]
            assert differences(data, regions, denom) == []
    assert gave_up() == before


def test_damaged_hostile_streams_give_libjpegs_verdict():
    rng = random.Random(3203)
    checked = 0
    for _ in range(60):
        data = hostile_jpeg(rng)
        if not any(end - begin >= 4 for begin, end in interval_spans(data)):
            continue
        for damaged, _ in zip(mutations(data, rng), range(4), strict=False):
            for denom in (1, 8):
                assert differences(damaged, [(0, 0, 10**6, 10**6)], denom) == []
                checked += 1
    assert checked > 300
