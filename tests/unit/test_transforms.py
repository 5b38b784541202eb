"""User transforms in-process: seeds, determinism, errors replaced, shape checks, the v2 adapter."""

from __future__ import annotations

import importlib.util
import logging
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from batchwire.pipeline.augment_plan import AugmentConfig, draw_uniforms
from batchwire.pipeline.dataset import ImageDataset, open_dataset
from batchwire.pipeline.local import LocalLoader
from batchwire.pipeline.transforms import (
    RandomResizedCropFlip,
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
    spec = importlib.util.spec_from_file_location("bw_user_t", USER)
    assert spec is not None and spec.loader is not None
    user = importlib.util.module_from_spec(spec)
    sys.modules["bw_user_t"] = user
    spec.loader.exec_module(user)
    kw = dict(split="train", batch_size=4, image_size=32, seed=5, threads=1, with_indices=True)
    with LocalLoader(small, transform=user.rrc32, **kw) as clean:
        base = epoch_batches(clean, 0)
    victim = int(base[1][2][2])  # the third sample of the second batch
    user.FAIL_SEEDS.add(transform_seeds(5, 0, [victim])[0])
    try:
        with LocalLoader(small, transform=user.fails_on_seed, **kw) as loader:
            got = epoch_batches(loader, 0)
            counts = loader.counts()
    finally:
        user.FAIL_SEEDS.clear()
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
