"""Multi-label manifests served by a real `pipeline-server` (issue 21): a CSV labelled by lists
of class names and a JSON-lines one by lists of ids, both with metadata columns / keys. What
`RemoteLoader` yields: labels int64 [B, K], each row the manifest's labels of the sample its
index names (ids of the sorted names, then -1), and with_metadata=True the manifest's other
columns / keys of that sample; every sample once an epoch, a padded val slot's row all -100 and
its metadata None, a mid-epoch resume exact; a bad manifest ends the server with exit 2 naming the
file and line. Single-label manifests are unchanged ([B], no new wire field):
test_sources_identity.py and test_multilabel.py's message tests."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from batchwire.client import RemoteLoader, multi_hot
from batchwire.pipeline.synthetic import default_dataset
from serverproc import free_tcp_endpoint, running_server

seaweed = pytest.importorskip("objectstore", reason="needs tests/objectstore.py").seaweed

BIN = Path(sys.executable).parent
N = 44  # images: 5 train batches of 8 (4 dropped); val over 3 ranks pads 4 slots
NAMES = ["apple", "bird", "car", "dog", "egg"]


def _labels_of(k: int) -> list[int]:
    """Sample k's label ids (1 to 4 of them, written in this order)."""
    return [(k + 2 * j) % 5 for j in range(1 + k % 4)]


