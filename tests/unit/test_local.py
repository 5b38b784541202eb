"""LocalLoader end to end on generated ImageFolders mixing good and bad files."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from batchwire.pipeline.dataset import ImageDataset, open_dataset
from batchwire.pipeline.decode import CpuBatchDecoder
from batchwire.pipeline.local import LocalLoader
from oddfiles import BAD_KINDS, odd_file_bytes, write_image_folder

BAD = {"class0": ("truncated", "empty"), "class2": ("text", "huge_header", "png_as_jpg")}
# png_as_jpg is readable: it must not count as bad.
N_BAD = 4


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> ImageDataset:
    tmp = tmp_path_factory.mktemp("local")
    root = write_image_folder(tmp / "tree", classes=3, good_per_class=7, bad=BAD)
    return open_dataset(root, cache_dir=tmp / "cache")


def bad_paths(ds: ImageDataset) -> set[str]:
    return {p for p in ds.paths if Path(p).name.startswith("bad_") and "png" not in p}


@pytest.mark.timeout(120)
def test_full_epoch_with_bad_files(mixed: ImageDataset, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="batchwire.pipeline")
    bad = bad_paths(mixed)
    assert len(bad) == N_BAD and len(mixed) == 26
    with LocalLoader(
        mixed, split="train", batch_size=4, image_size=20, seed=1, threads=2, with_indices=True
    ) as loader:
        assert len(loader) == 6  # 26 // 4 with drop_last
        for epoch in (0, 1):
            loader.set_epoch(epoch)
            seen = []
            for images, labels, indices in loader:
                assert images.shape == (4, 3, 20, 20) and images.dtype == torch.float32
                assert torch.isfinite(images).all()
                assert labels.dtype == torch.int64 and indices.dtype == torch.int64
                for i, label in zip(indices.tolist(), labels.tolist(), strict=True):
                    if mixed.paths[i] not in bad:
                        assert label == mixed.labels[i]
                seen += indices.tolist()
            assert len(seen) == 24 and len(set(seen)) == 24
        counts = loader.counts()
    # Every bad file is met in at least one of the two epochs (only 2 of 26 dropped per epoch).
    assert counts["bad_total"] == N_BAD
    assert N_BAD <= counts["replaced_total"] <= 2 * N_BAD
    for path in bad:
        assert sum(path in r.getMessage() for r in caplog.records) == 1, path


def test_val_epoch_every_image_once_with_padding(mixed: ImageDataset) -> None:
    def rank_loader(rank: int) -> LocalLoader:
        return LocalLoader(
            mixed,
            split="val",
            batch_size=4,
            image_size=16,
            threads=2,
            with_indices=True,
            world_size=2,
            rank=rank,
            output_dtype="uint8",
        )

    with rank_loader(1) as r1, rank_loader(0) as r0:
        assert len(r0) == len(r1) == 4
        seen = []
        for loader in (r0, r1):
            for images, _, indices in loader:
                assert images.shape == (4, 3, 16, 16) and images.dtype == torch.uint8
                seen += indices.tolist()
    valid = [i for i in seen if i >= 0]
    assert sorted(valid) == list(range(len(mixed)))
    assert seen.count(-1) == 32 - 26


def test_same_seed_and_epoch_bit_identical_across_thread_counts(mixed: ImageDataset) -> None:
    def run(threads: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        with LocalLoader(
            mixed, batch_size=5, image_size=24, seed=9, threads=threads, contrast=0.5
        ) as loader:
            loader.set_epoch(3)
            return list(loader)

    one, four = run(1), run(4)
    assert len(one) == len(four) == 5
    for (a, la), (b, lb) in zip(one, four, strict=True):
        assert torch.equal(a, b) and torch.equal(la, lb)
    with LocalLoader(mixed, batch_size=5, image_size=24, seed=9, threads=2) as other:
        other.set_epoch(4)
        batches = iter(other)
        assert not torch.equal(next(batches)[0], one[0][0])  # another epoch, another batch
        batches.close()


def test_ring_semantics_and_early_stop(mixed: ImageDataset) -> None:
    """copy=False yields ring buffers (reused); the default yields tensors the caller owns."""
    decoder = CpuBatchDecoder(2)
    try:
        raw = LocalLoader(mixed, batch_size=3, image_size=12, decoder=decoder, ring=2, copy=False)
        ring_ptrs = {b.data_ptr() for b in raw.ring.buffers}
        ptrs = [images.data_ptr() for images, _ in raw]
        assert set(ptrs) <= ring_ptrs and len(ptrs) == len(raw)

        safe = LocalLoader(mixed, batch_size=3, image_size=12, decoder=decoder, ring=2)
        kept = []
        for images, _ in safe:
            assert images.data_ptr() not in {b.data_ptr() for b in safe.ring.buffers}
            kept.append((images, images.clone()))
        for images, snapshot in kept:
            assert torch.equal(images, snapshot)

        # Stopping after one batch ends the background thread and frees every buffer.
        it = iter(raw)
        next(it)
        it.close()
        assert raw.ring.free == len(raw.ring)
        again = iter(safe)
        assert torch.equal(next(again)[0], kept[0][1])
        again.close()
        assert safe.ring.free == len(safe.ring)
    finally:
        decoder.close()


def _within(seconds: float, fn):
    """``fn()``'s result, or a failure (not a hung test) when it takes longer."""
    box: list = []

    def run() -> None:
        try:
            box.append((fn(), None))
        except Exception as exc:  # raised again in the test's thread
            box.append((None, exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert box, f"still waiting after {seconds} s"
    result, error = box[0]
    if error is not None:
        raise error
    return result


@pytest.mark.parametrize("copy", [True, False])
def test_a_newer_iterator_supersedes_an_open_one(mixed: ImageDataset, copy: bool) -> None:
    """A pass left open (a peeked iterator kept, zip(loader, loader), a notebook cell re-run
    after an error) held the ring's buffers in its worker, and the next iter() waited for them
    for ever. Now the newer pass ends the older one, whose iterator raises, as RemoteLoader's."""
    decoder = CpuBatchDecoder(1)
    try:
        loader = LocalLoader(mixed, batch_size=3, image_size=12, decoder=decoder, ring=2, copy=copy)
        reference = [labels.clone() for _, labels in loader]
        first = iter(loader)
        next(first)
        second = iter(loader)
        got = _within(30, lambda: [labels.clone() for _, labels in second])
        assert [g.tolist() for g in got] == [r.tolist() for r in reference]
        with pytest.raises(RuntimeError, match="superseded by a newer iter"):
            next(first)
        assert loader.ring.free == len(loader.ring)

        third = iter(loader)
        next(third)
        loader.close()  # mid-pass: its worker stops and the iterator says why, never waits
        with pytest.raises(RuntimeError, match="loader was closed"):
            _within(10, lambda: next(third))
    finally:
        decoder.close()


def test_all_bad_dataset_fails_at_construction(tmp_path: Path) -> None:
    root = tmp_path / "bad"
    (root / "only").mkdir(parents=True)
    for kind in BAD_KINDS:
        (root / "only" / f"{kind}.jpg").write_bytes(odd_file_bytes(kind))
    dataset = open_dataset(root, cache_dir=tmp_path / "cache")
    with pytest.raises(ValueError, match="no readable image in"):
        LocalLoader(dataset, batch_size=2, image_size=8, threads=1)


def test_bad_arguments_are_clear(mixed: ImageDataset) -> None:
    with pytest.raises(ValueError, match="split"):
        LocalLoader(mixed, split="test", batch_size=2, image_size=8)
    with pytest.raises(ValueError, match="drop_last"):
        LocalLoader(mixed, batch_size=100, image_size=8)
    with pytest.raises(TypeError):
        LocalLoader(mixed, batch_size=2, image_size=8, no_such_option=1)


@pytest.mark.timeout(240)
def test_embedded_dataset_bit_identical_with_1_and_4_threads() -> None:
    """The embedded dataset (varied sizes, subsampling, greyscale, progressive JPEGs): a
    40-image subset, jitter on, same (seed, epoch) -> the same bytes whatever the threads."""
    from batchwire.pipeline.synthetic import default_dataset

    full = open_dataset(default_dataset().train_root)
    pick = np.arange(0, len(full), len(full) // 40)[:40]
    subset = ImageDataset(
        paths=[full.paths[i] for i in pick],
        labels=full.labels[pick],
        classes=full.classes,
        root=full.root,
    )

    def run(threads: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        with LocalLoader(
            subset,
            batch_size=10,
            image_size=48,
            seed=2,
            threads=threads,
            brightness=0.3,
            saturation=0.3,
            output_dtype="uint8",
        ) as loader:
            loader.set_epoch(1)
            return list(loader)

    one, four = run(1), run(4)
    assert len(one) == 4
    for (a, la), (b, lb) in zip(one, four, strict=True):
        assert torch.equal(a, b) and torch.equal(la, lb)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("copy", [True, False])
def test_cuda_consumer_on_a_busy_side_stream(mixed: ImageDataset, copy: bool) -> None:
    """Production on the loader's stream, consumption on the caller's side stream, kept busy so
    the host runs ahead: each buffer must be produced before it is read and not rewritten before
    the side stream is done with it (the same batches as a synchronous consumer)."""

    def run(side: bool) -> list[torch.Tensor]:
        out = []
        with LocalLoader(
            mixed, batch_size=4, image_size=20, seed=1, threads=2, device="cuda", copy=copy, ring=2
        ) as loader:
            stream = torch.cuda.Stream() if side else torch.cuda.current_stream()
            with torch.cuda.stream(stream):
                for images, _ in loader:
                    assert images.is_cuda
                    if side:
                        torch.cuda._sleep(20_000_000)
                        out.append(images.clone())
                    else:
                        out.append(images.cpu())
            stream.synchronize()
        return [t.cpu() for t in out]

    want, got = run(side=False), run(side=True)
    assert len(got) == len(want) == 6
    for k, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"batch {k} differs"


# --------------------------------------------------------------------- the rank's GPU (DDP)


def test_an_index_less_cuda_is_the_ranks_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 25, defect 3: resolved from LOCAL_RANK (and set_device's choice), with CUDA's
    count and current device given, so no GPU is needed."""
    from batchwire.common.devices import local_cuda_index, process_device

    monkeypatch.setenv("LOCAL_RANK", "1")
    assert str(process_device("cuda", device_count=2, current=0)) == "cuda:1"
    assert str(process_device("cuda:0", device_count=2, current=0)) == "cuda:0"  # explicit
    assert str(process_device("cpu")) == "cpu"
    assert local_cuda_index(2, current=1) == 1  # torch.cuda.set_device(1) wins
    assert local_cuda_index(1, current=0) == 0  # LOCAL_RANK past the visible GPUs
    monkeypatch.delenv("LOCAL_RANK")
    assert str(process_device("cuda", device_count=4, current=0)) == "cuda:0"


def test_remote_and_local_loaders_resolve_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    """RemoteLoader's placement uses the same function (the rule lives in common/devices)."""
    from batchwire.client import placement

    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert placement.local_cuda_index(4) == 3


def test_a_gpu_decoder_is_made_on_the_ranks_gpu(
    mixed: ImageDataset, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LocalLoader(decoder="nvjpeg") with no device under torchrun's LOCAL_RANK=1 asks
    `make_decoder` for cuda:1, not an index-less "cuda" (GPU 0 for the decoders). CUDA's count
    and current device are stood in for; the decoder made is a CPU one, so this runs here."""
    import batchwire.pipeline.local as local

    asked: list[str | None] = []

    def fake_make_decoder(name, device, threads, *, max_batch):
        asked.append(device)
        return CpuBatchDecoder(1)

    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(local, "make_decoder", fake_make_decoder)
    for device in (None, "cuda"):
        decoder, owned = local._make_decoder("nvjpeg", 1, device, 4)
        decoder.close()
        assert owned
    assert asked == ["cuda:1", "cuda:1"]
    with LocalLoader(mixed, batch_size=4, image_size=20, decoder="nvjpeg", threads=1) as loader:
        assert asked[-1] == "cuda:1" and loader.device == torch.device("cpu")  # the fake's
