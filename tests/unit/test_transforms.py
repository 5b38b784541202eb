"""User transforms in-process: seeds, determinism, errors replaced, shape checks, the v2 adapter."""

from __future__ import annotations

import importlib.util
import logging
import random
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch
from batchwire.pipeline.augment_plan import AugmentConfig, draw_uniforms
from batchwire.pipeline.dataset import ImageDataset, open_dataset
from batchwire.pipeline.local import LocalLoader
from batchwire.pipeline.transforms import (
    PROBE_CALLS,
    RandomResizedCropFlip,
    TransformError,
    TransformRunner,
    load_transform,
    torchvision_v2,
    transform_seeds,
)
from oddfiles import write_image_folder

USER = Path(__file__).resolve().parents[1] / "e2e" / "test_transforms_user.py"


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> ImageDataset:
    tmp = tmp_path_factory.mktemp("transforms")
    root = write_image_folder(tmp / "tree", classes=3, good_per_class=6)
    return open_dataset(root, cache_dir=tmp / "cache")


def user_module() -> ModuleType:
    """The tests' user transforms, imported once (their `HOSTILE` table is shared state)."""
    if "bw_user_t" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bw_user_t", USER)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["bw_user_t"] = module
        spec.loader.exec_module(module)
    return sys.modules["bw_user_t"]


def epoch_batches(loader: LocalLoader, epoch: int) -> list[tuple[torch.Tensor, ...]]:
    loader.set_epoch(epoch)
    return [tuple(t.clone() for t in b) for b in loader]


def test_seeds_are_a_function_of_seed_epoch_index_and_leave_plan_draws_alone() -> None:
    a = transform_seeds(3, 1, [5, 6, 7])
    assert a == transform_seeds(3, 1, [7, 6, 5])[::-1]  # per index, not per position
    assert a != transform_seeds(3, 2, [5, 6, 7]) and a != transform_seeds(4, 1, [5, 6, 7])
    assert transform_seeds(3, 1, [5], view=1) != a[:1]
    assert all(0 <= s < 1 << 53 for s in a)
    # The plan's draws are stream 0: untouched by a new stream's existence.
    before = draw_uniforms(3, 1, [5], 45)
    transform_seeds(3, 1, [5])
    assert np.array_equal(before, draw_uniforms(3, 1, [5], 45))