@pytest.fixture(scope="module")
def manifests(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("multilabel")
    src = sorted(p for d in sorted(default_dataset().val_root.iterdir()) for p in d.iterdir())
    (root / "img").mkdir()
    for k in range(N):
        shutil.copyfile(src[k * 7 % len(src)], root / "img" / f"{k:03d}.jpg")
    with (root / "names.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["path", "label", "site", "weight"])
        for k in range(N):
            w.writerow(
                [f"img/{k:03d}.jpg", "|".join(NAMES[i] for i in _labels_of(k)), f"s{k % 3}", k]
            )
    with (root / "ids.jsonl").open("w") as f:
        for k in range(N):
            f.write(
                json.dumps(
                    {"path": f"img/{k:03d}.jpg", "label": _labels_of(k), "id": k, "ok": k % 2 == 0}
                )
                + "\n"
            )
    return {"csv": root / "names.csv", "jsonl": root / "ids.jsonl"}


def _args(manifest: Path | str) -> tuple[str, ...]:
    return (
        "--train", str(manifest), "--val", str(manifest), "--batch-size", "8",
        "--image-size", "32", "--output-dtype", "uint8", "--workers", "1", "--seed", "3",
    )  # fmt: skip


def _want_row(k: int, width: int) -> list[int]:
    ids = _labels_of(k)
    return ids + [-1] * (width - len(ids))


def _batches(loader) -> list[tuple]:
    return [tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in b) for b in loader]


def _meta_of(kind: str, k: int) -> dict:
    """Sample k's metadata as the manifest writes it (a CSV cell is its text)."""
    return {"site": f"s{k % 3}", "weight": str(k)} if kind == "csv" else {"id": k, "ok": k % 2 == 0}


def _check(batches, width: int, kind: str) -> list[int]:
    seen = []
    for _, labels, indices, metadata in batches:
        assert labels.dtype == torch.int64 and labels.shape == (len(indices), width)
        assert isinstance(metadata, list) and len(metadata) == len(indices)
        for row, i, meta in zip(labels.tolist(), indices.tolist(), metadata, strict=True):
            if i == -1:
                assert row == [-100] * width and meta is None  # a padded val slot
            else:
                assert row == _want_row(i, width), (i, row)
                assert meta == _meta_of(kind, i), (i, meta)
                seen.append(i)
    return seen


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["csv", "jsonl"])
def test_multilabel_rows_epoch_exact_and_resume(manifests, kind):
    with running_server(*_args(manifests[kind])) as srv:
        loader = RemoteLoader(
            srv.endpoint, "train", rank=0, world_size=1, device="cpu", with_indices=True,
            with_metadata=True, timeout=60,
        )  # fmt: skip
        try:
            assert loader.classes == (NAMES if kind == "csv" else [str(i) for i in range(5)])
            epoch0 = _batches(loader)
            seen = _check(epoch0, 4, kind)
            assert len(epoch0) == N // 8 and len(seen) == len(set(seen)) == N // 8 * 8
            loader.set_epoch(1)
            epoch1 = _batches(loader)
            assert _check(epoch1, 4, kind) != seen  # another shuffle, the same rows
            # mid-epoch resume of epoch 0 at batch 2: the very same batches
            state = loader.state_dict()
            loader.load_state_dict({**state, "epoch": 0, "next_batch": 2})
            resumed = _batches(loader)
            assert len(resumed) == len(epoch0) - 2
            for a, b in zip(resumed, epoch0[2:], strict=True):
                assert all(torch.equal(x, y) for x, y in zip(a[:3], b[:3], strict=True))
                assert a[3] == b[3]
            hot = multi_hot(epoch0[0][1], len(loader.classes))
            assert hot.sum(1).tolist() == [len(set(_labels_of(i))) for i in epoch0[0][2].tolist()]
        finally:
            loader.close()
        padded = 0
        for rank in range(3):
            val = RemoteLoader(
                srv.endpoint, "val", rank=rank, world_size=3, device="cpu", with_indices=True,
                with_metadata=True, timeout=60,
            )  # fmt: skip
            try:
                batches = _batches(val)
            finally:
                val.close()
            got = _check(batches, 4, kind)
            padded += sum(int((b[2] == -1).sum()) for b in batches)
            assert len(got) == len(set(got))
        assert padded == 48 - N
        # Without with_metadata: (images, labels) as ever, and no metadata in the headers.
        plain = RemoteLoader(srv.endpoint, "train", world_size=1, rank=0, device="cpu", timeout=60)
        try:
            first = next(iter(plain))
            assert len(first) == 2 and first[1].shape == (8, 4)
        finally:
            plain.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("suffix", "line", "needle"),
    [
        (".jsonl", '{"path": "img/001.jpg", "label": []}', "bad.jsonl:2: empty list of labels"),
        (".jsonl", '{"path": "img/001.jpg", "label": [1, 0.5]}', "bad.jsonl:2: label 1: label"),
        (
            ".jsonl",
            '{"path": "img/001.jpg", "label": 1, "m": {"x": 1}}',
            "bad.jsonl:2: metadata 'm'",
        ),
        (".csv", 'img/001.jpg,"[1, 2"', "bad.csv:3: label list is not a JSON array"),
        (".csv", "img/001.jpg,|".join(["", ""]) + "1", "bad.csv:3:"),
    ],
)
def test_bad_multilabel_manifest_exits_2_naming_file_and_line(manifests, suffix, line, needle):
    root = manifests["csv"].parent
    bad = root / f"bad{suffix}"
    first = (
        '{"path": "img/000.jpg", "label": [1]}'
        if suffix == ".jsonl"
        else "path,label\nimg/000.jpg,1"
    )
    bad.write_text(first + "\n" + line + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run(
        [str(BIN / "pipeline-server"), "--train", str(bad), "--bind", free_tcp_endpoint(),
         "--workers", "1", "--batch-size", "1", "--image-size", "32"],
        env={**env, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, timeout=100,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout
    assert needle in done.stdout, done.stdout


@pytest.mark.timeout(180)
def test_multilabel_manifest_in_a_bucket(manifests, seaweed):
    """The JSON-lines manifest and its images in an S3 bucket (SeaweedFS): the same rows and
    metadata, by index."""
    root = manifests["jsonl"].parent
    seaweed.upload_folder(root / "img", "multilabel", "data/img")
    seaweed.put("multilabel", "data/ids.jsonl", manifests["jsonl"].read_bytes())
    with running_server(*_args("s3://multilabel/data/ids.jsonl"), env=seaweed.env()) as srv:
        loader = RemoteLoader(
            srv.endpoint, "train", rank=0, world_size=1, device="cpu", with_indices=True,
            with_metadata=True, timeout=60,
        )  # fmt: skip
        try:
            batches = _batches(loader)
        finally:
            loader.close()
    assert len(_check(batches, 4, "jsonl")) == N // 8 * 8
