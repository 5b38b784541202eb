"""The embedded default dataset: ten shape and texture classes, generated on first use.

The demo and the tests need real JPEGs that a small CNN can learn in a minute on a CPU, without a
download. Every image is a pure function of (seed, split, class, number): its own random
generator, its own size, colours, noise and JPEG settings. So generation is reproducible
(the same files byte for byte with the same libjpeg-turbo), order independent, and a change to
the generator bumps VERSION, which names the folder, so stale copies are never reused.

The JPEGs deliberately vary what a decoder must cope with: sizes 100 to 600 px (mostly small, so
decoding stays cheap), qualities 60 to 95, chroma subsampling 4:2:0 / 4:2:2 / 4:4:4, about one
in ten greyscale and one in five progressive.

Classes: centred objects (circle, square, triangle, cross, ring; 55-75 % of the shorter side)
and full-frame textures (horizontal, vertical and diagonal stripes, checkerboard, dots; 3 to 5
periods across). Both kinds survive a random-resized crop of a third of the area at 32 px.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import cv2
import numpy as np
from batchwire.pipeline import paths as _paths

VERSION = 2
CLASSES: tuple[str, ...] = (
    "checkerboard",
    "circle",
    "cross",
    "diagonal_stripes",
    "dots",
    "horizontal_stripes",
    "ring",
    "square",
    "triangle",
    "vertical_stripes",
)
_SHAPES = frozenset({"circle", "square", "triangle", "cross", "ring"})
_SPLITS = ("train", "val")
_MANIFEST = "manifest.json"


@dataclass(frozen=True)
class SyntheticSpec:
    """What to generate. The default is the embedded dataset; tests use smaller ones."""

    seed: int = 20260601
    train_per_class: int = 150
    val_per_class: int = 40
    min_side: int = 100
    max_side: int = 600

    def __post_init__(self) -> None:
        if self.train_per_class < 1 or self.val_per_class < 1:
            raise ValueError("train_per_class and val_per_class must be >= 1")
        if not (16 <= self.min_side <= self.max_side <= _NOISE_SIDE):
            raise ValueError(f"need 16 <= min_side <= max_side <= {_NOISE_SIDE}")

    def folder_name(self) -> str:
        name = f"synthetic-v{VERSION}"
        if self != SyntheticSpec():
            digest = hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()
            name += f"-{digest[:12]}"
        return name

    def count(self, split: str) -> int:
        return self.train_per_class if split == "train" else self.val_per_class


@dataclass(frozen=True)
class SyntheticDataset:
    """Roots of the generated ImageFolder trees (open them with `open_dataset`)."""

    train_root: Path
    val_root: Path
    classes: tuple[str, ...] = CLASSES

    @property
    def num_classes(self) -> int:
        return len(self.classes)


# ---------------------------------------------------------------------------------------------
# Drawing


def _rng(spec: SyntheticSpec, split: str, class_id: int, number: int) -> np.random.Generator:
    seq = np.random.SeedSequence([spec.seed, _SPLITS.index(split), class_id, number])
    return np.random.Generator(np.random.PCG64(seq))


def _luma(rgb: np.ndarray) -> float:
    return float(rgb @ np.array([0.299, 0.587, 0.114]))


def _colours(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A background and a foreground colour far enough apart in luminance to survive greyscale."""
    bg = rng.uniform(0, 255, 3)
    while True:
        fg = rng.uniform(0, 255, 3)
        if abs(_luma(fg) - _luma(bg)) >= 90:
            return bg, fg


def _size(spec: SyntheticSpec, rng: np.random.Generator) -> tuple[int, int]:
    # Mostly small images so decoding stays cheap; one in five larger, up to max_side, so DCT
    # scaling and big-image paths get exercised too.
    span = spec.max_side - spec.min_side
    if rng.uniform() < 0.8:
        short = spec.min_side + 0.16 * span * rng.uniform()
    else:
        short = spec.min_side + span * (0.16 + 0.84 * rng.uniform() ** 2)
    aspect = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
    long = min(short * max(aspect, 1 / aspect), spec.max_side)
    h, w = (short, long) if aspect < 1 else (long, short)
    return round(h), round(w)


