"""The compiled augment op against the pure torch reference (the oracle), on random parameters:
every output dtype and layout, flips, greyscale, 1x1 and thin images, boxes on the borders,
shrink factors 1 to 16 and enlargement; plus exact properties and bad input.

The oracle tests take a `device` parameter: they run on the CPU always and on the GPU where
CUDA is present (the extension must then have been built with CUDA). Where no GPU is, the CUDA
kernel's per-pixel arithmetic still runs on the host (last test).
"""

from __future__ import annotations

import ctypes
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from batchwire import native
from batchwire.native.reference import augment_batch_reference, rotate_hue

DTYPES = (torch.uint8, torch.float16, torch.bfloat16, torch.float32)
# (atol, rtol) in output units; uint8 is checked separately (max abs error 1).
FLOAT_TOL = {
    torch.float32: (1e-4, 1e-5),
    torch.float16: (4e-3, 1e-3),
    torch.bfloat16: (3.2e-2, 8e-3),
}
MEAN = torch.tensor([0.485, 0.456, 0.406])
STD = torch.tensor([0.229, 0.224, 0.225])


@pytest.fixture(scope="module")
def ops() -> native.NativeOps:
    return native.load()


def _devices() -> list:
    cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
    return ["cpu", pytest.param("cuda", marks=[cuda, pytest.mark.cuda])]


def _require_cuda_build(ops: native.NativeOps, device: str) -> None:
    if device == "cuda" and not ops.with_cuda:
        pytest.fail(
            f"CUDA device present but the extension has no CUDA: {ops.build.plan.cuda_reason}"
        )


def _random_box(gen: torch.Generator, h: int, w: int, out_h: int, out_w: int) -> list[float]:
    """A box whose scale is 1/4 to 16 source pixels per output pixel, clipped to the image,
    touching a border a third of the time."""

    def axis(size: int, out: int) -> tuple[float, float]:
        factor = math.exp(
            float(torch.empty(1).uniform_(math.log(0.25), math.log(16), generator=gen))
        )
        length = min(size, max(0.3, out * factor))
        start = float(torch.rand(1, generator=gen)) * (size - length)
        edge = int(torch.randint(0, 3, (1,), generator=gen))
        if edge == 1:
            start = 0.0
        elif edge == 2:
            start = size - length
        return start, start + length

    y0, y1 = axis(h, out_h)
    x0, x1 = axis(w, out_w)
    return [y0, x0, y1, x1]


def _random_batch(seed: int, n: int, out_h: int, out_w: int, device: str) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    images, boxes = [], []
    for i in range(n):
        kind = i % 6
        h, w = (int(v) for v in torch.randint(1, 200, (2,), generator=gen))
        if kind == 3:
            h = 1  # 1 x W
        elif kind == 4:
            w = 1  # H x 1
        channels = 1 if kind in (1, 4) else 3
        images.append(torch.randint(0, 256, (h, w, channels), dtype=torch.uint8, generator=gen))
        boxes.append(_random_box(gen, h, w, out_h, out_w))
    jitter = torch.ones(n, 4)
    jitter[:, 3] = 0
    jittered = torch.rand(n, generator=gen) < 0.5
    jitter[jittered, :3] = torch.empty(int(jittered.sum()), 3).uniform_(0.5, 1.6, generator=gen)
    jitter[jittered, 3] = torch.empty(int(jittered.sum())).uniform_(-0.5, 0.5, generator=gen)
    flips = torch.rand(n, generator=gen) < 0.5
    images = [im.to(device) for im in images]
    return images, torch.tensor(boxes, dtype=torch.float32), flips, jitter


def _outputs(n: int, h: int, w: int, dtype: torch.dtype, channels_last: bool, device: str):
    out = torch.full((n, 3, h, w), 7, dtype=dtype, device=device)
    if channels_last:
        out = out.contiguous(memory_format=torch.channels_last)
    return out, torch.zeros_like(out)


def _assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    if got.dtype == torch.uint8:
        err = (got.int() - want.int()).abs().max().item()
        assert err <= 1, f"max abs error {err} > 1 uint8 level"
    else:
        atol, rtol = FLOAT_TOL[got.dtype]
        torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


