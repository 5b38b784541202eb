"""Generators of real odd image files for the decode and bad-input tests.

Every file is produced with PIL (or by patching bytes PIL wrote), so the tests exercise the
decoders on genuine encoder output: CMYK, progressive, greyscale, EXIF-rotated, truncated,
empty, text, PNG-named-.jpg, a JPEG whose header claims 60000x60000, and corrupt JPEGs whose
end marker is intact (cut in half then FF D9, middle zeroed or randomised, 2 kB claiming
9000x9000).
"""

from __future__ import annotations

import io
import struct
from pathlib import Path

import numpy as np
from PIL import Image

GOOD_KINDS = ("rgb", "progressive", "grey", "cmyk", "png_as_jpg", "rgba_png")
BAD_KINDS = ("truncated", "empty", "text", "huge_header", "garbage_after_soi")
# Corrupt files whose end marker is intact (PIL opens most of them without a word) and a small
# file with a plausible-looking but impossible header: bad for the strict decoder only.
CORRUPT_KINDS = ("half_then_eoi", "middle_zeroed", "middle_random", "claims_9000")


def smooth_image(height: int, width: int, seed: int = 0) -> np.ndarray:
    """A photo-like RGB image (smooth gradients plus mild texture) that JPEG encodes faithfully,
    so decoder comparisons measure decoders rather than compression noise on white noise."""
    rng = np.random.default_rng(seed)
    y = np.linspace(0.0, 1.0, height)[:, None]
    x = np.linspace(0.0, 1.0, width)[None, :]
    channels = []
    for _ in range(3):
        a, b, c, d = rng.uniform(0.5, 4.0, size=4)
        phase = rng.uniform(0, 2 * np.pi)
        wave = 0.25 * np.sin(a * 3 * x + b * 2 * y + phase)
        channels.append(0.5 + wave + 0.2 * np.cos(c * x * d))
    img = np.stack(channels, axis=-1) * 255.0
    img += rng.normal(0.0, 4.0, size=img.shape)
    # A few hard edges, so orientation mistakes cannot hide in a symmetric picture.
    img[height // 5 : height // 3, width // 7 : width // 2] = (220, 40, 30)
    img[height // 2 :, width - width // 6 :] = (20, 60, 200)
    return np.clip(img, 0, 255).astype(np.uint8)


def jpeg_bytes(
    pixels: np.ndarray,
    *,
    quality: int = 92,
    subsampling: int = 2,
    progressive: bool = False,
    mode: str | None = None,
    exif: bytes | None = None,
) -> bytes:
    """JPEG bytes of `pixels` via PIL (subsampling 0 = 4:4:4, 1 = 4:2:2, 2 = 4:2:0)."""
    img = Image.fromarray(pixels)
    if mode is not None:
        img = img.convert(mode)
    kwargs: dict = {"quality": quality, "progressive": progressive}
    if img.mode != "L":
        kwargs["subsampling"] = subsampling
    if exif is not None:
        kwargs["exif"] = exif
    out = io.BytesIO()
    img.save(out, "JPEG", **kwargs)
    return out.getvalue()


def png_bytes(pixels: np.ndarray, mode: str | None = None) -> bytes:
    img = Image.fromarray(pixels)
    if mode is not None:
        img = img.convert(mode)
    out = io.BytesIO()
    img.save(out, "PNG")
    return out.getvalue()


def exif_orientation_block(orientation: int, big_endian: bool = False) -> bytes:
    """An APP1 payload ("Exif\\0\\0" + TIFF) holding just the Orientation tag, either byte order.

    Hand-built so both byte orders are covered (PIL only writes little-endian)."""
    e = ">" if big_endian else "<"
    head = b"MM\x00*" if big_endian else b"II*\x00"
    value = struct.pack(e + "H", orientation) + b"\x00\x00"
    ifd = struct.pack(e + "H", 1) + struct.pack(e + "HHI", 0x0112, 3, 1) + value
    tiff = head + struct.pack(e + "I", 8) + ifd + struct.pack(e + "I", 0)
    return b"Exif\x00\x00" + tiff


def exif_jpeg(pixels: np.ndarray, orientation: int, big_endian: bool = False) -> bytes:
    return jpeg_bytes(pixels, exif=exif_orientation_block(orientation, big_endian))


def huge_header_jpeg(pixels: np.ndarray, height: int = 60000, width: int = 60000) -> bytes:
    """A valid small JPEG whose SOF0 frame header is patched to claim height x width."""
    data = bytearray(jpeg_bytes(pixels))
    sof = data.find(b"\xff\xc0")
    if sof < 0:
        raise AssertionError("PIL wrote no baseline SOF0 marker")
    # FFC0, length (2), precision (1), then height and width (2 bytes each, big-endian).
    struct.pack_into(">HH", data, sof + 5, height, width)
    return bytes(data)


def scan_data_span(data: bytes) -> tuple[int, int]:
    """[start, end) of a baseline JPEG's entropy-coded data: after the SOS header, before EOI."""
    sos = data.find(b"\xff\xda")
    if sos < 0 or not data.endswith(b"\xff\xd9"):
        raise AssertionError("not a baseline JPEG ending in EOI")
    (length,) = struct.unpack_from(">H", data, sos + 2)
    return sos + 2 + length, len(data) - 2


def corrupt_jpeg(kind: str, data: bytes, seed: int = 0) -> bytes:
    """`data` (a baseline JPEG) damaged as CORRUPT_KINDS says, its EOI marker intact:
    - half_then_eoi: cut in half, FF D9 appended (libjpeg greys the missing half);
    - middle_zeroed / middle_random: the middle third of the entropy-coded data overwritten."""
    start, end = scan_data_span(data)
    a, b = start + (end - start) // 3, start + 2 * (end - start) // 3
    if kind == "half_then_eoi":
        return data[: len(data) // 2] + b"\xff\xd9"
    if kind == "middle_zeroed":
        return data[:a] + bytes(b - a) + data[b:]
    if kind == "middle_random":
        noise = np.random.default_rng(seed).integers(0, 256, b - a, dtype=np.uint8)
        return data[:a] + noise.tobytes() + data[b:]
    raise ValueError(f"unknown corruption {kind!r}")


def small_claiming_huge(height: int = 9000, width: int = 9000) -> bytes:
    """A ~2 kB JPEG whose frame header claims height x width (81 Mpx: under the pixel limit,
    so only the plausibility bound can refuse it before a 243 MB decode)."""
    data = huge_header_jpeg(smooth_image(64, 64, seed=5), height, width)
    assert 1000 < len(data) < 3000, len(data)
    return data


def odd_file_bytes(kind: str, height: int = 96, width: int = 128, seed: int = 0) -> bytes:
    """The bytes of one odd file (see GOOD_KINDS, BAD_KINDS and CORRUPT_KINDS)."""
    if kind in ("half_then_eoi", "middle_zeroed", "middle_random"):
        return corrupt_jpeg(kind, jpeg_bytes(smooth_image(height, width, seed)), seed)
    if kind == "claims_9000":
        return small_claiming_huge()
    pixels = smooth_image(height, width, seed)
    if kind == "rgb":
        return jpeg_bytes(pixels)
    if kind == "progressive":
        return jpeg_bytes(pixels, progressive=True)
    if kind == "grey":
        return jpeg_bytes(pixels, mode="L")
    if kind == "cmyk":
        return jpeg_bytes(pixels, mode="CMYK")
    if kind == "png_as_jpg":
        return png_bytes(pixels)
    if kind == "rgba_png":
        rgba = np.dstack([pixels, np.full(pixels.shape[:2], 128, np.uint8)])
        return png_bytes(rgba)
    if kind == "truncated":
        full = jpeg_bytes(pixels)
        return full[: len(full) * 2 // 3]
    if kind == "empty":
        return b""
    if kind == "text":
        return b"this is not an image, just text in a file named .jpg\n" * 4
    if kind == "huge_header":
        return huge_header_jpeg(pixels)
    if kind == "garbage_after_soi":
        return b"\xff\xd8" + bytes(np.random.default_rng(seed).integers(0, 256, 500, np.uint8))
    raise ValueError(f"unknown odd file kind {kind!r}")


def write_odd_files(folder: Path, kinds: tuple[str, ...], seed: int = 0) -> dict[str, Path]:
    """Write one file per kind as `<kind>.jpg` into `folder`; returns kind -> path."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for i, kind in enumerate(kinds):
        path = folder / f"{kind}.jpg"
        path.write_bytes(odd_file_bytes(kind, seed=seed + i))
        paths[kind] = path
    return paths


def write_image_folder(
    root: Path,
    *,
    classes: int = 3,
    good_per_class: int = 6,
    bad: dict[str, tuple[str, ...]] | None = None,
    seed: int = 0,
) -> Path:
    """An ImageFolder tree of small good JPEGs, with `bad` = {class name: bad kinds} mixed in.

    Good images vary in size and include odd-but-readable kinds, so a loader test covers them.
    """
    rng = np.random.default_rng(seed)
    for c in range(classes):
        folder = root / f"class{c}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(good_per_class):
            h, w = (int(v) for v in rng.integers(40, 120, size=2))
            kind = ("rgb", "progressive", "grey", "cmyk", "png_as_jpg")[(c + i) % 5]
            if kind == "rgb":
                data = jpeg_bytes(smooth_image(h, w, seed + 100 * c + i))
            else:
                data = odd_file_bytes(kind, height=h, width=w, seed=seed + 100 * c + i)
            (folder / f"good{i:02d}.jpg").write_bytes(data)
    for cls, kinds in (bad or {}).items():
        folder = root / cls
        folder.mkdir(parents=True, exist_ok=True)
        for kind in kinds:
            (folder / f"bad_{kind}.jpg").write_bytes(odd_file_bytes(kind, seed=seed))
    return root


def pil_jpeg(pixels: np.ndarray, **options) -> bytes:
    """JPEG bytes via PIL at quality 90 with any of PIL's save options (`subsampling`,
    `progressive`, `restart_marker_blocks`, `restart_marker_rows`, `exif`, ...) and `mode`
    (e.g. "L") to convert first."""
    img = Image.fromarray(pixels)
    mode = options.pop("mode", None)
    if mode:
        img = img.convert(mode)
    out = io.BytesIO()
    img.save(out, "JPEG", quality=90, **options)
    return out.getvalue()


def noise_image(height: int, width: int, seed: int) -> np.ndarray:
    """Uniform noise, HWC uint8 RGB: every block busy, so every restart interval has data."""
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def pil_restart_jpeg(pixels: np.ndarray, layout: str, quality: int = 80) -> bytes:
    """PIL's JPEG of ``pixels`` with a restart marker after every MCU; ``layout`` "grey" or a
    chroma subsampling "444", "422", "420"."""
    img = Image.fromarray(pixels)
    options: dict = {"quality": quality, "restart_marker_blocks": 1}
    if layout == "grey":
        img = img.convert("L")
    else:
        options["subsampling"] = {"444": 0, "422": 1, "420": 2}[layout]
    out = io.BytesIO()
    img.save(out, "JPEG", **options)
    return out.getvalue()