def _grid(h: int, w: int) -> tuple[np.ndarray, np.ndarray]:
    """Pixel-centre coordinates as broadcastable float32 column / row vectors."""
    yy = np.arange(h, dtype=np.float32)[:, None]
    xx = np.arange(w, dtype=np.float32)[None, :]
    return yy, xx


_NOISE_SIDE = 640
_noise_banks: dict[int, np.ndarray] = {}


def _noise_bank(seed: int) -> np.ndarray:
    """A fixed field of standard normals (float32 [640, 640, 4]: luma + 3 chroma) per seed.

    Images take a random window of it: drawing fresh normals per pixel dominated generation.
    """
    bank = _noise_banks.get(seed)
    if bank is None:
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, 0x4E4F4953])))
        bank = rng.standard_normal((_NOISE_SIDE, _NOISE_SIDE, 4), dtype=np.float32)
        _noise_banks[seed] = bank
    return bank


def _soft(x: np.ndarray) -> np.ndarray:
    """Antialiased step: signed distance in pixels -> coverage in [0, 1]."""
    return np.clip(x + 0.5, 0.0, 1.0)


def _texture_mask(name: str, h: int, w: int, rng: np.random.Generator) -> np.ndarray:
    period = min(h, w) / rng.uniform(3.0, 5.0)
    yy, xx = _grid(h, w)
    if name in ("horizontal_stripes", "vertical_stripes", "diagonal_stripes"):
        if name == "horizontal_stripes":
            angle = math.radians(90 + rng.uniform(-6, 6))
        elif name == "vertical_stripes":
            angle = math.radians(rng.uniform(-6, 6))
        else:
            angle = math.radians(rng.choice([45.0, 135.0]) + rng.uniform(-8, 8))
        t = (xx * math.cos(angle) + yy * math.sin(angle)) / period + rng.uniform()
        # Distance to the nearest stripe edge, in pixels, signed: half the period is foreground.
        return _soft((0.25 - np.abs((t % 1.0) - 0.5)) * period)
    angle = math.radians(rng.uniform(-10, 10))
    u = (xx * math.cos(angle) + yy * math.sin(angle)) / period + rng.uniform()
    v = (-xx * math.sin(angle) + yy * math.cos(angle)) / period + rng.uniform()
    if name == "checkerboard":
        du = (0.25 - np.abs((u % 1.0) - 0.5)) * period
        dv = (0.25 - np.abs((v % 1.0) - 0.5)) * period
        # Inside when both or neither coordinate is in its "on" half: sign of the product.
        d = np.minimum(np.abs(du), np.abs(dv))
        return _soft(np.where((du > 0) == (dv > 0), d, -d))
    if name == "dots":
        radius = rng.uniform(0.22, 0.32) * period
        dist = np.hypot((u % 1.0) - 0.5, (v % 1.0) - 0.5) * period
        return _soft(radius - dist)
    raise ValueError(f"unknown texture {name!r}")


def _shape_mask(name: str, h: int, w: int, rng: np.random.Generator) -> np.ndarray:
    """Coverage in [0, 1] of one centred object, antialiased (cv2 LINE_AA at 1/8-px precision)."""
    mask = np.zeros((h, w), dtype=np.uint8)
    shift = 3
    one = 1 << shift
    aa = cv2.LINE_AA
    side = min(h, w)
    r = rng.uniform(0.27, 0.37) * side
    cy = h / 2 + rng.uniform(-0.08, 0.08) * h
    cx = w / 2 + rng.uniform(-0.08, 0.08) * w
    centre = (round(cx * one), round(cy * one))

    def fixed(points: np.ndarray, angle: float) -> np.ndarray:
        c, s = math.cos(angle), math.sin(angle)
        rotated = points @ np.array([[c, s], [-s, c]]) + np.array([cx, cy])
        return np.round(rotated * one).astype(np.int32)

    if name == "circle":
        cv2.circle(mask, centre, round(r * one), 255, -1, aa, shift)
    elif name == "ring":
        thickness = rng.uniform(0.25, 0.35) * r
        cv2.circle(mask, centre, round((r - thickness / 2) * one), 255, round(thickness), aa, shift)
    elif name == "square":
        half = r * 0.85
        pts = np.array([[-half, -half], [half, -half], [half, half], [-half, half]])
        cv2.fillPoly(mask, [fixed(pts, rng.uniform(-0.3, 0.3))], 255, aa, shift)
    elif name == "triangle":
        angles = np.array([0.0, 2 * math.pi / 3, 4 * math.pi / 3])
        pts = np.stack([np.cos(angles), np.sin(angles)], axis=1) * r * 1.25
        cv2.fillPoly(mask, [fixed(pts, rng.uniform(-math.pi, math.pi))], 255, aa, shift)
    elif name == "cross":
        arm = r * rng.uniform(0.28, 0.38)
        bars = [
            np.array([[-r, -arm], [r, -arm], [r, arm], [-r, arm]]),
            np.array([[-arm, -r], [arm, -r], [arm, r], [-arm, r]]),
        ]
        angle = rng.uniform(-0.25, 0.25)
        # One call per bar: fillPoly's even-odd rule would hollow out the overlap.
        for bar in bars:
            cv2.fillPoly(mask, [fixed(bar, angle)], 255, aa, shift)
    else:
        raise ValueError(f"unknown shape {name!r}")
    return mask.astype(np.float32) / np.float32(255.0)


