"""Multi-label samples and per-sample metadata of CSV / JSON-lines manifests (issue 21): the
parsers (lists of ids or names, metadata columns and keys), their bounds as clear errors naming
file and line, the [B, K] labels of a batch (padded slots all PADDING_LABEL) through the labels
frame and the welcome / header fields (absent for single-label streams), and `multi_hot`."""

from __future__ import annotations

import csv
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from batchwire import wire
from batchwire.client import multi_hot
from batchwire.pipeline.dataset import ImageDataset, open_dataset
from batchwire.pipeline.sources.labels import (
    MAX_LABELS_PER_SAMPLE,
    LabelError,
    LabelTable,
    parse_labels,
)
from batchwire.pipeline.sources.metadata import (
    MAX_SAMPLE_METADATA_BYTES,
    MetadataError,
    PackedMetadata,
    check_batch_metadata,
    check_metadata,
)
from batchwire.pipeline.synthetic import default_dataset

NAMES = ["cat", "dog", "fish", "owl"]


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("ml")
    src = sorted(p for d in sorted(default_dataset().val_root.iterdir()) for p in d.iterdir())
    out = []
    for k, f in enumerate(src[:12]):
        shutil.copyfile(f, root / f"img{k}.jpg")
        out.append(str(root / f"img{k}.jpg"))
    return out


def _rows(n: int) -> list[list[str]]:
    """Sample k's class names: 1 to 3 of NAMES, deterministic."""
    return [[NAMES[(k + j) % 4] for j in range(1 + k % 3)] for k in range(n)]


def test_parse_labels():
    assert parse_labels("3", "w") == 3 and parse_labels("tench", "w") == "tench"
    assert parse_labels([1, "2"], "w") == [1, 2]
    assert parse_labels("a|b| c", "w") == ["a", "b", "c"]
    assert parse_labels('["a", "b"]', "w") == ["a", "b"]
    assert parse_labels("[4]", "w") == [4]
    for bad, needle in (
        ([], "empty list"),
        ("[]", "empty list"),
        ([1.5], "label 0: label must be an integer"),
        ([[1]], "a list of labels where one"),
        ("a||b", "empty label"),
        ("[1, 2", "not a JSON array"),
        (list(range(MAX_LABELS_PER_SAMPLE + 1)), "more than the 1024"),
        ([True], "label must be an integer"),
        ([-1], "label must be 0 to"),
    ):
        with pytest.raises(LabelError, match=needle):
            parse_labels(bad, "f.csv:7")


def test_label_table_rows():
    t = LabelTable()
    t.add(["dog", "cat"], "w")
    t.add("owl", "w")
    t.add(["cat", "dog", "owl"], "w")
    first, rows, classes = t.resolve_rows()
    assert classes == ["cat", "dog", "owl"]
    assert rows.tolist() == [[1, 0, -1], [2, -1, -1], [0, 1, 2]]
    assert first.tolist() == [1, 2, 0]
    single = LabelTable()
    single.add(3, "w")
    single.add(1, "w")
    ids, none, classes = single.resolve_rows()
    assert none is None and ids.tolist() == [3, 1] and classes == ["0", "1", "2", "3"]


def test_csv_multilabel_names_and_metadata(images):
    root = Path(images[0]).parent
    path = root / "ml.csv"
    rows = _rows(len(images))
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["path", "labels_ignored", "label", "site", "score"])
        for k, p in enumerate(images):
            w.writerow([Path(p).name, "x", "|".join(rows[k]), f"site{k % 2}", str(k * 0.5)])
    ds = open_dataset(path, verify_checksums="off")
    assert ds.classes == sorted(NAMES) and ds.label_width == 3
    for k in range(len(images)):
        want = [NAMES.index(n) for n in rows[k]]  # NAMES is sorted: names give ids
        assert ds.label_rows[k].tolist() == want + [-1] * (3 - len(want))
        assert ds.labels[k] == want[0]
        assert ds.metadata[k] == {
            "labels_ignored": "x",
            "site": f"site{k % 2}",
            "score": str(k * 0.5),
        }
    counts = ds.class_counts()
    assert counts.sum() == sum(len(r) for r in rows)