def _check_against_reference(ops, device: str, dtype: torch.dtype, channels_last: bool, seed: int):
    images, boxes, flips, jitter = _random_batch(seed, 18, 13, 11, device)
    got, want = _outputs(18, 13, 11, dtype, channels_last, device)
    ops.augment_batch(images, boxes, flips, jitter, MEAN, STD, got)
    augment_batch_reference(images, boxes, flips, jitter, MEAN, STD, want)
    assert got.is_contiguous(
        memory_format=torch.channels_last if channels_last else torch.contiguous_format
    )
    _assert_matches(got, want)


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference_on_random_batches(ops, device, dtype, channels_last):
    _require_cuda_build(ops, device)
    for seed in range(3):
        _check_against_reference(ops, device, dtype, channels_last, seed)


def _check_split_over_threads(ops) -> None:
    """Enough work for the CPU kernel to use two threads, and too few images for one each, so
    it splits images into row blocks (a contrast image stays whole, a grey one has its own
    horizontal pass)."""
    gen = torch.Generator().manual_seed(5)
    images = [
        torch.randint(0, 256, (300, 400, 3), dtype=torch.uint8, generator=gen),
        torch.randint(0, 256, (310, 390, 1), dtype=torch.uint8, generator=gen),
        torch.randint(0, 256, (280, 420, 3), dtype=torch.uint8, generator=gen),
    ]
    boxes = torch.tensor([[0, 0, 300, 400], [5.5, 3.25, 300, 390], [10, 20, 270, 410]])
    flips = torch.tensor([False, True, True])
    jitter = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.2, 1.0, 0.7, 0.0], [0.9, 1.3, 1.1, 0.0]])
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for dtype, channels_last in ((torch.uint8, False), (torch.float32, True)):
            got, want = _outputs(3, 224, 200, dtype, channels_last, "cpu")
            ops.augment_batch(images, boxes, flips, jitter, MEAN, STD, got)
            augment_batch_reference(images, boxes, flips, jitter, MEAN, STD, want)
            _assert_matches(got, want)
    finally:
        torch.set_num_threads(before)


def test_work_split_over_threads_matches_reference(ops):
    _check_split_over_threads(ops)


@pytest.mark.timeout(120)
def test_portable_cpu_path_matches_reference():
    """The CPU kernel picks hand-written AVX2 / F16C loops at run time where the CPU has them;
    BATCHWIRE_NATIVE_SIMD=baseline turns them off, so the portable loops that other machines
    run are checked here too, in a fresh process (the choice is made once per process)."""
    script = (
        "import importlib.util, sys, torch\n"
        "from batchwire import native\n"
        f"spec = importlib.util.spec_from_file_location('oracle_tests', {str(__file__)!r})\n"
        "t = importlib.util.module_from_spec(spec); spec.loader.exec_module(t)\n"
        "ops = native.load()\n"
        "for dtype in t.DTYPES:\n"
        "    for channels_last in (False, True):\n"
        "        t._check_against_reference(ops, 'cpu', dtype, channels_last, 0)\n"
        "t._check_split_over_threads(ops)\n"
        "print('portable path ok')\n"
    )
    env = {**os.environ, "BATCHWIRE_NATIVE_SIMD": "baseline"}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=110
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "portable path ok" in result.stdout


@pytest.mark.parametrize("device", _devices())
def test_tiny_and_thin_images_enlarged_and_shrunk(ops, device):
    _require_cuda_build(ops, device)
    shapes = [(1, 1, 3), (1, 1, 1), (1, 37, 3), (29, 1, 3), (2, 2, 1), (1, 300, 3), (300, 1, 1)]
    images = [torch.randint(0, 256, s, dtype=torch.uint8).to(device) for s in shapes]
    boxes = torch.tensor([[0, 0, h, w] for h, w, _ in shapes], dtype=torch.float32)
    n = len(shapes)
    flips = torch.arange(n) % 2 == 0
    jitter = torch.tensor([[1.2, 0.8, 1.3, 0.0]]).repeat(n, 1)
    for dtype in (torch.uint8, torch.float32):
        got, want = _outputs(n, 9, 17, dtype, False, device)
        ops.augment_batch(images, boxes, flips, jitter, MEAN, STD, got)
        augment_batch_reference(images, boxes, flips, jitter, MEAN, STD, want)
        _assert_matches(got, want)