def test_load_transform_forms_and_errors() -> None:
    fn = load_transform(f"{USER}:rrc32")
    assert isinstance(fn, RandomResizedCropFlip)
    assert load_transform("batchwire.pipeline.transforms:RandomResizedCropFlip") is (
        RandomResizedCropFlip
    )
    with pytest.raises(ValueError, match="cannot import"):
        load_transform("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="has no attribute"):
        load_transform(f"{USER}:nope")
    with pytest.raises(ValueError, match="not callable"):
        load_transform("batchwire.pipeline.transforms:MAX_LOGGED_ERRORS")
    with pytest.raises(ValueError, match="module:callable"):
        AugmentConfig(image_size=32, train=True, transform="no-colon")


@pytest.mark.timeout(120)
def test_transform_batches_deterministic_rectangular_and_dtype(small: ImageDataset) -> None:
    kw = dict(split="train", batch_size=4, image_size=(24, 40), seed=2, threads=1)
    t = load_transform(f"{USER}:rrc24x40")
    with LocalLoader(small, transform=t, output_dtype="uint8", **kw) as a:
        first = epoch_batches(a, 0)
        again = epoch_batches(a, 0)
        other = epoch_batches(a, 1)
        assert a.producer.augment_name.startswith("transform")
    with LocalLoader(small, transform=f"{USER}:rrc24x40", output_dtype="uint8", **kw) as b:
        fresh = epoch_batches(b, 0)
    assert len(first) == 4
    for (x, y), (x2, y2), (x3, _y3) in zip(first, again, fresh, strict=True):
        assert x.shape == (4, 3, 24, 40) and x.dtype == torch.uint8
        assert torch.equal(x, x2) and torch.equal(x, x3) and torch.equal(y, y2)
    assert not all(torch.equal(p[0], q[0]) for p, q in zip(first, other, strict=True))


@pytest.mark.timeout(120)
def test_failing_sample_counted_replaced_epoch_complete(
    small: ImageDataset, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="batchwire.pipeline")
    user = user_module()
    kw = dict(split="train", batch_size=4, image_size=32, seed=5, threads=1, with_indices=True)
    with LocalLoader(small, transform=user.rrc32, **kw) as clean:
        base = epoch_batches(clean, 0)
    victim = int(base[1][2][2])  # the third sample of the second batch
    user.HOSTILE[transform_seeds(5, 0, [victim])[0]] = "raise"
    try:
        with LocalLoader(small, transform=user.hostile, **kw) as loader:
            got = epoch_batches(loader, 0)
            counts = loader.counts()
    finally:
        user.HOSTILE.clear()
    assert len(got) == len(base) == 4
    assert counts["transform_errors_total"] == 1 and counts["replaced_total"] >= 1
    for k, ((x, y, i), (x0, y0, i0)) in enumerate(zip(got, base, strict=True)):
        assert torch.equal(i, i0)  # the requested indices stay what the sampler said
        if k != 1:
            assert torch.equal(x, x0) and torch.equal(y, y0)
    x, x0 = got[1][0], base[1][0]
    assert torch.equal(x[[0, 1, 3]], x0[[0, 1, 3]]) and not torch.equal(x[2], x0[2])
    logged = [r for r in caplog.records if "cannot handle that sample" in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None


@pytest.mark.timeout(60)
def test_wrong_shape_is_an_error_naming_the_transform(
    small: ImageDataset, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="batchwire.pipeline")
    with (
        LocalLoader(
            small, split="train", batch_size=4, image_size=32, transform=f"{USER}:wrong_shape"
        ) as loader,
        pytest.raises(RuntimeError, match="substitutes in a row"),
    ):
        next(iter(loader))
    assert any(
        "wrong_shape" in r.getMessage() and "[3, 32, 32]" in r.getMessage() for r in caplog.records
    )


class FakeV2RandomCrop:
    """Shaped like a torchvision v2 transform: CHW tensor in, its draws from the global RNG."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[-2:]
        top = int(torch.randint(0, h - self.size + 1, (1,)))
        left = int(torch.randint(0, w - self.size + 1, (1,)))
        out = x[:, top : top + self.size, left : left + self.size].float()
        return out.flip(-1) if float(torch.rand(1)) < 0.5 else out


def test_v2_adapter_deterministic_across_threads_and_global_state() -> None:
    t = torchvision_v2(FakeV2RandomCrop(8))
    image = torch.randint(0, 256, (20, 30, 3), dtype=torch.uint8)
    gen = torch.Generator()
    gen.manual_seed(1234)
    ref = t(image, gen)
    torch.manual_seed(99)
    outside = torch.rand(3)
    torch.manual_seed(99)
    t(image, gen)  # restores the global state it found
    assert torch.equal(outside, torch.rand(3))
    results: list[torch.Tensor] = []

    def work() -> None:
        g = torch.Generator()
        g.manual_seed(1234)
        for _ in range(20):
            results.append(t(image, g))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(results) == 80 and all(torch.equal(r, ref) for r in results)
    other = torch.Generator()
    other.manual_seed(1235)
    assert "torchvision_v2" in t.__name__


def test_real_torchvision_v2_when_installed() -> None:
    v2 = pytest.importorskip("torchvision.transforms.v2")
    t = torchvision_v2(
        v2.Compose([v2.RandomResizedCrop(16, antialias=True), v2.RandomHorizontalFlip()])
    )
    image = torch.randint(0, 256, (40, 50, 3), dtype=torch.uint8)
    g1, g2 = torch.Generator(), torch.Generator()
    g1.manual_seed(7)
    g2.manual_seed(7)
    a, b = t(image, g1), t(image, g2)
    assert a.shape == (3, 16, 16) and torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# Hostile transforms: BaseExceptions, values the output cannot hold, the global RNGs


def apply_on_a_thread(runner: TransformRunner, fn_out: torch.Tensor, seed: int = 7) -> object:
    """`runner.apply` on a thread of its own, as a producer runs it: what it raised, or None."""
    image = torch.randint(0, 256, (40, 50, 3), dtype=torch.uint8)
    raised: list[BaseException | None] = [None]

    def work() -> None:
        try:
            runner.apply(image, seed, fn_out)
        except BaseException as exc:  # what would end a producer thread
            raised[0] = exc

    th = threading.Thread(target=work)
    th.start()
    th.join()
    return raised[0]


def raises(kind: type[BaseException]) -> Callable[[torch.Tensor, torch.Generator], torch.Tensor]:
    def transform(image: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        raise kind("from the transform")

    return transform


@pytest.mark.parametrize("kind", [SystemExit, KeyboardInterrupt, GeneratorExit, RuntimeError])
def test_anything_a_transform_raises_on_a_producer_thread_is_a_transform_error(
    kind: type[BaseException],
) -> None:
    runner = TransformRunner(raises(kind), (8, 8))
    out = torch.zeros(3, 8, 8)
    exc = apply_on_a_thread(runner, out)
    assert isinstance(exc, TransformError) and isinstance(exc.__cause__, kind)
    assert f"raised {kind.__name__}" in str(exc) and torch.equal(out, torch.zeros(3, 8, 8))


def test_a_ctrl_c_on_the_main_thread_still_stops_the_caller() -> None:
    # Python delivers a real Ctrl-C to the main thread only: there it must go through.
    runner = TransformRunner(raises(KeyboardInterrupt), (8, 8))
    image = torch.zeros(8, 8, 3, dtype=torch.uint8)
    with pytest.raises(KeyboardInterrupt):
        runner.apply(image, 1, torch.zeros(3, 8, 8))


def returns(result: torch.Tensor) -> Callable[[torch.Tensor, torch.Generator], torch.Tensor]:
    def transform(image: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return result

    return transform


def with_value(dtype: torch.dtype, value: float, at: tuple[int, ...] = (1, 2, 3)) -> torch.Tensor:
    x = torch.full((3, 8, 8), 100, dtype=dtype)
    x[at] = value
    return x


@pytest.mark.parametrize(
    ("result", "out_dtype", "why"),
    [
        (with_value(torch.float32, float("nan")), torch.float32, "non-finite"),
        (with_value(torch.float32, float("nan")), torch.uint8, "non-finite"),
        (with_value(torch.float16, float("inf")), torch.float16, "non-finite"),
        (with_value(torch.float32, -float("inf")), torch.bfloat16, "non-finite"),
        (with_value(torch.float32, 1e5), torch.float16, "beyond torch.float16's range"),
        (with_value(torch.int32, 70000), torch.float16, "beyond torch.float16's range"),
        (with_value(torch.int32, 300), torch.uint8, "out of torch.uint8's [0, 255]"),
        (with_value(torch.int64, -1), torch.uint8, "out of torch.uint8's [0, 255]"),
        (with_value(torch.int16, 256), torch.uint8, "out of torch.uint8's [0, 255]"),
        (torch.zeros(3, 8, 8, device="meta"), torch.float32, "on meta"),
        # A [0, 1] or normalised image into uint8 would be sent black (0..3 of 255).
        (torch.rand(3, 8, 8) * 0.9 + 0.05, torch.uint8, "or normalised, sent black"),
        (torch.linspace(-2.1, 2.6, 192).view(3, 8, 8), torch.uint8, "float --output-dtype"),
        (torch.zeros(3, 8, 8, dtype=torch.complex64), torch.float32, "complex64"),
    ],
    ids=lambda v: str(v) if isinstance(v, (str, torch.dtype)) else None,
)
def test_a_result_the_output_cannot_hold_is_a_transform_error(
    result: torch.Tensor, out_dtype: torch.dtype, why: str
) -> None:
    runner = TransformRunner(returns(result), (8, 8))
    out = torch.zeros(3, 8, 8, dtype=out_dtype)
    exc = apply_on_a_thread(runner, out)
    assert isinstance(exc, TransformError), exc
    assert why in str(exc) and "returns.<locals>.transform returned" in str(exc)
    assert not out.any()  # nothing written


@pytest.mark.parametrize(
    ("result", "out_dtype", "expected"),
    [
        (with_value(torch.float32, 300.7), torch.uint8, 255),  # the documented clamp
        (with_value(torch.float32, -3.0), torch.uint8, 0),
        (torch.zeros(3, 8, 8), torch.uint8, 0),  # an all-black photo stays one
        (with_value(torch.float32, 3.5, at=(0, 0, 0)) * 0.0 + 3.5, torch.uint8, 4),  # dark photo
        (with_value(torch.int64, 255), torch.uint8, 255),
        (with_value(torch.uint8, 255), torch.float16, 255),
        (with_value(torch.float64, 1e30), torch.float32, 1e30),
        (with_value(torch.float32, 65504.0), torch.float16, 65504),
        (with_value(torch.bool, True), torch.uint8, 1),
    ],
    ids=str,
)
def test_results_the_output_can_hold_are_written(
    result: torch.Tensor, out_dtype: torch.dtype, expected: float
) -> None:
    runner = TransformRunner(returns(result), (8, 8))
    out = torch.zeros(3, 8, 8, dtype=out_dtype)
    assert apply_on_a_thread(runner, out) is None
    assert float(out[1, 2, 3]) == pytest.approx(expected, rel=1e-6)
    assert runner.errors_total == 0 and not runner.draws_global_rng


@pytest.mark.timeout(120)
def test_nan_and_int_out_of_range_samples_are_replaced_and_counted(small: ImageDataset) -> None:
    user = user_module()
    kw = dict(split="train", batch_size=4, image_size=32, seed=5, threads=1, with_indices=True)
    with LocalLoader(small, transform=user.rrc32, output_dtype="uint8", **kw) as clean:
        victims = [int(i) for i in epoch_batches(clean, 0)[2][2][:2]]
    seeds = transform_seeds(5, 0, victims)
    for dtype, kinds in (("float32", ("nan", "inf")), ("uint8", ("int300", "meta"))):
        user.HOSTILE.update(zip(seeds, kinds, strict=True))
        try:
            with LocalLoader(small, transform=user.hostile, output_dtype=dtype, **kw) as loader:
                got = epoch_batches(loader, 0)
                counts = loader.counts()
        finally:
            user.HOSTILE.clear()
        assert len(got) == 4 and counts["transform_errors_total"] == 2, dtype
        images = torch.cat([b[0] for b in got]).float()
        assert torch.isfinite(images).all() and images.std() > 10


# A transform drawing from a global RNG: seeded per sample, its runner warns once.


def draws_from(rng: str) -> Callable[[torch.Tensor, torch.Generator], torch.Tensor]:
    """A [3, 8, 8] crop whose corner comes from the generator, its brightness from ``rng``."""

    def transform(image: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        top = int(torch.randint(0, 8, (1,), generator=generator))
        x = image[top : top + 8, :8].permute(2, 0, 1).float()
        draw = {
            "torch.rand": lambda: float(torch.rand(1)),
            "torch.randint": lambda: float(torch.randint(0, 100, (1,))) / 100,
            "random.random": random.random,
            "np.random.rand": lambda: float(np.random.rand()),
            "generator": lambda: float(torch.rand(1, generator=generator)),
        }[rng]
        return x * (0.5 + draw())

    transform.__qualname__ = f"draws_from_{rng}"
    return transform


def run_samples(runner: TransformRunner, seeds: list[int], threads: int) -> list[torch.Tensor]:
    """Each seed's output, the seeds spread over ``threads`` producer threads."""
    image = torch.arange(16 * 16 * 3, dtype=torch.int64).reshape(16, 16, 3).to(torch.uint8)
    outs = [torch.zeros(3, 8, 8) for _ in seeds]

    def work(k: int) -> None:
        for i in range(k, len(seeds), threads):
            runner.apply(image, seeds[i], outs[i])

    pool = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    return outs


@pytest.mark.parametrize("rng", ["torch.rand", "torch.randint", "random.random", "np.random.rand"])
def test_a_transform_drawing_from_a_global_rng_is_reproducible_and_warned_once(
    rng: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="batchwire.pipeline")
    seeds = transform_seeds(3, 0, range(PROBE_CALLS + 8))
    a = TransformRunner(draws_from(rng), (8, 8))
    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    first = run_samples(a, seeds, threads=1)
    b = TransformRunner(draws_from(rng), (8, 8))  # another producer: other thread split, state
    torch.manual_seed(2)
    random.seed(2)
    np.random.seed(2)
    outside = (*torch.rand(3).tolist(), random.random(), np.random.rand())
    torch.manual_seed(2)
    random.seed(2)
    np.random.seed(2)
    second = run_samples(b, seeds, threads=4)
    assert all(torch.equal(x, y) for x, y in zip(first, second, strict=True))
    assert len({float(x.sum()) for x in first}) > len(seeds) // 2  # the draws vary by sample
    assert (*torch.rand(3).tolist(), random.random(), np.random.rand()) == outside  # restored
    assert a.draws_global_rng and b.draws_global_rng
    warned = [r.getMessage() for r in caplog.records if "global RNG" in r.getMessage()]
    assert len(warned) == 2 and all(f"draws_from_{rng}" in m for m in warned)
    assert "generator=generator" in warned[0]


def test_a_transform_drawing_from_its_generator_only_runs_unwatched_after_the_probe(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="batchwire.pipeline")
    seeds = transform_seeds(3, 0, range(PROBE_CALLS + 8))
    runner = TransformRunner(draws_from("generator"), (8, 8))
    first = run_samples(runner, seeds, threads=4)
    again = run_samples(runner, seeds, threads=1)  # all unwatched now
    assert all(torch.equal(x, y) for x, y in zip(first, again, strict=True))
    assert not runner.draws_global_rng and not caplog.records


def test_a_v2_adapter_under_its_runner_is_not_watched_nor_warned(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # It seeds the global RNGs itself: the runner neither watches it nor serialises it twice.
    caplog.set_level(logging.WARNING, logger="batchwire.pipeline")
    runner = TransformRunner(torchvision_v2(FakeV2RandomCrop(8)), (8, 8))
    seeds = transform_seeds(3, 0, range(12))
    assert all(
        torch.equal(x, y)
        for x, y in zip(run_samples(runner, seeds, 4), run_samples(runner, seeds, 1), strict=True)
    )
    assert not runner.draws_global_rng and not caplog.records