def test_jsonl_multilabel_ids_and_metadata(images):
    root = Path(images[0]).parent
    path = root / "ml.jsonl"
    lines = []
    for k, p in enumerate(images):
        doc = {"path": Path(p).name, "label": [k % 5, (k + 2) % 5][: 1 + k % 2]}
        doc.update({"id": k, "ok": k % 2 == 0, "w": k / 4, "note": None if k % 3 else "n"})
        lines.append(json.dumps(doc))
    path.write_text("\n".join(lines) + "\n")
    ds = open_dataset(path, verify_checksums="off")
    assert ds.label_width == 2 and ds.classes == ["0", "1", "2", "3", "4"]
    for k in range(len(images)):
        doc = json.loads(lines[k])
        assert ds.label_rows[k].tolist() == doc["label"] + [-1] * (2 - len(doc["label"]))
        assert ds.metadata[k] == {key: doc[key] for key in ("id", "ok", "w", "note")}


def test_single_label_manifest_unchanged(images):
    root = Path(images[0]).parent
    path = root / "single.csv"
    path.write_text(
        "path,label\n" + "".join(f"{Path(p).name},{k % 3}\n" for k, p in enumerate(images))
    )
    ds = open_dataset(path, verify_checksums="off")
    assert ds.label_rows is None and ds.label_width == 0 and ds.metadata is None
    labels = np.array([1, 2, -100], dtype=np.int64)
    same = ds.batch_labels(np.array([1, 2, 0]), labels, np.array([True, True, False]))
    assert same is labels


@pytest.mark.parametrize(
    ("suffix", "line", "needle"),
    [
        (".jsonl", '{"path": "a.jpg", "label": []}', r"m.jsonl:2: empty list of labels"),
        (".jsonl", '{"path": "a.jpg", "label": [1, 2.5]}', r"m.jsonl:2: label 1: label must be"),
        (".jsonl", '{"path": "a.jpg", "label": [1, "x"]}', r"m.jsonl:2: class name 'x'"),
        (
            ".jsonl",
            json.dumps({"path": "a.jpg", "label": list(range(1100))}),
            r"m.jsonl:2: 1100 labels",
        ),
        (
            ".jsonl",
            '{"path": "a.jpg", "label": 1, "m": {"a": 1}}',
            r"m.jsonl:2: metadata 'm' is a dict",
        ),
        (".jsonl", '{"path": "a.jpg", "label": 1, "m": [1]}', r"m.jsonl:2: metadata 'm' is a list"),
        (
            ".jsonl",
            '{"path": "a.jpg", "label": 1, "m": "%s"}' % ("x" * 5000),
            r"m.jsonl:2: metadata of \d+ bytes, more than the 4096",
        ),
        (".csv", "a.jpg,[]", r"m.csv:3: empty list of labels"),
        (".csv", 'a.jpg,"[1, 2"', r"m.csv:3: label list is not a JSON array"),
        (".csv", "a.jpg,1|x", r"m.csv:3: class name 'x'"),
        (".csv", "a.jpg,1|", r"m.csv:3: .*empty label"),
    ],
)
def test_bad_multilabel_and_metadata_name_file_and_line(tmp_path, suffix, line, needle):
    path = tmp_path / f"m{suffix}"
    first = '{"path": "ok.jpg", "label": 1}' if suffix == ".jsonl" else "path,label\nok.jpg,1"
    path.write_text(first + "\n" + line + "\n")
    with pytest.raises(ValueError, match=needle):
        open_dataset(path, verify_checksums="off")


