"""Audit of multi-view crops over a mixture with separate label spaces, served by a real
`pipeline-server` (docs/transforms.md "Multi-view", docs/mixtures.md "Labels"):

- a part's labels stay in its own space (`;labels=separate`): part b's classes x, y, z are 0, 1,
  2 whatever part a holds, and `loader.num_classes` is the largest part's count;
- the views of one sample come from the same image (val: the two 32 px views are the same centre
  crop, pixel for pixel) and differ in train (each its own crop);
- a mid-epoch resume at 2 ranks yields the same views, pixel for pixel.
"""

from __future__ import annotations

import os

import pytest
import torch
from batchwire.client import RemoteLoader
from jpegchecks import SAMPLE_DIR
from serverproc import running_server

SAMPLE = SAMPLE_DIR


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    files = sorted(SAMPLE.glob("*.JPEG"))[:16]
    if len(files) < 16:
        pytest.skip(f"{SAMPLE} holds too few JPEGs")
    tmp = tmp_path_factory.mktemp("mixviews")
    layout = {"a/cat": files[0:4], "a/dog": files[4:8], "b/x": files[8:11], "b/y": files[11:13]}
    layout["b/z"] = files[13:16]
    for folder, picked in layout.items():
        (tmp / folder).mkdir(parents=True)
        for f in picked:
            os.symlink(f, tmp / folder / f.name)
    mix = f"mix:a=1@{tmp / 'a'},b=1@{tmp / 'b'};labels=separate"
    args = (
        "--train", mix, "--val", mix, "--views", "2x32:0.3-1.0,1x16:0.1-0.3",
        "--batch-size", "4", "--image-size", "32", "--workers", "1", "--seed", "4",
    )  # fmt: skip
    with running_server(*args) as srv:
        yield srv


def _loader(srv, split: str = "train", **kw) -> RemoteLoader:
    return RemoteLoader(
        srv.endpoint, split, device="cpu", with_indices=True, with_metadata=True,
        normalize_on_device=False, prefetch_next_epoch=False, timeout=60, **kw,
    )  # fmt: skip


def _epoch(loader: RemoteLoader, epoch: int, stop: int | None = None) -> list[tuple]:
    loader.set_epoch(epoch)
    out = []
    for views, labels, indices, metadata in loader:
        parts = [None if m is None else m["part"] for m in metadata]
        out.append(([v.clone() for v in views], labels.clone(), indices.clone(), parts))
        if len(out) == stop:
            break
    return out


def test_separate_labels_and_the_views_of_one_image(server):
    with _loader(server, "val") as val:
        assert val.num_classes == 3 and val.classes == ["0", "1", "2"]
        got = {}
        for views, labels, indices, parts in _epoch(val, 0):
            assert [tuple(v.shape[1:]) for v in views] == [(3, 32, 32)] * 2 + [(3, 16, 16)]
            for j, i in enumerate(indices.tolist()):
                if i >= 0:
                    got[i] = (parts[j], int(labels[j]))
                    assert torch.equal(views[0][j], views[1][j]), f"val sample {i}: two images"
    want = [("a", 0)] * 4 + [("a", 1)] * 4 + [("b", 0)] * 3 + [("b", 1)] * 2 + [("b", 2)] * 3
    assert [got[i] for i in sorted(got)] == want
    with _loader(server) as train:
        for views, labels, _, parts in _epoch(train, 0):
            for j, part in enumerate(parts):
                assert not torch.equal(views[0][j], views[1][j]), "two train views, one crop"
                assert 0 <= int(labels[j]) < (2 if part == "a" else 3)


def test_a_resumed_rank_gets_the_same_views(server):
    with _loader(server, rank=1, world_size=2) as whole:
        want = _epoch(whole, 1)
    with _loader(server, rank=1, world_size=2) as first:
        _epoch(first, 1, stop=1)
        state = first.state_dict()
    with _loader(server, rank=1, world_size=2) as again:
        again.load_state_dict(state)
        rest = _epoch(again, 1)
    assert len(rest) == len(want) - 1 >= 1
    for (vx, lx, ix, px), (vy, ly, iy, py) in zip(rest, want[1:], strict=True):
        assert torch.equal(ix, iy) and torch.equal(lx, ly) and px == py
        assert all(torch.equal(x, y) for x, y in zip(vx, vy, strict=True))