def render_pixels(spec: SyntheticSpec, split: str, class_id: int, number: int) -> np.ndarray:
    """The RGB uint8 image for one sample (before JPEG encoding)."""
    rng = _rng(spec, split, class_id, number)
    name = CLASSES[class_id]
    h, w = _size(spec, rng)
    bg, fg = _colours(rng)
    # Background: a gentle gradient toward a shifted colour, so it is not a flat field.
    yy, xx = _grid(h, w)
    angle = rng.uniform(0, 2 * math.pi)
    ramp = ((xx * math.cos(angle) + yy * math.sin(angle)) / max(h, w))[..., None]
    bg2 = np.clip(bg + rng.uniform(-40, 40, 3), 0, 255)
    draw = _shape_mask if name in _SHAPES else _texture_mask
    mask = draw(name, h, w, rng).astype(np.float32)[..., None]
    background = bg.astype(np.float32) + (bg2 - bg).astype(np.float32) * ramp
    img = background + (fg.astype(np.float32) - background) * mask
    y0 = int(rng.integers(0, _NOISE_SIDE - h + 1))
    x0 = int(rng.integers(0, _NOISE_SIDE - w + 1))
    noise = _noise_bank(spec.seed)[y0 : y0 + h, x0 : x0 + w]
    luma_sigma = np.float32(rng.uniform(2.0, 6.0))
    img += noise[..., :1] * luma_sigma + noise[..., 1:] * np.float32(1.5)
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def _jpeg_settings(rng: np.random.Generator) -> tuple[int, str, bool]:
    quality = int(rng.integers(60, 96))
    grey = rng.uniform() < 0.1
    subsampling = "gray" if grey else str(rng.choice(["420", "422", "444"]))
    progressive = bool(rng.uniform() < 0.2)
    return quality, subsampling, progressive


def render_jpeg(spec: SyntheticSpec, split: str, class_id: int, number: int) -> bytes:
    """The JPEG file contents for one sample."""
    from turbojpeg import (
        TJFLAG_PROGRESSIVE,
        TJPF_GRAY,
        TJPF_RGB,
        TJSAMP_420,
        TJSAMP_422,
        TJSAMP_444,
        TJSAMP_GRAY,
    )

    pixels = render_pixels(spec, split, class_id, number)
    # A separate stream for the encoder settings, so changing them never changes the pixels.
    settings_rng = _rng(spec, split, class_id, number + (1 << 31))
    quality, subsampling, progressive = _jpeg_settings(settings_rng)
    flags = TJFLAG_PROGRESSIVE if progressive else 0
    encoder = _turbo()
    if subsampling == "gray":
        grey = cv2.cvtColor(pixels, cv2.COLOR_RGB2GRAY)[..., None]
        return encoder.encode(
            grey, quality=quality, pixel_format=TJPF_GRAY, jpeg_subsample=TJSAMP_GRAY, flags=flags
        )
    samp = {"420": TJSAMP_420, "422": TJSAMP_422, "444": TJSAMP_444}[subsampling]
    return encoder.encode(
        pixels, quality=quality, pixel_format=TJPF_RGB, jpeg_subsample=samp, flags=flags
    )