def test_metadata_bounds():
    assert check_metadata({"a": 1, "b": None, "c": 1.5, "d": True, "e": "x"}, "w")
    for bad in ({"a": float("nan")}, {"a": 1 << 70}, {"": 1}, {"a": b"x"}, {"a": "x" * 5000}):
        with pytest.raises(MetadataError, match=r"^w: "):
            check_metadata(bad, "w")
    big = [{"s": "x" * (MAX_SAMPLE_METADATA_BYTES - 20)}] * 2000
    check_batch_metadata(big, 100, "w")
    with pytest.raises(MetadataError, match="a batch of 2000 could carry"):
        check_batch_metadata(big, 2000, "w")
    packed = PackedMetadata(big)  # what datasets keep: the same sizes, the same dicts back
    assert packed[7] == big[7] and len(packed) == 2000
    check_batch_metadata(packed, 100, "w")
    with pytest.raises(MetadataError, match="a batch of 2000 could carry"):
        check_batch_metadata(packed, 2000, "w")


def test_batch_labels_pad_rows_with_padding_label():
    ds = ImageDataset(
        paths=["a", "b", "c"],
        labels=np.array([2, 0, 1]),
        classes=["x", "y", "z"],
        root=Path("/"),
        label_rows=np.array([[2, 1], [0, -1], [1, -1]]),
    )
    labels = np.array([0, 1, wire.PADDING_LABEL], dtype=np.int64)
    got = ds.batch_labels(np.array([1, 2, 0]), labels, np.array([True, True, False]))
    assert got.tolist() == [[0, -1], [1, -1], [wire.PADDING_LABEL] * 2]
    assert ds.label_rows.tolist() == [[2, 1], [0, -1], [1, -1]]  # not written through


def test_labels_frame_and_messages():
    rows = np.array([[3, 1, -1], [-100, -100, -100]], dtype=np.int64)
    frame = wire.labels_to_frame(rows).tobytes()
    assert len(frame) == 48
    assert wire.labels_from_frame(frame, 2, width=3).tolist() == rows.tolist()
    out = np.empty(6, dtype=np.int64)
    wire.labels_from_frame(frame, 2, out=out, width=3)
    assert out.reshape(2, 3).tolist() == rows.tolist()
    with pytest.raises(wire.ProtocolError):
        wire.labels_from_frame(frame, 2)  # a [B] reader of a [B, 3] frame
    w = dict(
        session=1,
        num_batches=2,
        num_samples=8,
        batch_size=4,
        shape=[4, 3, 8, 8],
        dtype="uint8",
        layout="nchw",
        mean=[0.0] * 3,
        std=[1.0] * 3,
        num_classes=3,
    )
    single = wire.Welcome(**w)
    assert "label_width" not in single.to_map()  # old peers see what they know
    multi = wire.Welcome(**w, label_width=3)
    back = wire.Welcome.from_map(wire.unpack_frame(multi.pack(), 1 << 20))
    assert back.label_width == 3
    with pytest.raises(wire.ProtocolError, match="label_width"):
        wire.Welcome.from_map({**multi.to_map(), "label_width": 5000})
    h = dict(
        session=1,
        split="val",
        epoch=0,
        batch_index=0,
        shape=[2, 3, 8, 8],
        dtype="uint8",
        layout="nchw",
        indices=[0, -1],
        nbytes=2 * 3 * 64,
    )
    assert "label_width" not in wire.BatchHeader(**h).to_map()
    assert wire.BatchHeader(**h).labels_nbytes == 16
    hm = wire.BatchHeader.from_map(wire.BatchHeader(**h, label_width=3).to_map())
    assert hm.label_width == 3 and hm.labels_nbytes == 48


def test_multi_hot():
    labels = torch.tensor([[2, 0, -1], [1, -1, -1], [-100, -100, -100]])
    got = multi_hot(labels, 4)
    assert got.tolist() == [[1, 0, 1, 0], [0, 1, 0, 0], [0, 0, 0, 0]]
    assert got.dtype == torch.float32 and got.is_contiguous()
    assert multi_hot(torch.tensor([3, 0]), 4, dtype=torch.uint8).tolist() == [
        [0, 0, 0, 1],
        [1, 0, 0, 0],
    ]
    with pytest.raises(ValueError, match="not below num_classes"):
        multi_hot(labels, 2)


