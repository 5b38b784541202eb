"""Region-of-interest JPEG decoding (native/csrc/jpeg_roi.cpp) and its use in `decode_for_crop`.

What must hold: the region's pixels are a full decode's pixels at the same DCT scale (libjpeg's
crop edge column may differ, and the resize never reads it); the augmented output equals the
whole-image path within one grey level on real photos and generated odd files (every EXIF
orientation, subsampling, greyscale, progressive, restart markers, odd sizes, boxes on every
border, 1-pixel boxes); bad bytes end in a clean error, never a crash.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from batchwire import native
from batchwire.native import build
from batchwire.pipeline import decode
from batchwire.pipeline.augment_plan import AugmentConfig, plan_sample
from batchwire.pipeline.dataset import open_dataset
from batchwire.pipeline.decode import (
    DecodeError,
    decode_for_crop,
    displayed_region,
    read_header,
    stored_region,
)
from batchwire.pipeline.decode.backends import turbo_decode as _turbo_decode
from batchwire.pipeline.decode.orientation import apply_orientation
from batchwire.pipeline.local import LocalLoader
from oddfiles import exif_orientation_block, odd_file_bytes, smooth_image
from oddfiles import pil_jpeg as encode

SAMPLE_DIR = Path(__file__).resolve().parents[3] / "shared" / "imagenet-sample"

if not native.jpeg_roi_available():
    pytest.skip(
        "the ROI JPEG decoder does not build here (libjpeg62-turbo-dev missing?); see the "
        "logged build error",
        allow_module_level=True,
    )


VARIANTS = {
    "420": {"subsampling": 2},
    "422": {"subsampling": 1},
    "444": {"subsampling": 0},
    "grey": {"mode": "L"},
    "progressive": {"subsampling": 2, "progressive": True},
    "restarts": {"subsampling": 2, "restart_marker_blocks": 3},
}
ODD_SIZES = [(97, 133), (203, 157), (17, 9), (64, 48)]


def boxes_for(h: int, w: int, rng: np.random.Generator, n: int) -> list[tuple[int, ...]]:
    """Random boxes plus ones on every border, the whole image and 1-pixel ones."""
    fixed = [
        (0, 0, h, w),
        (0, 0, 1, 1),
        (h - 1, w - 1, h, w),
        (0, w - 1, h, w),
        (h - 1, 0, h, 1),
        (h // 2, w // 2, h // 2 + 1, w // 2 + 1),
        (0, w // 3, 1, w),
    ]
    rand = []
    for _ in range(n):
        y0, x0 = int(rng.integers(0, h)), int(rng.integers(0, w))
        rand.append((y0, x0, int(rng.integers(y0 + 1, h + 1)), int(rng.integers(x0 + 1, w + 1))))
    return fixed + rand


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_region_equals_full_decode_at_each_scale(variant: str) -> None:
    """Rows are exact; columns too, except the outermost one at a crop edge inside the image
    (fancy chroma upsampling there lacks the neighbour outside the crop: seen here on 4:2:0 and
    4:2:2 files, never on 4:4:4 or greyscale; by up to ~60 grey levels at hard edges). The
    resize's margin keeps those columns out of its reach."""
    rng = np.random.default_rng(7)
    for h, w in ODD_SIZES:
        data = encode(smooth_image(h, w, seed=h), **VARIANTS[variant])
        for denom in (1, 2, 4, 8):
            full = _turbo_decode(data, (1, denom))
            fh, fw = full.shape[:2]
            for y0, x0, y1, x1 in boxes_for(fh, fw, rng, 12):
                pixels, (ry0, rx0, ry1, rx1), size = native.decode_jpeg_roi(
                    data, y0, x0, y1, x1, denom
                )
                assert size == (fh, fw)
                assert (ry0, ry1, rx1) == (y0, y1, x1) and 0 <= rx0 <= x0
                assert pixels.shape == (ry1 - ry0, rx1 - rx0, 3) and pixels.dtype == np.uint8
                diff = np.abs(pixels.astype(np.int16) - full[ry0:ry1, rx0:rx1]).max(axis=(0, 2))
                edges = {0} if rx0 > 0 else set()
                edges |= {rx1 - rx0 - 1} if rx1 < fw else set()
                # A crop one chroma sample wide (2 columns at h2 subsampling) is upsampled by
                # libjpeg's single-sample special case (the resize margin never makes one).
                edges |= {0} if rx1 - rx0 <= 2 else set()
                differing = set(np.nonzero(diff)[0].tolist())
                assert differing <= edges, (variant, h, w, denom, (y0, x0, y1, x1), differing)
                if variant in ("444", "grey"):
                    assert not differing