_TURBO = None


def _turbo():  # turbojpeg ships no type information
    global _TURBO
    if _TURBO is None:
        from turbojpeg import TurboJPEG

        _TURBO = TurboJPEG()
    return _TURBO


def library_versions() -> dict[str, str]:
    """The libraries the bytes depend on; recorded in the manifest, since an upgrade of any of
    them may change the exact files (not what they show) without a new VERSION."""
    import turbojpeg

    _turbo()
    libjpeg = "unknown"
    # The loaded libturbojpeg's real file name carries its version (Linux; else "unknown").
    with contextlib.suppress(OSError), open("/proc/self/maps") as maps:
        for line in maps:
            if "libturbojpeg" in line:
                libjpeg = os.path.basename(os.path.realpath(line.split()[-1]))
                break
    return {
        "numpy": np.__version__,
        "opencv": cv2.__version__,
        "pyturbojpeg": getattr(turbojpeg, "__version__", "unknown"),
        "libturbojpeg": libjpeg,
    }


def file_name(number: int) -> str:
    return f"{number:05d}.jpg"


def iter_samples(spec: SyntheticSpec) -> Iterator[tuple[str, int, int]]:
    """(split, class_id, number) for every image of the spec."""
    for split in _SPLITS:
        for class_id in range(len(CLASSES)):
            for number in range(spec.count(split)):
                yield split, class_id, number


# ---------------------------------------------------------------------------------------------
# Generation into the cache, once


def _generate_into(spec: SyntheticSpec, out: Path) -> None:
    for split in _SPLITS:
        for name in CLASSES:
            (out / split / name).mkdir(parents=True, exist_ok=True)
    total = 0
    for split, class_id, number in iter_samples(spec):
        data = render_jpeg(spec, split, class_id, number)
        (out / split / CLASSES[class_id] / file_name(number)).write_bytes(data)
        total += len(data)
    manifest = {
        "version": VERSION,
        "spec": asdict(spec),
        "classes": CLASSES,
        "bytes": total,
        "libraries": library_versions(),
    }
    (out / _MANIFEST).write_text(json.dumps(manifest, indent=1))


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def ensure_dataset(
    spec: SyntheticSpec | None = None, cache_dir: str | os.PathLike[str] | None = None
) -> SyntheticDataset:
    """Generate the dataset of `spec` into the cache unless it is already there.

    Concurrent callers (ranks, a server and a test runner starting together) serialise on a
    lock file, so the work is done once; the tree is built in a temporary folder and renamed
    into place, so a reader never sees a partial tree, even if a generator is killed midway.
    """
    spec = spec or SyntheticSpec()
    base = Path(cache_dir) if cache_dir is not None else _paths.cache_dir()
    base.mkdir(parents=True, exist_ok=True)
    final = base / spec.folder_name()
    result = SyntheticDataset(train_root=final / "train", val_root=final / "val")
    if (final / _MANIFEST).is_file():
        return result
    with _locked(base / f"{spec.folder_name()}.lock"):
        if (final / _MANIFEST).is_file():
            return result
        if final.exists():  # a tree without a manifest was not made by us: move it aside
            final.rename(base / f"{final.name}.broken-{os.getpid()}")
        tmp = Path(tempfile.mkdtemp(prefix=f"{final.name}.tmp-", dir=base))
        try:
            _generate_into(spec, tmp)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return result


def default_dataset(cache_dir: str | os.PathLike[str] | None = None) -> SyntheticDataset:
    """The embedded dataset's train and val roots, generated on first use (a few seconds)."""
    return ensure_dataset(SyntheticSpec(), cache_dir)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m batchwire.pipeline.synthetic",
        description="Print the embedded dataset's train and val roots, generating it if needed.",
    )
    parser.add_argument("--cache-dir", help="cache folder (default: batchwire's cache folder)")
    args = parser.parse_args(argv)
    ds = default_dataset(args.cache_dir)
    print(f"train: {ds.train_root}")
    print(f"val:   {ds.val_root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