def _mutated(rng: random.Random) -> object:
    pieces = ["1", "a", "|", "[", "]", ",", '"', " ", "-1", "1e9", "\x00", "null", "{", "}", ":"]
    if rng.random() < 0.3:
        return rng.randbytes(rng.randint(0, 40)).decode("latin-1")
    return "".join(rng.choice(pieces) for _ in range(rng.randint(0, 20)))


def test_labels_and_metadata_parsers_survive_any_input(tmp_path):
    rng = random.Random(21)
    for _ in range(2000):
        value = _mutated(rng)
        try:
            got = parse_labels(value, "f:1")
        except LabelError as exc:
            assert str(exc).startswith("f:1"), exc
        else:
            assert isinstance(got, (int, str, list))
        try:
            check_metadata({"k": value, _mutated(rng) or "x": value}, "f:2")
        except MetadataError as exc:
            assert str(exc).startswith("f:2"), exc
    for round_ in range(150):  # whole manifests with random label and metadata fields
        k = round_ % 2
        path = tmp_path / f"m{round_}.{'jsonl' if k else 'csv'}"
        if k:
            body = "".join(
                f'{{"path": "a.jpg", "label": {_mutated(rng)}, "m": {_mutated(rng)}}}\n'
                for _ in range(3)
            )
        else:
            body = "path,label,m\n" + "".join(
                f"a.jpg,{_mutated(rng)},{_mutated(rng)}\n" for _ in range(3)
            )
        path.write_text(body, encoding="utf-8")
        try:
            ds = open_dataset(path, verify_checksums="off")
        except ValueError as exc:
            assert path.name in str(exc), exc
            continue
        assert len(ds) >= 1 and (ds.labels >= 0).all()


def test_metadata_messages():
    hello = wire.Hello(split="train", rank=0, world_size=1, epoch=0, batches=(0,), session=1)
    assert "metadata" not in hello.to_map()  # not asked: the map older servers know
    asked = wire.Hello.from_map(
        wire.Hello(
            split="train", rank=0, world_size=1, epoch=0, batches=(0,), session=1, metadata=True
        ).to_map()
    )
    assert asked.metadata is True
    h = dict(
        session=1, split="val", epoch=0, batch_index=0, shape=[2, 3, 8, 8], dtype="uint8",
        layout="nchw", indices=[0, -1], nbytes=2 * 3 * 64,
    )  # fmt: skip
    assert "metadata" not in wire.BatchHeader(**h).to_map()
    rows = [{"a": 1, "b": None, "c": "x", "d": 1.5, "e": True}, None]
    packed = wire.BatchHeader(**h, metadata=rows).pack()
    back = wire.BatchHeader.from_map(wire.unpack_frame(packed, wire.MAX_SERVER_FRAME_BYTES))
    assert back.metadata == rows
    for bad in ([{"a": 1}], [{"a": [1]}, None], "x", [1, None]):
        with pytest.raises(wire.ProtocolError, match="metadata"):
            wire.BatchHeader.from_map({**wire.BatchHeader(**h).to_map(), "metadata": bad})


class _Noop:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def __getattr__(self, name):
        return lambda *a, **k: None