def test_region_is_clamped_and_empty_regions_fail() -> None:
    data = encode(smooth_image(40, 56))
    pixels, region, size = native.decode_jpeg_roi(data, -5, -9, 100, 100)
    assert region == (0, 0, 40, 56) and size == (40, 56) and pixels.shape == (40, 56, 3)
    np.testing.assert_array_equal(pixels, _turbo_decode(data, (1, 1)))
    with pytest.raises(native.JpegRoiError, match="empty"):
        native.decode_jpeg_roi(data, 10, 10, 10, 20)
    with pytest.raises(ValueError, match="scale_denom"):
        native.decode_jpeg_roi(data, 0, 0, 4, 4, 3)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_region_mapping_through_every_orientation(orientation: int) -> None:
    """A displayed region maps to the stored region whose oriented pixels are exactly it."""
    rng = np.random.default_rng(orientation)
    stored = rng.integers(0, 256, size=(13, 21, 3), dtype=np.uint8)
    shown = apply_orientation(stored, orientation)
    h, w = shown.shape[:2]
    for region in boxes_for(h, w, rng, 20):
        y0, x0, y1, x1 = region
        r0, c0, r1, c1 = stored_region(orientation, stored.shape[:2], region)
        got = apply_orientation(np.ascontiguousarray(stored[r0:r1, c0:c1]), orientation)
        np.testing.assert_array_equal(got, shown[y0:y1, x0:x1])
        assert displayed_region(orientation, stored.shape[:2], (r0, c0, r1, c1)) == region


def augment(decoded: decode.DecodedImage, flip: bool, out_hw: tuple[int, int]) -> torch.Tensor:
    out = torch.empty(1, 3, *out_hw, dtype=torch.uint8)
    native.augment_batch(
        [torch.from_numpy(decoded.pixels)],
        torch.tensor([decoded.box], dtype=torch.float32),
        torch.tensor([flip]),
        torch.tensor([[1.1, 0.9, 1.2, 0.0]]),
        torch.zeros(3),
        torch.ones(3),
        out,
    )
    return out


def assert_same_augmented(data: bytes, box, out_hw: tuple[int, int], flip: bool = False) -> None:
    header = read_header(data)
    whole = decode_for_crop(data, header, box, out_hw, roi=False)
    roi = decode_for_crop(data, header, box, out_hw)
    assert roi.pixels.size <= whole.pixels.size
    diff = (augment(whole, flip, out_hw).int() - augment(roi, flip, out_hw).int()).abs()
    assert diff.max().item() <= 1, (header, box, out_hw)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_augmented_crop_matches_whole_decode_in_every_orientation(orientation: int) -> None:
    rng = np.random.default_rng(100 + orientation)
    data = encode(smooth_image(203, 157, seed=5), exif=exif_orientation_block(orientation))
    header = read_header(data)
    assert header.orientation == orientation
    h, w = header.height, header.width
    boxes = [(float(a), float(b), float(c), float(d)) for a, b, c, d in boxes_for(h, w, rng, 8)]
    boxes.append((10.25, 3.5, 150.75, 101.125))  # fractional, as the crop planner draws them
    for k, box in enumerate(boxes):
        for out_hw in ((24, 24), (50, 37), (200, 200)):  # shrink (some at 1/2..1/8) and enlarge
            assert_same_augmented(data, box, out_hw, flip=bool(k % 2))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_augmented_crop_matches_whole_decode_per_variant(variant: str) -> None:
    rng = np.random.default_rng(3)
    for h, w in ODD_SIZES:
        data = encode(smooth_image(h, w, seed=w), **VARIANTS[variant])
        for box in boxes_for(h, w, rng, 4):
            assert_same_augmented(data, tuple(map(float, box)), (16, 16))


