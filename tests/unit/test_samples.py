"""SampleLoader: bad files are logged once, counted and replaced deterministically."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from batchwire.pipeline.augment_plan import AugmentConfig, plan_sample
from batchwire.pipeline.dataset import ImageDataset, open_dataset
from batchwire.pipeline.decode import CpuBatchDecoder, read_header
from batchwire.pipeline.samples import (
    SampleLoader,
    UnreadableDatasetError,
    probe,
    substitute_candidates,
)
from oddfiles import BAD_KINDS, odd_file_bytes, write_image_folder

BAD = {"class0": ("truncated", "empty"), "class1": ("text", "huge_header", "garbage_after_soi")}
CONFIG = AugmentConfig(image_size=24, train=True)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> ImageDataset:
    tmp = tmp_path_factory.mktemp("samples")
    root = write_image_folder(tmp / "tree", classes=3, good_per_class=5, bad=BAD)
    return open_dataset(root, cache_dir=tmp / "cache")


def bad_indices(ds: ImageDataset) -> set[int]:
    return {i for i, p in enumerate(ds.paths) if Path(p).name.startswith("bad_")}


def test_substitute_candidates_are_deterministic_and_exclude_self() -> None:
    a = substitute_candidates(7, 5, 64, 10)
    assert np.array_equal(a, substitute_candidates(7, 5, 64, 10))
    assert a.dtype == np.int64 and a.min() >= 0 and a.max() < 10 and 5 not in a
    assert len(set(a.tolist())) == 9  # 64 uniform draws over 9 others hit all of them
    assert not np.array_equal(a, substitute_candidates(8, 5, 64, 10))
    assert substitute_candidates(7, 0, 4, 1).size == 0


def test_bad_files_replaced_counted_and_logged_once(
    mixed: ImageDataset, caplog: pytest.LogCaptureFixture
) -> None:
    bad = bad_indices(mixed)
    assert len(bad) == 5
    caplog.set_level(logging.WARNING, logger="batchwire.pipeline")
    with CpuBatchDecoder(threads=2) as dec:
        loader = SampleLoader(mixed, CONFIG, seed=3, decoder=dec)
        everything = list(range(len(mixed)))
        for epoch in (0, 1):
            samples = loader.load(epoch, everything)
            assert [s.requested for s in samples] == everything
            for s in samples:
                assert s.replaced == (s.requested in bad)
                assert s.index not in bad
                assert s.label == mixed.labels[s.index]
                assert s.image.ndim == 3 and s.image.shape[2] == 3
                header = read_header(mixed.read_bytes(s.index))
                assert s.plan == plan_sample(CONFIG, 3, epoch, s.index, header.height, header.width)
        assert loader.counts() == {"bad_total": 5, "replaced_total": 10, "transient_total": 0}
        assert set(loader.known_bad) == bad
    for i in bad:
        path = mixed.paths[i]
        logged = [r for r in caplog.records if path in r.getMessage()]
        assert len(logged) == 1, path


def test_substitutes_do_not_depend_on_threads_or_batch_order(mixed: ImageDataset) -> None:
    order = list(range(len(mixed)))
    with CpuBatchDecoder(threads=1) as one, CpuBatchDecoder(threads=4) as four:
        a = SampleLoader(mixed, CONFIG, seed=11, decoder=one).load(2, order)
        b = SampleLoader(mixed, CONFIG, seed=11, decoder=four).load(2, order[::-1])[::-1]
    for x, y in zip(a, b, strict=True):
        assert (x.requested, x.index, x.label, x.plan, x.box) == (
            y.requested,
            y.index,
            y.label,
            y.plan,
            y.box,
        )
        assert np.array_equal(x.image.numpy(), y.image.numpy())


def test_all_bad_dataset_is_a_clear_error_at_start(tmp_path: Path) -> None:
    root = tmp_path / "allbad"
    for c in ("a", "b"):
        (root / c).mkdir(parents=True)
        for kind in BAD_KINDS:
            (root / c / f"{kind}.jpg").write_bytes(odd_file_bytes(kind))
    ds = open_dataset(root, cache_dir=tmp_path / "cache")
    with CpuBatchDecoder(threads=1) as dec, pytest.raises(ValueError, match="no readable image"):
        SampleLoader(ds, CONFIG, seed=0, decoder=dec)


def test_a_run_of_bad_substitutes_raises(tmp_path: Path) -> None:
    """One good file among many bad: when every substitute tried is bad, a clear error."""
    root = tmp_path / "mostlybad"
    (root / "c").mkdir(parents=True)
    (root / "c" / "a_good.jpg").write_bytes(odd_file_bytes("rgb"))
    for k in range(30):
        (root / "c" / f"b{k:02d}.jpg").write_bytes(b"junk")
    ds = open_dataset(root, cache_dir=tmp_path / "cache")
    attempts = 3
    victim = next(
        i for i in range(1, len(ds)) if 0 not in substitute_candidates(0, i, attempts, len(ds))
    )
    lucky = next(
        i for i in range(1, len(ds)) if 0 in substitute_candidates(0, i, attempts, len(ds))
    )
    with CpuBatchDecoder(threads=1) as dec:
        loader = SampleLoader(ds, CONFIG, seed=0, decoder=dec, max_attempts=attempts)
        (s,) = loader.load(0, [lucky])
        assert s.index == 0 and s.replaced
        with pytest.raises(UnreadableDatasetError, match="substitutes for it are all unreadable"):
            loader.load(0, [victim])


def test_probe_looks_past_a_bad_spread(tmp_path: Path) -> None:
    """The probe's first, spread-out picks are all bad; it keeps looking and finds the good one."""
    root = tmp_path / "sparse"
    (root / "c").mkdir(parents=True)
    for k in range(31):
        data = odd_file_bytes("rgb") if k == 2 else odd_file_bytes(BAD_KINDS[k % len(BAD_KINDS)])
        (root / "c" / f"{k:02d}.jpg").write_bytes(data)
    ds = open_dataset(root, cache_dir=tmp_path / "cache")
    assert probe(ds, n=8) == 2


