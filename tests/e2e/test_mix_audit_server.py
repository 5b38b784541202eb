"""Audit of a mixture served by a real `pipeline-server`, as a trainer's own code reads it
(docs/mixtures.md), checked against counts made here:

- two ranks (world_size 2) get disjoint positions of the epoch and together the single-rank
  stream, pixel for pixel; each part's realised share of the epoch is its weight (our own count
  of the ``part`` metadata), and the server's per-part stats say what we counted;
- a rank resumed mid-epoch (``state_dict``/``load_state_dict``) yields exactly the batches the
  uninterrupted run would, indices and pixels; resumed at world size 1 (elastic), the rest of the
  epoch, every remaining sample once;
- the val mix visits every val sample once over the two ranks, each with its own label;
- a state resumed at 3 ranks pads its last round in train batches, and a loop that mixes every
  batch with `BatchMixer` goes through it.

One small server for the file: parts of 16 and 8 real JPEGs (symlinks to the shared sample in
a temporary folder), 32 px, batches of 4.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest
import torch
from batchwire.client import RemoteLoader
from batchwire.client.mixing import BatchMixer
from jpegchecks import SAMPLE_DIR
from serverproc import running_server

SAMPLE = SAMPLE_DIR
B = 4


def _folder(root: Path, classes: dict[str, list[Path]]) -> Path:
    for name, files in classes.items():
        (root / name).mkdir(parents=True)
        for f in files:
            os.symlink(f, root / name / f.name)
    return root


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    files = sorted(SAMPLE.glob("*.JPEG"))
    if len(files) < 40:
        pytest.skip(f"{SAMPLE} holds too few JPEGs")
    tmp = tmp_path_factory.mktemp("mixaudit")
    return {
        "a": _folder(tmp / "a", {"cat": files[0:8], "dog": files[8:16]}),
        "b": _folder(tmp / "b", {"fish": files[16:20], "bird": files[20:24]}),
        "va": _folder(tmp / "va", {"cat": files[24:27], "dog": files[27:30]}),
        "vb": _folder(tmp / "vb", {"fish": files[30:32], "bird": files[32:35]}),
    }


@pytest.fixture(scope="module")
def server(tree: dict[str, Path]):
    args = (
        "--train", f"mix:a=0.75@{tree['a']},b=0.25@{tree['b']}",
        "--val", f"mix:a=1@{tree['va']},b=1@{tree['vb']}",
        "--batch-size", str(B), "--image-size", "32", "--workers", "1", "--seed", "3",
    )  # fmt: skip
    with running_server(*args) as srv:
        yield srv


def _loader(srv, split: str = "train", **kw) -> RemoteLoader:
    kw.setdefault("rank", 0)
    kw.setdefault("world_size", 1)
    return RemoteLoader(
        srv.endpoint, split, device="cpu", with_indices=True, with_metadata=True,
        normalize_on_device=False, prefetch_next_epoch=False, timeout=60, **kw,
    )  # fmt: skip


def _read(loader: RemoteLoader, epoch: int, stop: int | None = None) -> list[tuple]:
    """(images, labels, indices, parts) of the loader's batches of ``epoch`` (the first
    ``stop``), cloned."""
    loader.set_epoch(epoch)
    out = []
    for images, labels, indices, metadata in loader:
        ids = indices.tolist()
        parts = [m["part"] if i >= 0 else None for m, i in zip(metadata, ids, strict=True)]
        out.append((images.clone(), labels.clone(), indices.clone(), parts))
        if stop is not None and len(out) == stop:
            break
    return out


def _same(a: list[tuple], b: list[tuple]) -> None:
    assert len(a) == len(b)
    for k, (x, y) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(x[2], y[2]), f"batch {k}: indices {x[2].tolist()} vs {y[2].tolist()}"
        assert torch.equal(x[1], y[1]) and x[3] == y[3], f"batch {k}: labels or parts"
        assert torch.equal(x[0], y[0]), f"batch {k}: pixels"


def test_two_ranks_split_the_epoch_and_parts_follow_their_weights(server):
    with _loader(server) as whole:
        single = _read(whole, 1)
    ranks = []
    for rank in range(2):
        with _loader(server, rank=rank, world_size=2) as loader:
            ranks.append(_read(loader, 1))
    # 24 draws a mix epoch (16 + 8), 3 batches of 4 per rank: global batch g = k * 2 + rank.
    assert len(single) == 6 and [len(r) for r in ranks] == [3, 3]
    _same([ranks[g % 2][g // 2] for g in range(6)], single)
    parts = Counter(p for batch in single for p in batch[3])
    assert parts == {"a": 18, "b": 6}, parts  # 0.75 and 0.25 of 24
    for batch in single:  # every batch of 4 holds 3 of a and 1 of b (within one)
        assert abs(batch[3].count("a") - 3) <= 1, batch[3]
    mix = next(m for m in server.stats()["mixes"] if m["split"] == "train")
    assert mix["epoch"] == 1
    served = {p["name"]: p["served_this_epoch"] for p in mix["parts"]}
    assert served == {"a": 18 * 2, "b": 6 * 2}, served  # the single run and the two ranks


def test_a_resumed_rank_yields_the_rest_exactly_and_elastic_resume_completes_it(server):
    whole = []
    for rank in range(2):
        with _loader(server, rank=rank, world_size=2) as loader:
            whole.append(_read(loader, 2))
    with _loader(server, rank=0, world_size=2) as first:
        head = _read(first, 2, stop=1)
        state = first.state_dict()
    assert state["next_batch"] == 1
    _same(head, whole[0][:1])
    with _loader(server, rank=0, world_size=2) as again:
        again.load_state_dict(state)
        _same(_read(again, 2), whole[0][1:])
    # Elastic: both ranks took batch 0 (8 samples); one rank now takes the other 16.
    with _loader(server, rank=0, world_size=1) as alone:
        alone.load_state_dict(state)
        rest = _read(alone, 2)
    consumed = [whole[r][0] for r in range(2)]
    remaining = [b for r in range(2) for b in whole[r][1:]]
    got = Counter(i for b in rest for i in b[2].tolist() if i >= 0)
    assert got == Counter(i for b in remaining for i in b[2].tolist()), "not the rest, once each"
    pixels = {i: b[0][j] for b in whole[0] + whole[1] for j, i in enumerate(b[2].tolist())}
    for b in rest:
        for j, i in enumerate(b[2].tolist()):
            if i >= 0:
                assert torch.equal(b[0][j], pixels[i]), f"sample {i}: other pixels on resume"
    assert sum(len(b[2]) for b in consumed) == 8


def test_val_mix_visits_each_val_sample_once_with_its_own_label(server):
    """Val ignores weights: every sample of both val parts once over the two ranks (padding
    aside), in order (part a's 6, then part b's 5), each labelled with its folder's class in
    the union of the class names (bird, cat, dog, fish)."""
    seen: dict[int, tuple[str, int]] = {}
    for rank in range(2):
        with _loader(server, "val", rank=rank, world_size=2) as val:
            for _, labels, indices, parts in _read(val, 0):
                for j, i in enumerate(indices.tolist()):
                    if i >= 0:
                        assert i not in seen, f"val sample {i} twice"
                        seen[i] = (parts[j], int(labels[j]))
    bird, cat, dog, fish = range(4)
    want = [("a", cat)] * 3 + [("a", dog)] * 3 + [("b", bird)] * 3 + [("b", fish)] * 2
    assert [seen[i] for i in sorted(seen)] == want


def test_an_elastic_resume_to_three_ranks_trains_through_batch_mixer(server):
    """A state saved at 2 ranks after one step, resumed at 3: the rest of the epoch (16 samples)
    in rounds of 12, the last padded (label -100); each rank's loop mixes every batch with
    `BatchMixer` (docs/transforms.md) and steps, a batch of padding only included."""
    with _loader(server, rank=0, world_size=2) as first:
        _read(first, 4, stop=1)
        state = first.state_dict()
    mixer_real, padding = Counter(), 0
    for rank in range(3):
        loader = RemoteLoader(
            server.endpoint, "train", rank=rank, world_size=3, device="cpu", with_indices=True,
            prefetch_next_epoch=False, timeout=60,
        )  # fmt: skip
        mixer = BatchMixer(num_classes=loader.num_classes, seed=0, rank=rank)
        with loader:
            loader.load_state_dict(state)
            loader.set_epoch(4)
            for k, (images, labels, indices) in enumerate(loader):
                mixed, targets = mixer(images, labels, epoch=4, batch_index=k)
                real = labels != -100
                assert torch.allclose(targets[real].sum(1), torch.ones(int(real.sum())))
                assert not targets[~real].any() and torch.equal(mixed[~real], images[~real])
                mixer_real.update(indices[real].tolist())
                padding += int((~real).sum())
    assert sum(mixer_real.values()) == 16 and padding == 8