def sample_files(n: int) -> list[Path]:
    if not SAMPLE_DIR.is_dir():
        pytest.skip(f"real-photo sample {SAMPLE_DIR} not present on this machine")
    files = sorted(p for p in SAMPLE_DIR.iterdir() if p.suffix.lower() in (".jpeg", ".jpg"))
    return files[:n]


def test_imagenet_train_crops_match_whole_decode() -> None:
    config = AugmentConfig(image_size=224, train=True)
    rotated = SAMPLE_DIR / "n02951585_can_opener.JPEG"  # the sample's one EXIF-rotated photo
    files = sample_files(60)
    files += [rotated] if rotated.exists() else []
    for i, path in enumerate(files):
        data = path.read_bytes()
        header = read_header(data)
        plan = plan_sample(config, 0, 0, i, header.height, header.width)
        assert_same_augmented(data, plan.box, (224, 224), plan.flip)


def test_local_loader_batches_with_roi_match_whole_decode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loader end to end: ROI on (1 and 2 threads, bit-identical) against ROI off."""
    files = sample_files(48)
    listing = tmp_path / "list.txt"
    listing.write_text("".join(f"{f} {i}\n" for i, f in enumerate(files)))
    dataset = open_dataset(listing, allow_outside_root=True)

    def batches(threads: int) -> list[torch.Tensor]:
        with LocalLoader(
            dataset, batch_size=16, image_size=96, threads=threads, output_dtype="uint8"
        ) as loader:
            return [x.clone() for x, _ in loader]

    with_roi = batches(2)
    assert all(torch.equal(a, b) for a, b in zip(with_roi, batches(1), strict=True))
    monkeypatch.setenv("BATCHWIRE_JPEG_ROI", "0")
    whole = batches(2)
    assert len(whole) == len(with_roi) == 3
    for a, b in zip(whole, with_roi, strict=True):
        assert (a.int() - b.int()).abs().max().item() <= 1


BAD = {
    "truncated": odd_file_bytes("truncated", height=120, width=160),
    "empty": b"",
    "one_byte": b"\xff",
    "text": odd_file_bytes("text"),
    "garbage_after_soi": odd_file_bytes("garbage_after_soi"),
    "cmyk": odd_file_bytes("cmyk"),
}


@pytest.mark.parametrize("kind", list(BAD))
def test_bad_bytes_are_clean_errors(kind: str) -> None:
    with pytest.raises(native.JpegRoiError) as err:
        native.decode_jpeg_roi(BAD[kind], 0, 0, 8, 8)
    assert str(err.value)
    if kind == "cmyk":
        assert "CMYK" in str(err.value)


def test_truncated_file_fails_even_when_the_crop_is_above_the_cut() -> None:
    """Rows below the crop are never decoded; the missing EOI still gives the truncation away,
    and decode_for_crop ends in the same DecodeError as the whole-image path."""
    data = encode(smooth_image(240, 160, seed=2))
    cut = data[: len(data) * 3 // 4]
    for verify in (False, True):
        with pytest.raises(native.JpegRoiError, match="Premature end"):
            native.decode_jpeg_roi(cut, 0, 0, 16, 160, verify=verify)
    header = read_header(cut)
    box = (0.0, 0.0, 16.0, 160.0)
    with pytest.raises(DecodeError) as whole:
        decode_for_crop(cut, header, box, (16, 16), roi=False)
    with pytest.raises(DecodeError) as roi:
        decode_for_crop(cut, header, box, (16, 16))
    assert str(roi.value) == str(whole.value) and "truncated" in str(roi.value)


def corrupt_tail(data: bytes) -> bytes:
    """The file with the last fifth of its entropy-coded data cut out (EOI kept): libjpeg hits
    the marker mid-scan and warns "premature end of data segment"."""
    return data[: len(data) * 4 // 5] + b"\xff\xd9"


def test_corrupt_data_below_the_crop_fails_only_when_the_tail_is_verified() -> None:
    """The trade-off of `decode.ROI_VERIFY_TAIL`, pinned: a full decode rejects this file;
    the ROI decoder rejects it with verify, and without verify returns the crop's pixels,
    which are the intact file's (the corruption lies below them)."""
    data = encode(smooth_image(240, 160, seed=4), subsampling=2)
    bad = corrupt_tail(data)
    with pytest.raises(OSError):
        _turbo_decode(bad, (1, 1))
    with pytest.raises(native.JpegRoiError):
        native.decode_jpeg_roi(bad, 0, 0, 32, 160, verify=True)
    pixels, region, _ = native.decode_jpeg_roi(bad, 0, 0, 32, 160, verify=False)
    np.testing.assert_array_equal(pixels, _turbo_decode(data, (1, 1))[:32])
    assert region == (0, 0, 32, 160)