@pytest.mark.parametrize("width", [0, 3])
def test_stagers_yield_b_or_b_by_k_labels(monkeypatch, width):
    """The CPU stager (frames) and the CUDA stager (its pinned-slot path, driven on the CPU
    with torch.cuda's streams and events as no-ops) give [B] or [B, K] labels, as sent."""
    import contextlib

    from batchwire.client.staging import BatchFormat, CpuStager, CudaStager

    for name in ("Stream", "Event"):
        monkeypatch.setattr(torch.cuda, name, _Noop)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: _Noop())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    b = 2
    spec = wire.BatchSpec(b, 4, 5, "uint8", "nchw")
    header = wire.BatchHeader(
        1, "val", 0, 0, spec.shape, "uint8", "nchw", [3, -1], 0, spec.nbytes, label_width=width
    )
    labels = np.array([[4, 1, -1], [wire.PADDING_LABEL] * 3])
    if not width:
        labels = labels[:, 0]
    frame = wire.labels_to_frame(labels).tobytes()
    images = bytes(range(spec.nbytes))

    class Frame:
        def __init__(self, data: bytes) -> None:
            self.buffer = memoryview(bytearray(data))

    fmt = BatchFormat(spec, False, torch.float32, (0.5,) * 3, (0.25,) * 3, label_width=width)
    cpu = CpuStager(fmt, 2).stage_frames(header, Frame(images), Frame(frame))
    assert cpu.labels.tolist() == labels.tolist()
    stager = CudaStager(fmt, torch.device("cpu"), 2)
    for _ in range(3):  # slots reused
        slot = stager.acquire(header)
        slot.images_buffer(header.nbytes)[:] = images
        slot.labels_buffer(header.labels_nbytes // 8)[:] = frame
        staged = stager.stage(slot, header)
        assert staged.labels.tolist() == labels.tolist()
        assert bytes(staged.images.flatten().numpy()) == images
        stager.discard(staged)
    early = stager.stage_frames(header, Frame(images), Frame(frame))  # arrived ahead
    assert early.labels.tolist() == labels.tolist()


def test_local_loader_yields_multilabel_rows(images):
    """LocalLoader (the same producer in-process): [B, K] rows of the manifest by index, val
    padding rows all PADDING_LABEL."""
    from batchwire.pipeline.local import LocalLoader

    root = Path(images[0]).parent
    path = root / "local.jsonl"
    want = {k: [k % 4, (k + 1) % 4][: 1 + k % 2] for k in range(len(images))}
    path.write_text(
        "".join(
            json.dumps({"path": Path(p).name, "label": want[k]}) + "\n"
            for k, p in enumerate(images)
        )
    )
    for split, world in (("train", 1), ("val", 5)):
        loader = LocalLoader(
            str(path), split=split, batch_size=3, image_size=16, world_size=world,
            with_indices=True, threads=1, output_dtype="uint8", verify_checksums="off",
        )  # fmt: skip
        try:
            seen = []
            for _, labels, indices in loader:
                assert labels.shape == (3, 2)
                for row, i in zip(labels.tolist(), indices.tolist(), strict=True):
                    if i < 0:
                        assert row == [wire.PADDING_LABEL] * 2
                    else:
                        assert row == want[i] + [-1] * (2 - len(want[i]))
                        seen.append(i)
            assert len(seen) == len(set(seen)) > 0
        finally:
            loader.close()


def test_local_loader_yields_metadata_by_index(images):
    """LocalLoader(with_metadata=True): each slot's dict is its sample's manifest row (the
    other keys), None for val padding; as the server's headers (one `batch_metadata`)."""
    from batchwire.pipeline.local import LocalLoader

    root = Path(images[0]).parent
    path = root / "meta.jsonl"
    rows = [{"path": Path(p).name, "label": k % 2, "id": f"s{k}", "w": k / 2} for k, p in
            enumerate(images)]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for split, world in (("train", 1), ("val", 5)):
        loader = LocalLoader(
            str(path), split=split, batch_size=3, image_size=16, world_size=world,
            with_indices=True, with_metadata=True, threads=1, output_dtype="uint8",
            verify_checksums="off",
        )  # fmt: skip
        try:
            seen = 0
            for _, _, indices, metadata in loader:
                assert len(metadata) == 3
                for i, meta in zip(indices.tolist(), metadata, strict=True):
                    if i < 0:
                        assert meta is None
                    else:
                        assert meta == {"id": f"s{i}", "w": i / 2}
                        seen += 1
            assert seen > 0
        finally:
            loader.close()