def test_missing_file_is_replaced(tmp_path: Path) -> None:
    """A file deleted after indexing (OSError on read) is handled like any bad file."""
    for k in range(3):
        (tmp_path / f"{k}.jpg").write_bytes(odd_file_bytes("rgb", seed=k))
    listing = tmp_path / "list.txt"
    listing.write_text("0.jpg 0\n1.jpg 1\ngone.jpg 2\n2.jpg 0\n")
    ds = open_dataset(listing)
    with CpuBatchDecoder(threads=2) as dec:
        loader = SampleLoader(ds, CONFIG, seed=0, decoder=dec)
        samples = loader.load(0, [0, 1, 2, 3])
    assert [s.replaced for s in samples] == [False, False, True, False]
    assert samples[2].index != 2 and samples[2].label == ds.labels[samples[2].index]
    assert "cannot read" in loader.known_bad[2]


def test_tiny_datasets(tmp_path: Path) -> None:
    (tmp_path / "one" / "c").mkdir(parents=True)
    (tmp_path / "one" / "c" / "a.jpg").write_bytes(odd_file_bytes("rgb"))
    (tmp_path / "two" / "c").mkdir(parents=True)
    (tmp_path / "two" / "c" / "a.jpg").write_bytes(odd_file_bytes("truncated"))
    (tmp_path / "two" / "c" / "b.jpg").write_bytes(odd_file_bytes("grey"))
    with CpuBatchDecoder(threads=1) as dec:
        one = open_dataset(tmp_path / "one", cache_dir=tmp_path / "cache")
        (s,) = SampleLoader(one, CONFIG, seed=0, decoder=dec).load(0, [0])
        assert not s.replaced
        two = open_dataset(tmp_path / "two", cache_dir=tmp_path / "cache")
        a, b = SampleLoader(two, CONFIG, seed=0, decoder=dec).load(0, [0, 1])
        assert (a.index, a.replaced, b.index, b.replaced) == (1, True, 1, False)


def test_known_bad_files_are_not_read_again(tmp_path: Path) -> None:
    root = write_image_folder(
        tmp_path / "tree", classes=2, good_per_class=3, bad={"class0": ("text",)}
    )
    ds = open_dataset(root, cache_dir=tmp_path / "cache")
    (bad,) = bad_indices(ds)
    with CpuBatchDecoder(threads=1) as dec:
        loader = SampleLoader(ds, CONFIG, seed=0, decoder=dec)
        assert loader.load(0, [bad])[0].replaced
        # Repairing the file does not matter any more: the index is remembered as bad.
        Path(ds.paths[bad]).write_bytes(odd_file_bytes("rgb"))
        assert loader.load(1, [bad])[0].replaced
        assert loader.counts() == {"bad_total": 1, "replaced_total": 2, "transient_total": 0}


def test_a_bad_file_is_logged_once_per_process_whatever_loader_meets_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Train and val of one server (two loaders over the same files), or a second loader in a
    training process, name a bad file once; each still counts and replaces it."""
    root = write_image_folder(tmp_path / "tree", classes=2, good_per_class=3, bad=BAD)
    caplog.set_level(logging.WARNING, logger="batchwire.pipeline")
    with CpuBatchDecoder(threads=1) as dec:
        loaders = [SampleLoader(open_dataset(root), CONFIG, seed=1, decoder=dec) for _ in range(2)]
        for loader in loaders:
            everything = list(range(len(loader.dataset)))
            loader.load(0, everything)
            assert loader.bad_total == len(bad_indices(loader.dataset)) > 0
    for i in bad_indices(loaders[0].dataset):
        path = loaders[0].dataset.paths[i]
        logged = [r for r in caplog.records if path in r.getMessage()]
        assert len(logged) == 1, path