def mutations(data: bytes, rng: np.random.Generator, n: int):
    """Truncations, bit flips and overwritten runs of `data`."""
    for k in range(n):
        buf = bytearray(data)
        if k % 3 == 0:
            yield bytes(buf[: int(rng.integers(0, len(buf)))])
            continue
        if k % 3 == 1:
            for pos in rng.integers(0, len(buf), int(rng.integers(1, 8))):
                buf[pos] ^= 1 << int(rng.integers(0, 8))
        else:
            pos = int(rng.integers(0, len(buf) - 16))
            buf[pos : pos + 16] = rng.integers(0, 256, 16, dtype=np.uint8).tobytes()
        yield bytes(buf)


@pytest.mark.timeout(120)
def test_fuzzed_files_never_crash_the_decoder() -> None:
    """In-process on purpose: a crash here kills the test run, which is the failure to catch."""
    rng = np.random.default_rng(2024)
    bases = [
        encode(smooth_image(70, 90, seed=1), subsampling=2, restart_marker_blocks=2),
        encode(smooth_image(70, 90, seed=2), progressive=True),
        encode(smooth_image(70, 90, seed=3), mode="L"),
        encode(smooth_image(70, 90, seed=4), subsampling=1, exif=exif_orientation_block(6)),
    ]
    outcomes = {"ok": 0, "error": 0}
    for base in bases:
        for data in mutations(base, rng, 150):
            y0, x0 = int(rng.integers(0, 70)), int(rng.integers(0, 90))
            y1, x1 = y0 + int(rng.integers(1, 40)), x0 + int(rng.integers(1, 50))
            denom = int(rng.choice([1, 2, 4, 8]))
            try:
                pixels, (ry0, rx0, ry1, rx1), (h, w) = native.decode_jpeg_roi(
                    data, y0, x0, y1, x1, denom, verify=bool(rng.integers(0, 2))
                )
            except native.JpegRoiError:
                outcomes["error"] += 1
                continue
            outcomes["ok"] += 1
            assert 0 <= ry0 < ry1 <= h and 0 <= rx0 < rx1 <= w
            assert pixels.shape == (ry1 - ry0, rx1 - rx0, 3)
    assert outcomes["error"] > 100 and outcomes["ok"] > 10, outcomes


def test_decodes_from_memoryview_and_other_threads_agree() -> None:
    from concurrent.futures import ThreadPoolExecutor

    data = encode(smooth_image(120, 150, seed=9))
    want = native.decode_jpeg_roi(data, 10, 20, 90, 130, 2)[0]
    view = memoryview(bytearray(data))
    np.testing.assert_array_equal(native.decode_jpeg_roi(view, 10, 20, 90, 130, 2)[0], want)
    with ThreadPoolExecutor(4) as pool:
        results = list(
            pool.map(lambda _: native.decode_jpeg_roi(data, 10, 20, 90, 130, 2), range(16))
        )
    assert all(np.array_equal(r[0], want) for r in results)