@pytest.mark.parametrize("device", _devices())
def test_every_shrink_factor_from_1_to_16_and_enlargement(ops, device):
    _require_cuda_build(ops, device)
    factors = [*range(1, 17), 0.5, 0.27]
    gen = torch.Generator().manual_seed(5)
    images = [torch.randint(0, 256, (140, 150, 3), dtype=torch.uint8, generator=gen).to(device)]
    images = images * len(factors)
    boxes = torch.tensor([[1.5, 0.25, 1.5 + 8 * f, 0.25 + 9 * f] for f in factors])
    n = len(factors)
    flips, jitter = torch.zeros(n, dtype=torch.bool), torch.tensor([[1.0, 1.0, 1.0, 0.0]] * n)
    got, want = _outputs(n, 8, 9, torch.uint8, False, device)
    ops.augment_batch(images, boxes, flips, jitter, MEAN, STD, got)
    augment_batch_reference(images, boxes, flips, jitter, MEAN, STD, want)
    _assert_matches(got, want)


def test_public_entry_point_runs_the_compiled_op(ops):
    images, boxes, flips, jitter = _random_batch(9, 5, 10, 12, "cpu")
    via_api, via_ops = _outputs(5, 10, 12, torch.float32, True, "cpu")
    assert native.augment_batch(images, boxes, flips, jitter, MEAN, STD, via_api) is via_api
    ops.augment_batch(images, boxes, flips, jitter, MEAN, STD, via_ops)
    assert torch.equal(via_api, via_ops)
    assert native.is_available()


@pytest.mark.parametrize("device", _devices())
def test_unit_scale_copies_pixels_and_flip_mirrors(ops, device):
    _require_cuda_build(ops, device)
    image = torch.randint(0, 256, (12, 17, 3), dtype=torch.uint8).to(device)
    grey = torch.randint(0, 256, (12, 17, 1), dtype=torch.uint8).to(device)
    boxes = torch.tensor([[0, 0, 12, 17]] * 2, dtype=torch.float32)
    jitter = torch.tensor([[1.0, 1.0, 1.0, 0.0]] * 2)
    plain = torch.empty(2, 3, 12, 17, dtype=torch.uint8, device=device)
    flipped = torch.empty_like(plain, memory_format=torch.channels_last)  # no copy of unset bytes
    ops.augment_batch([image, grey], boxes, torch.tensor([False, False]), jitter, MEAN, STD, plain)
    ops.augment_batch([image, grey], boxes, torch.tensor([True, True]), jitter, MEAN, STD, flipped)
    assert torch.equal(plain[0], image.permute(2, 0, 1))
    assert torch.equal(plain[1], grey.permute(2, 0, 1).expand(3, -1, -1))
    assert torch.equal(flipped, plain.flip(3))


@pytest.mark.parametrize("device", _devices())
def test_float_output_is_normalised_uint8_output(ops, device):
    _require_cuda_build(ops, device)
    images, boxes, flips, jitter = _random_batch(7, 6, 20, 20, device)
    as_uint8 = torch.empty(6, 3, 20, 20, dtype=torch.uint8, device=device)
    as_float = torch.empty(6, 3, 20, 20, dtype=torch.float32, device=device)
    ops.augment_batch(images, boxes, flips, jitter, MEAN, STD, as_uint8)
    ops.augment_batch(images, boxes, flips, jitter, MEAN, STD, as_float)
    pixels = (as_float.cpu() * STD.view(3, 1, 1) + MEAN.view(3, 1, 1)) * 255
    assert (pixels - as_uint8.cpu().float()).abs().max() <= 0.5 + 1e-3


