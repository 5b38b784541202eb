"""SampleLoader's stages one at a time over a `SampleBatch` (read -> verify -> plan ->
decode): what each fills, and a bad file sent back to read for its substitute."""

from __future__ import annotations

from pathlib import Path

import pytest
from batchwire.pipeline.augment_plan import AugmentConfig
from batchwire.pipeline.dataset import ImageDataset, open_dataset
from batchwire.pipeline.decode import CpuBatchDecoder
from batchwire.pipeline.samples import BadFileTally, SampleLoader
from batchwire.pipeline.stages import DECODE, PLAN, READ, VERIFY, StageHook
from oddfiles import write_image_folder

CONFIG = AugmentConfig(image_size=24, train=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> ImageDataset:
    """Good JPEGs, a text file (bad at verify: no image header) and a truncated JPEG (its
    header reads, its pixels do not: bad at decode)."""
    tmp = tmp_path_factory.mktemp("stages")
    root = write_image_folder(
        tmp / "tree", classes=2, good_per_class=4, bad={"class0": ("text", "truncated")}
    )
    return open_dataset(root, cache_dir=tmp / "cache")


def _index(ds: ImageDataset, kind: str) -> int:
    return next(i for i, p in enumerate(ds.paths) if Path(p).name.startswith(f"bad_{kind}"))


def _good(ds: ImageDataset) -> int:
    return next(i for i, p in enumerate(ds.paths) if not Path(p).name.startswith("bad_"))


def test_each_stage_fills_the_next_ones_list(folder: ImageDataset) -> None:
    good = _good(folder)
    with CpuBatchDecoder(1) as dec:
        loader = SampleLoader(folder, CONFIG, seed=0, decoder=dec)
        batch = loader._batch(0, [good, good], None, None)
        assert loader.read(batch) == VERIFY
        assert [r[:4] for r in batch.to_verify] == [(0, good, good, 0), (1, good, good, 0)]
        assert batch.to_verify[0][4] == folder.read_bytes(good)
        assert loader.verify(batch) == PLAN and len(batch.to_plan) == 2 and not batch.to_read
        assert loader.plan(batch) == DECODE
        assert [slot for slot, _ in batch.to_decode] == [0, 1]
        assert batch.to_decode[0][1].plan == batch.to_decode[1][1].plan
        assert loader.decode(batch) is None  # done
        assert all(s is not None and s.image.shape[2] == 3 for s in batch.loaded)
        assert loader.counts()["replaced_total"] == 0


def test_verify_sends_a_bad_file_back_to_read(folder: ImageDataset) -> None:
    text = _index(folder, "text")
    with CpuBatchDecoder(1) as dec:
        loader = SampleLoader(folder, CONFIG, seed=0, decoder=dec)
        batch = loader._batch(0, [text], None, None)
        assert loader.read(batch) == VERIFY
        assert loader.verify(batch) == READ  # a substitute to read
        assert batch.to_read == [(0, text, 1)] and not batch.to_plan
        assert text in loader.known_bad
        while loader.read(batch) == VERIFY and loader.verify(batch) == READ:
            pass
        (found,) = batch.to_plan
        assert found[1] == text and found[2] != text and found[3] >= 1


def test_decode_sends_a_bad_file_back_to_read(folder: ImageDataset) -> None:
    truncated = _index(folder, "truncated")
    with CpuBatchDecoder(1) as dec:
        loader = SampleLoader(folder, CONFIG, seed=0, decoder=dec)
        batch = loader._batch(0, [truncated], None, None)
        loader.read(batch)
        assert loader.verify(batch) == PLAN  # its header reads
        loader.plan(batch)
        assert loader.decode(batch) == READ
        assert batch.to_read == [(0, truncated, 1)] and batch.loaded == [None]
        assert truncated in loader.known_bad
        loader._run(batch, READ, StageHook().start())
        (sample,) = batch.loaded
        assert sample is not None and sample.replaced and sample.index != truncated
        assert loader.counts()["replaced_total"] == 1


def test_load_enters_each_stage_on_the_clock(folder: ImageDataset) -> None:
    truncated = _index(folder, "truncated")
    hook = StageHook()
    clock = hook.start()
    with CpuBatchDecoder(1) as dec:
        loader = SampleLoader(folder, CONFIG, seed=0, decoder=dec)
        loader.load(0, [truncated, _good(folder)], clock=clock)
    assert set(clock.seconds) == {READ, VERIFY, PLAN, DECODE}
    assert set(clock.stop()) == {"read", "decode"}
    assert hook.depth == {"read": 0, "decode": 0, "augment": 0}


def test_bad_files_are_taken_once_and_tallied_once(folder: ImageDataset) -> None:
    text, truncated = _index(folder, "text"), _index(folder, "truncated")
    tally = BadFileTally()
    with CpuBatchDecoder(1) as dec:
        a = SampleLoader(folder, CONFIG, seed=0, decoder=dec)
        b = SampleLoader(folder, CONFIG, seed=1, decoder=dec)  # another split, same files
        a.load(0, [text])
        taken = a.take_bad_files()
        assert taken == (folder.paths[text],) and tally.add(taken) == 1
        assert a.take_bad_files() == ()
        a.load(0, [truncated, text])
        b.load(0, [truncated, text])
        assert a.take_bad_files() == (folder.paths[truncated],)  # text: taken before
        assert tally.add([folder.paths[truncated]]) == 1
        assert tally.add(b.take_bad_files()) == 0  # the same files, found by the other split
    assert tally.total == 2