def test_the_gil_is_released_while_decoding() -> None:
    """Another Python thread keeps running during a long decode: the longest pause it sees is
    far below one decode's duration (it would be the whole decode if the GIL were held). GIL
    hand-overs alone cost a few switch intervals, and on a loaded machine the OS may pause any
    thread, so the best of three trials is judged. (Checked against a call that keeps the GIL,
    ctypes.PyDLL's usleep: its pause here is the whole call.)"""
    import threading
    import time

    data = encode(np.tile(smooth_image(500, 375, seed=8), (8, 8, 1)))  # 4000 x 3000
    whole = (0, 0, 4000, 3000)
    durations, pauses = [], []
    for _ in range(3):
        start = time.perf_counter()
        native.decode_jpeg_roi(data, *whole)
        durations.append(time.perf_counter() - start)
        worker = threading.Thread(target=native.decode_jpeg_roi, args=(data, *whole))
        longest, last = 0.0, time.perf_counter()  # before start(): a held GIL stalls start()
        worker.start()
        while worker.is_alive():
            now = time.perf_counter()
            longest, last = max(longest, now - last), now
        worker.join()
        pauses.append(longest)
    assert min(pauses) < min(durations) / 2, (pauses, durations)


def test_roi_extension_is_separate_from_the_augment_op(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("BATCHWIRE_NATIVE_CACHE", str(tmp_path))
    monkeypatch.setenv("BATCHWIRE_CUDA", "0")
    roi, op = build.make_plan(build.jpeg_roi_spec()), build.make_plan()
    assert roi.build_dir != op.build_dir and not roi.with_cuda
    assert [s.name for s in roi.sources] == [
        "jpeg_roi.cpp",
        "jpeg_restart.cpp",
        "jpeg_transcode.cpp",
    ]
    assert roi.library.name == "batchwire_jpeg_roi.so" and op.library.name == "batchwire_native.so"
    assert op.spec.system_header is None  # the augment op never needs libjpeg
    assert build.missing_system_header(roi) is None  # this machine has jpeglib.h
    missing = build.ExtensionSpec(**{**roi.spec.__dict__, "system_header": "bw_no_such_jpeglib.h"})
    problem = build.missing_system_header(build.make_plan(missing))
    assert problem and "bw_no_such_jpeglib.h" in problem and "apt-get install libjpeg62" in problem


UNAVAILABLE_SCRIPT = """
from batchwire import native
from batchwire.pipeline.decode import decode_for_crop, read_header
data = open(__import__("sys").argv[1], "rb").read()
header = read_header(data)
for _ in range(3):
    got = decode_for_crop(data, header, (10.0, 10.0, 50.0, 60.0), (40, 50))
assert got.pixels.shape[:2] == (header.height, header.width), got.pixels.shape
assert not native.jpeg_roi_available()
print("whole-image fallback ok")
"""


@pytest.mark.timeout(120)
def test_unbuildable_roi_decoder_falls_back_to_whole_image_decoding(tmp_path: Path) -> None:
    image = tmp_path / "a.jpg"
    image.write_bytes(encode(smooth_image(64, 80)))
    env = {**os.environ, "CXX": "/nonexistent/c++", "BATCHWIRE_NATIVE_CACHE": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, "-c", UNAVAILABLE_SCRIPT, str(image)],
        capture_output=True,
        text=True,
        env=env,
        timeout=100,
    )
    assert run.returncode == 0, run.stderr
    assert "whole-image fallback ok" in run.stdout
    assert run.stderr.count("ROI JPEG decoding unavailable") == 1, run.stderr
    assert "no C++ compiler" in run.stderr