@pytest.mark.parametrize("device", _devices())
def test_contrast_output_is_bit_identical_between_runs(ops, device):
    """The per-image grey means that contrast needs are summed in a fixed order (on the GPU: no
    float atomics), so repeated runs give the same bits, uint8 and float alike. Large outputs:
    many thread blocks per image on the GPU, several threads on the CPU."""
    _require_cuda_build(ops, device)
    gen = torch.Generator().manual_seed(12)
    n = 6
    images = [
        torch.randint(0, 256, (300, 280, 3), dtype=torch.uint8, generator=gen).to(device)
        for _ in range(n)
    ]
    boxes = torch.tensor([[0.0, 0.0, 300.0, 280.0]] * n)
    flips = torch.arange(n) % 2 == 0
    jitter = torch.tensor([[1.1, 1.4, 0.9, 0.1], [0.8, 0.6, 1.0, 0.0]] * (n // 2))
    for dtype in (torch.uint8, torch.float32):
        first = torch.empty(n, 3, 224, 224, dtype=dtype, device=device)
        ops.augment_batch(images, boxes, flips, jitter, MEAN, STD, first)
        for _ in range(5):
            again = torch.full_like(first, 7)
            ops.augment_batch(images, boxes, flips, jitter, MEAN, STD, again)
            assert torch.equal(again, first)
        if dtype == torch.uint8:  # and still the reference's result, to one level
            want = torch.empty_like(first)
            augment_batch_reference(images, boxes, flips, jitter, MEAN, STD, want)
            _assert_matches(first, want)


@pytest.mark.skipif(
    not hasattr(torch.Tag, "cudagraph_unsafe"), reason="this torch has no cudagraph_unsafe tag"
)
def test_op_is_tagged_cudagraph_unsafe(ops):
    """Each call copies a fresh host table of boxes and jitter to the device: a CUDA graph replay
    would reuse the captured one, so torch.compile must keep the op out of CUDA graphs."""
    assert torch.Tag.cudagraph_unsafe in torch.ops.batchwire.augment_batch.default.tags


def test_empty_batch_is_a_no_op(ops):
    out = torch.empty(0, 3, 8, 8)
    ops.augment_batch(
        [], torch.empty(0, 4), torch.empty(0, dtype=torch.bool), torch.empty(0, 4), MEAN, STD, out
    )


def _bad_cases():
    img = torch.zeros(10, 10, 3, dtype=torch.uint8)
    ok = dict(
        images=[img],
        boxes=torch.tensor([[0.0, 0.0, 10.0, 10.0]]),
        flips=torch.tensor([False]),
        jitter=torch.tensor([[1.0, 1.0, 1.0, 0.0]]),
        mean=MEAN,
        std=STD,
        out=torch.empty(1, 3, 4, 4),
    )
    cases = {
        "float image": ({"images": [img.float()]}, TypeError, "uint8"),
        "chw image": (
            {"images": [torch.zeros(3, 10, 10, dtype=torch.uint8)]},
            ValueError,
            "1 or 3",
        ),
        "2-channel": ({"images": [torch.zeros(5, 5, 2, dtype=torch.uint8)]}, ValueError, "1 or 3"),
        "empty image": ({"images": [torch.zeros(0, 5, 3, dtype=torch.uint8)]}, ValueError, "empty"),
        "2 images": ({"images": [img, img]}, ValueError, "2 images"),
        "box outside": ({"boxes": torch.tensor([[0.0, 0.0, 10.5, 10.0]])}, ValueError, "inside"),
        "negative box": ({"boxes": torch.tensor([[-1.0, 0.0, 5.0, 5.0]])}, ValueError, "inside"),
        "empty box": ({"boxes": torch.tensor([[3.0, 3.0, 3.0, 8.0]])}, ValueError, "positive size"),
        "nan box": ({"boxes": torch.tensor([[0.0, 0.0, float("nan"), 5.0]])}, ValueError, "inside"),
        "box dtype": (
            {"boxes": torch.tensor([[0.0, 0.0, 10.0, 10.0]], dtype=torch.float64)},
            TypeError,
            "boxes",
        ),
        "box shape": ({"boxes": torch.zeros(1, 3)}, ValueError, "boxes"),
        "flip dtype": ({"flips": torch.tensor([0])}, TypeError, "flips"),
        "hue": ({"jitter": torch.tensor([[1.0, 1.0, 1.0, 0.6]])}, ValueError, "hue"),
        "negative factor": (
            {"jitter": torch.tensor([[-1.0, 1.0, 1.0, 0.0]])},
            ValueError,
            "non-negative",
        ),
        "zero std": ({"std": torch.tensor([0.2, 0.0, 0.2])}, ValueError, "std"),
        "out int32": (
            {"out": torch.empty(1, 3, 4, 4, dtype=torch.int32)},
            TypeError,
            "out must be",
        ),
        "out 4 channels": ({"out": torch.empty(1, 4, 4, 4)}, ValueError, r"\[N, 3, H, W\]"),
        "out 3d": ({"out": torch.empty(3, 4, 4)}, ValueError, r"\[N, 3, H, W\]"),
        "out overlapping": (
            {"out": torch.empty(1, 1, 4, 4).expand(1, 3, 4, 4)},
            ValueError,
            "dense",
        ),
    }
    return ok, cases


@pytest.mark.parametrize("case", list(_bad_cases()[1]))
def test_bad_input_raises_a_clear_error(ops, case):
    ok, cases = _bad_cases()
    change, exc, match = cases[case]
    args = {**ok, **change}
    for fn in (ops.augment_batch, augment_batch_reference):
        with pytest.raises(exc, match=match):
            fn(**args)


def _augment_call_taking(ops, seconds: float) -> tuple[Callable[[], None], float]:
    """A single-threaded op call that takes at least ``seconds`` on this machine, and its time.

    The batch doubles until one call is slow enough to tell "GIL held" from "GIL released" on
    any machine, fast CI runners included.
    """
    gen = torch.Generator().manual_seed(1)
    image = torch.randint(0, 256, (600, 600, 3), dtype=torch.uint8, generator=gen)
    n = 32
    while True:
        images = [image] * n
        boxes = torch.tensor([[0.0, 0.0, 600.0, 600.0]] * n)
        flips = torch.zeros(n, dtype=torch.bool)
        jitter = torch.tensor([[1.0, 1.0, 1.0, 0.0]] * n)
        out = torch.empty(n, 3, 224, 224)

        def call(images=images, boxes=boxes, flips=flips, jitter=jitter, out=out) -> None:
            ops.augment_batch(images, boxes, flips, jitter, MEAN, STD, out)

        t0 = time.perf_counter()
        call()
        took = time.perf_counter() - t0
        if took >= seconds or n >= 4096:
            return call, took
        n *= 2


def test_gil_is_released_while_the_op_runs(ops):
    """A Python thread keeps running while another thread is inside the op."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        call, single = _augment_call_taking(ops, seconds=0.15)
        started, ticks = threading.Event(), []

        def work() -> None:
            started.set()
            call()

        worker = threading.Thread(target=work)
        t0 = time.perf_counter()
        worker.start()
        started.wait()
        while worker.is_alive():
            ticks.append(time.perf_counter())
            time.sleep(0.001)
        duration = time.perf_counter() - t0
    finally:
        torch.set_num_threads(threads)
    gaps = [b - a for a, b in zip([t0, *ticks], ticks, strict=False)]
    assert single >= 0.15, f"op too fast to judge even at the largest batch ({single:.3f} s)"
    # Holding the GIL would stall this loop for the whole call (one gap ~ duration).
    assert len(ticks) >= 10 and max(gaps) < 0.5 * duration, (len(ticks), max(gaps), duration)


def test_reference_hue_is_the_hsv_hue_shift():
    """The oracle's hue rotation against Python's colorsys (HSV there, hue moved, back), on
    random colours and on the edge cases: greys, primaries, ties between channels, full turns."""
    import colorsys

    gen = torch.Generator().manual_seed(4)
    special = [
        (0, 0, 0),
        (255, 255, 255),
        (90, 90, 90),
        (255, 0, 0),
        (0, 255, 0),
        (0, 0, 255),
        (255, 255, 0),
        (0, 255, 255),
        (255, 0, 255),
        (200, 200, 10),
        (10, 200, 200),
        (200, 10, 200),
        (12.5, 3.25, 250.0),
    ]
    colours = torch.cat(
        [torch.tensor(special, dtype=torch.float64), torch.rand(500, 3, generator=gen) * 255]
    ).to(torch.float64)
    for turns in (-0.5, -0.31, -0.01, 0.0, 0.17, 0.5):
        got = rotate_hue(colours, turns)
        for rgb, out in zip(colours.tolist(), got.tolist(), strict=True):
            h, s, v = colorsys.rgb_to_hsv(*(c / 255 for c in rgb))
            want = [c * 255 for c in colorsys.hsv_to_rgb((h + turns) % 1.0, s, v)]
            assert max(abs(a - b) for a, b in zip(out, want, strict=True)) < 1e-9, (rgb, turns)


def test_hue_keeps_greys_and_a_half_turn_twice_is_the_identity(ops):
    gen = torch.Generator().manual_seed(6)
    image = torch.randint(0, 256, (40, 30, 3), dtype=torch.uint8, generator=gen)
    image[:10] = image[:10, :, :1]  # grey rows
    box = torch.tensor([[0.0, 0.0, 40.0, 30.0]])
    flips = torch.zeros(1, dtype=torch.bool)

    def hue(turns: float, source: torch.Tensor) -> torch.Tensor:
        out = torch.empty(1, 3, 40, 30, dtype=torch.uint8)
        jitter = torch.tensor([[1.0, 1.0, 1.0, turns]])
        ops.augment_batch([source], box, flips, jitter, MEAN, STD, out)
        return out[0].permute(1, 2, 0).contiguous()

    once = hue(0.5, image)
    assert torch.equal(once[:10], image[:10]), "a grey pixel has no hue to move"
    assert (once[10:].int() - image[10:].int()).abs().max() > 50, "the colours did move"
    assert (hue(0.5, once).int() - image.int()).abs().max() <= 1


def test_opcheck(ops):
    images, boxes, flips, jitter = _random_batch(3, 4, 6, 5, "cpu")
    out = torch.empty(4, 3, 6, 5)
    # The schema (mutation of `out`), autograd registration and the Meta kernel; the AOT
    # dispatch check is left out for time (it compiles the op through functorch).
    torch.library.opcheck(
        torch.ops.batchwire.augment_batch.default,
        (images, boxes, flips, jitter, MEAN, STD, out),
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )


class _ImageDesc(ctypes.Structure):
    """Mirror of batchwire::cuda::ImageDesc (native/csrc/augment_desc.h)."""

    _fields_ = [
        ("pixels", ctypes.c_void_p),
        ("height", ctypes.c_int),
        ("width", ctypes.c_int),
        ("channels", ctypes.c_int),
        *((name, ctypes.c_float) for name in ("y0", "x0", "y1", "x1")),
        *((name, ctypes.c_float) for name in ("brightness", "contrast", "saturation", "hue")),
        ("flip", ctypes.c_int),
    ]


@pytest.mark.timeout(120)
def test_cuda_pixel_math_emulated_on_the_host(tmp_path):
    """The CUDA kernel's per-pixel code (augment_pixel.h), compiled for the host, against the
    reference: the kernel's arithmetic is checked even where no GPU is."""
    csrc = Path(native.__file__).parent / "csrc"
    lib_path = tmp_path / "emulation.so"
    cxx = os.environ.get("CXX", "c++")
    subprocess.run(
        [cxx, "-O2", "-std=c++17", "-shared", "-fPIC", f"-I{csrc}",
         str(csrc / "cuda_emulation.cpp"), "-o", str(lib_path)],
        check=True, timeout=100,
    )  # fmt: skip
    lib = ctypes.CDLL(str(lib_path))
    images, boxes, flips, jitter = _random_batch(11, 18, 13, 11, "cpu")
    table = (_ImageDesc * len(images))()
    for d, img, box, flip, jit in zip(table, images, boxes.tolist(), flips, jitter, strict=True):
        d.pixels, (d.height, d.width, d.channels) = img.data_ptr(), img.shape
        d.y0, d.x0, d.y1, d.x1 = box
        d.brightness, d.contrast, d.saturation, d.hue = jit.tolist()
        d.flip = int(flip)
    emulated = torch.empty(len(images), 13, 11, 3)
    lib.batchwire_emulate_cuda(table, len(images), 13, 11, ctypes.c_void_p(emulated.data_ptr()))
    want = torch.empty(len(images), 3, 13, 11, dtype=torch.uint8)
    augment_batch_reference(images, boxes, flips, jitter, MEAN, STD, want)
    got = torch.round(emulated).permute(0, 3, 1, 2)
    assert (got - want.float()).abs().max() <= 1
