"""pipeline.sources: every source kind opens as the same ImageDataset as the ImageFolder it was
made from (names, labels, classes, bytes), kinds are told apart by what the path is, and bad
input is a clear error naming file and line, or a skipped, named sample."""

from __future__ import annotations

import csv
import io
import json
import logging
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from batchwire.pipeline.dataset import ImageDataset, open_dataset
from batchwire.pipeline.sources import expand_braces, parquet, source_kind, tarindex
from batchwire.pipeline.sources.labels import LabelError, LabelTable, parse_label
from batchwire.pipeline.storage.errors import ObjectChanged
from batchwire.pipeline.synthetic import default_dataset


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A 40-image ImageFolder (4 per class of the embedded dataset)."""
    root = tmp_path_factory.mktemp("folder") / "images"
    src = default_dataset().val_root
    for cls in sorted(p for p in src.iterdir() if p.is_dir()):
        (root / cls.name).mkdir(parents=True)
        for f in sorted(cls.iterdir())[:4]:
            shutil.copyfile(f, root / cls.name / f.name)
    return root


@pytest.fixture(scope="module")
def ref(folder) -> ImageDataset:
    return open_dataset(folder, verify_checksums="off")


def _add(t: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    t.addfile(info, io.BytesIO(data))


def write_tar(path: Path, samples: list[tuple[str, list[tuple[str, bytes]]]], fmt=None) -> Path:
    with tarfile.open(path, "w", format=fmt or tarfile.USTAR_FORMAT) as t:
        for key, members in samples:
            for ext, data in members:
                _add(t, f"{key}.{ext}" if ext else key, data)
    return path


def shard_samples(ds: ImageDataset, idx, label="cls") -> list:
    out = []
    for i in idx:
        lab = (
            str(int(ds.labels[i])).encode()
            if label == "cls"
            else json.dumps({"label": ds.classes[ds.labels[i]]}).encode()
        )
        out.append((f"s{i:05d}", [("jpg", ds.read_bytes(i)), (label, lab)]))
    return out


def write_parquet(path: Path, ds: ImageDataset, idx, *, names=True, rows=8) -> Path:
    table = pa.table(
        {
            "image": [{"bytes": ds.read_bytes(i), "path": Path(ds.paths[i]).name} for i in idx],
            "label": pa.array([int(ds.labels[i]) for i in idx], pa.int64()),
        }
    )
    if names:
        features = {
            "image": {"_type": "Image"},
            "label": {"_type": "ClassLabel", "names": ds.classes},
        }
        table = table.replace_schema_metadata(
            {"huggingface": json.dumps({"info": {"features": features}})}
        )
    pq.write_table(table, path, row_group_size=rows)
    return path


def assert_same(got: ImageDataset, ref: ImageDataset) -> None:
    assert len(got) == len(ref)
    assert got.classes == ref.classes
    assert (got.labels == ref.labels).all()
    for i in range(len(ref)):
        assert got.read_bytes(i) == ref.read_bytes(i), i


# --------------------------------------------------------------------------- kinds


def test_kinds_are_told_by_what_the_path_is(tmp_path, folder, ref):
    tar = write_tar(tmp_path / "a.tar", shard_samples(ref, range(3)))
    no_suffix = tmp_path / "shard"
    shutil.copyfile(tar, no_suffix)
    write_parquet(tmp_path / "p.parquet", ref, range(3))
    shutil.copyfile(tmp_path / "p.parquet", tmp_path / "p.bin")
    (tmp_path / "l.txt").write_text(f"{ref.paths[0]} 0\n")
    (tmp_path / "c.txt").write_text(f"path,label\n{ref.paths[0]},0\n")
    (tmp_path / "j.txt").write_text(json.dumps({"path": ref.paths[0], "label": 0}) + "\n")
    (tmp_path / "shards.txt").write_text("a.tar\n")
    assert source_kind(folder) == "folder"
    assert source_kind(tar) == "tar"
    assert source_kind(no_suffix) == "tar"  # ustar magic
    assert source_kind(tmp_path / "p.bin") == "parquet"  # PAR1
    assert source_kind(tmp_path / "l.txt") == "list"
    assert source_kind(tmp_path / "c.txt") == "csv"
    assert source_kind(tmp_path / "j.txt") == "jsonl"
    assert source_kind(tmp_path / "shards.txt") == "tar"
    flat = tmp_path / "flat"
    flat.mkdir()
    shutil.copyfile(tar, flat / "x-0.tar")
    assert source_kind(flat) == "tar"
    with pytest.raises(FileNotFoundError):
        source_kind(tmp_path / "missing")


def test_brace_patterns():
    assert expand_braces("d/t-{000..002}.tar") == ["d/t-000.tar", "d/t-001.tar", "d/t-002.tar"]
    assert expand_braces("s3://b/{a,b}-{0..1}.tar") == [
        "s3://b/a-0.tar",
        "s3://b/a-1.tar",
        "s3://b/b-0.tar",
        "s3://b/b-1.tar",
    ]
    assert expand_braces("plain.tar") == ["plain.tar"]
    for bad in ("a{1..}.tar", "a{3..1}.tar", "a{0..99999999}.tar", "a{.tar", "a{{0..1}}.tar"):
        with pytest.raises(ValueError):
            expand_braces(bad)


def test_labels():
    assert (
        parse_label("7", "w") == 7
        and parse_label(3, "w") == 3
        and parse_label(" tench ", "w") == "tench"
    )
    for bad in (-1, "-2", 1 << 40, "99999999999", True, None, 1.5, "", "x" * 300):
        with pytest.raises(LabelError):
            parse_label(bad, "here")
    with pytest.raises(LabelError, match="a list of labels where one label is expected"):
        parse_label([1, 2], "here")
    t = LabelTable()
    for name in ("b", "a", "b", "c"):
        t.add(name, "w")
    ids, classes = t.resolve()
    assert classes == ["a", "b", "c"] and ids.tolist() == [1, 0, 1, 2]
    with pytest.raises(LabelError, match=r"f\.csv:9: integer label 3"):
        t.add(3, "f.csv:9")


# --------------------------------------------------------------------------- manifests


def test_csv_with_class_names_is_the_image_folder(tmp_path, folder, ref):
    path = folder.parent / "names.csv"
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["filename", "class", "note"])
        for p, lab in zip(ref.paths, ref.labels, strict=True):
            w.writerow([str(Path(p).relative_to(folder.parent)), ref.classes[lab], "meta, quoted"])
    got = open_dataset(path)
    assert got.kind == "csv" and got.paths == ref.paths
    assert_same(got, ref)


def test_csv_without_header_ids_and_tsv(tmp_path, folder, ref):
    """Today's `path,label` CSV (once: "expected 'path label'") and integer labels."""
    path = folder.parent / "ids.csv"
    path.write_text("".join(f"{p},{lab}\n" for p, lab in zip(ref.paths, ref.labels, strict=True)))
    got = open_dataset(path, allow_outside_root=True)
    assert got.classes == [str(c) for c in range(10)] and (got.labels == ref.labels).all()
    txt = folder.parent / "ids-named.txt"  # a CSV under another name: sniffed
    shutil.copyfile(path, txt)
    assert open_dataset(txt, allow_outside_root=True).kind == "csv"
    tsv = folder.parent / "ids.tsv"
    tsv.write_text(
        "path\tlabel\n"
        + "".join(
            f"{Path(p).relative_to(folder.parent)}\t{lab}\n"
            for p, lab in zip(ref.paths, ref.labels, strict=True)
        )
    )
    assert (open_dataset(tsv).labels == ref.labels).all()


def test_list_file_of_class_names(folder, ref):
    """`path classname` lines (once "label must be an integer, got 'tench'"): names become ids."""
    path = folder.parent / "names.txt"
    path.write_text(
        "# a list file labelled by names\n"
        + "".join(
            f"{Path(p).relative_to(folder.parent)} {ref.classes[lab]}\n"
            for p, lab in zip(ref.paths, ref.labels, strict=True)
        )
    )
    got = open_dataset(path)
    assert got.kind == "list" and got.paths == ref.paths
    assert_same(got, ref)


def test_jsonl(folder, ref):
    path = folder.parent / "m.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {"path": str(Path(p).relative_to(folder.parent)), "label": ref.classes[lab], "w": 3}
            )
            + "\n"
            for p, lab in zip(ref.paths, ref.labels, strict=True)
        )
    )
    assert_same(open_dataset(path), ref)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("path,label\na.jpg\n", r"m.csv:2: expected a path and a label"),
        (
            "path,label\na.jpg,tench\nb.jpg,3\n",
            r"m.csv:3: integer label 3 in a dataset labelled by class names",
        ),
        ("path,label\na.jpg,-1\n", r"m.csv:2: label must be 0 to 4194303, got -1"),
        ("file,note\na.jpg,x\n", r"m.csv:1: header .* needs a path column"),
        ("a.jpg,1\n../up.jpg,2\n", r"m.csv:2: '../up.jpg' is outside the manifest's folder"),
        ("path,label\n,3\n", r"m.csv:2: empty path"),
        ("path,label\n", r"m.csv: names no images"),
        ('path,label\n"a.jpg,1\n', r"m.csv:\d+: "),
    ],
)
def test_csv_errors_name_file_and_line(tmp_path, text, needle):
    path = tmp_path / "m.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=needle):
        open_dataset(path)


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("{not json", "m.jsonl:2: not JSON"),
        ("[1, 2]", "m.jsonl:2: expected a JSON object"),
        ('{"path": "a.jpg"}', "m.jsonl:2: needs a path"),
        ('{"path": "a.jpg", "label": [1, "b"]}', "m.jsonl:2: class name 'b' in a dataset"),
        ('{"path": "a.jpg", "label": []}', "m.jsonl:2: empty list of labels"),
        ('{"path": 3, "label": 1}', "m.jsonl:2: needs a path"),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path, line, needle):
    path = tmp_path / "m.jsonl"
    path.write_text('{"path": "ok.jpg", "label": 1}\n' + line + "\n")
    with pytest.raises(ValueError, match=needle):
        open_dataset(path)


def test_manifest_not_utf8(tmp_path):
    path = tmp_path / "m.csv"
    path.write_bytes(b"path,label\n\xff\xfe.jpg,1\n")
    with pytest.raises(ValueError, match=r"m\.csv: not UTF-8"):
        open_dataset(path)


# --------------------------------------------------------------------------- tar shards


def test_tar_shards_are_the_image_folder(tmp_path, ref, caplog):
    for k in range(3):  # 14 + 13 + 13 samples, in index order
        idx = range(k * 14, min(40, (k + 1) * 14))
        write_tar(tmp_path / f"train-{k:02d}.tar", shard_samples(ref, idx))
    (tmp_path / "classes.txt").write_text("\n".join(ref.classes) + "\n")
    cache = tmp_path / "cache"
    with caplog.at_level(logging.INFO, "batchwire.pipeline"):
        got = open_dataset(str(tmp_path / "train-{00..02}.tar"), cache, verify_checksums="off")
    assert "3 indexed now, 0 from the index cache" in caplog.text
    assert got.kind == "tar" and got.paths[0].endswith("train-00.tar:s00000.jpg")
    assert_same(got, ref)
    caplog.clear()
    with caplog.at_level(logging.INFO, "batchwire.pipeline"):
        again = open_dataset([str(tmp_path / f"train-{k:02d}.tar") for k in range(3)], cache)
    assert "0 indexed now, 3 from the index cache" in caplog.text
    assert (again.labels == got.labels).all()
    # A changed shard is indexed again (its version is in the cache key).
    write_tar(tmp_path / "train-02.tar", shard_samples(ref, range(28, 35)))
    caplog.clear()
    with caplog.at_level(logging.INFO, "batchwire.pipeline"):
        changed = open_dataset(str(tmp_path / "train-{00..02}.tar"), cache)
    assert "1 indexed now, 2 from the index cache" in caplog.text and len(changed) == 35


def test_tar_json_labels_long_names(tmp_path, ref):
    """`.json` labels by class name, and names beyond ustar's 100 bytes (GNU and pax)."""
    for fmt, name in ((tarfile.GNU_FORMAT, "gnu"), (tarfile.PAX_FORMAT, "pax")):
        samples = [(f"{'d' * 120}/{key}", m) for key, m in shard_samples(ref, range(40), "json")]
        got = open_dataset(write_tar(tmp_path / f"{name}.tar", samples, fmt), tmp_path / "c")
        assert_same(got, ref)
        assert len(got.paths[0]) > 120


def test_tar_faults_are_skipped_and_named_once(tmp_path, ref, caplog, monkeypatch):
    jpg = ref.read_bytes(0)
    samples = [
        ("ok0", [("jpg", jpg), ("cls", b"1")]),
        ("noext", [("", b"x")]),
        ("ok1", [("jpg", jpg), ("cls", b"2")]),
        ("dup", [("jpg", jpg), ("jpg", jpg), ("cls", b"1")]),
        ("textonly", [("txt", b"hello"), ("cls", b"1")]),
        ("nolabel", [("jpg", jpg)]),
        ("badlabel", [("jpg", jpg), ("cls", b"-5")]),
        ("big", [("png", b"\x89PNG" + b"\0" * (len(jpg) + 200)), ("cls", b"1")]),
        ("ok0", [("jpg", jpg), ("cls", b"3")]),  # the key again, later
        ("notimage", [("jpg", b"not a jpeg at all"), ("cls", b"0")]),
        ("cut", [("cls", b"0"), ("jpg", jpg)]),
    ]
    path = write_tar(tmp_path / "bad.tar", samples)
    cut = path.read_bytes()
    # Cut the last member's data short (and drop the end-of-archive blocks).
    path.write_bytes(cut[: cut.rfind(jpg[:512]) + 1000])
    monkeypatch.setattr(tarindex, "MAX_MEMBER_BYTES", len(jpg) + 100)
    with caplog.at_level(logging.WARNING, "batchwire.pipeline"):
        got = open_dataset(path, tmp_path / "cache")
    names = [p.rsplit(":", 1)[1] for p in got.paths]
    assert names == ["ok0.jpg", "ok1.jpg", "notimage.jpg"] and got.labels.tolist() == [1, 2, 0]
    text = caplog.text
    for needle in (
        "member 'noext' has no extension",
        "dup: duplicate key: .jpg twice",
        "textonly: no image member (.txt, .cls",
        "nolabel: no .cls or .json label",
        f"big.png: {len(jpg) + 204} bytes, over the {len(jpg) + 100} byte cap",
        "badlabel.cls: label must be 0 to",
        "ok0: duplicate key (members not consecutive",
        "(truncated tar)",
    ):
        assert text.count(needle) == 1, (needle, text)
    assert "skipped: 9 problems in 1 shards" in text


def test_tar_mixed_label_kinds_are_an_error(tmp_path, ref):
    jpg = ref.read_bytes(0)
    path = write_tar(
        tmp_path / "m.tar",
        [
            ("a", [("jpg", jpg), ("cls", b"1")]),
            ("b", [("jpg", jpg), ("json", b'{"label": "tench"}')]),
        ],
    )
    with pytest.raises(
        ValueError, match=r"m.tar:b: class name 'tench' in a dataset labelled by integers"
    ):
        open_dataset(path, tmp_path / "c")


def test_tar_member_changed_after_indexing_is_the_samples_fault(tmp_path, ref):
    path = write_tar(tmp_path / "s.tar", shard_samples(ref, range(4)))
    got = open_dataset(path, tmp_path / "c")
    path.write_bytes(path.read_bytes()[:2048])
    with pytest.raises(ObjectChanged) as info:  # cut since indexed: it changed
        got.read_bytes(3)
    assert info.value.errno is None  # not transient: a bad sample, replaced


def test_tar_without_usable_samples(tmp_path):
    path = write_tar(tmp_path / "e.tar", [("a", [("txt", b"x")])])
    with pytest.raises(ValueError, match="no usable samples in 1 shards"):
        open_dataset(path, tmp_path / "c")


# --------------------------------------------------------------------------- parquet


def test_parquet_is_the_image_folder(tmp_path, ref):
    write_parquet(tmp_path / "train-0.parquet", ref, range(25), rows=8)
    write_parquet(tmp_path / "train-1.parquet", ref, range(25, 40), rows=8)
    got = open_dataset(tmp_path)
    assert got.kind == "parquet" and got.paths[0].endswith("train-0.parquet#0")
    assert_same(got, ref)
    order = np.random.default_rng(0).permutation(40)
    assert all(got.read_bytes(int(i)) == ref.read_bytes(int(i)) for i in order)
    cache = got.reader.cache
    assert cache.misses == 6 and cache.hits > 0  # 4 + 2 row groups, each read once


def test_parquet_without_features_and_small_cache(tmp_path, ref, monkeypatch):
    got = open_dataset(write_parquet(tmp_path / "p.parquet", ref, range(40), names=False, rows=4))
    assert got.classes == [str(c) for c in range(10)] and (got.labels == ref.labels).all()
    monkeypatch.setattr(parquet, "MAX_MEMBER_BYTES", len(ref.read_bytes(39)) - 1)
    with pytest.raises(OSError, match="byte cap"):
        got.read_bytes(39)
    monkeypatch.undo()
    got.reader.cache.max_bytes = 1  # keeps one row group
    assert all(got.read_bytes(i) == ref.read_bytes(i) for i in (0, 39, 1, 38))
    assert len(got.reader.cache._items) == 1


def test_parquet_bad_files_name_the_file(tmp_path, ref):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1" + b"\0" * 100)
    with pytest.raises(ValueError, match=r"bad\.parquet: not a readable Parquet file"):
        open_dataset(bad)
    pq.write_table(pa.table({"x": [1, 2]}), tmp_path / "nocol.parquet")
    with pytest.raises(ValueError, match=r"nocol\.parquet: no image column"):
        open_dataset(tmp_path / "nocol.parquet")
    t = pa.table({"image": [{"bytes": b"x", "path": "a"}], "name": ["a"]})
    pq.write_table(t, tmp_path / "nolabel.parquet")
    with pytest.raises(ValueError, match=r"nolabel\.parquet: no integer label column"):
        open_dataset(tmp_path / "nolabel.parquet")
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    t = pa.table({"image": pa.array([{"bytes": None, "path": "a.jpg"}], image), "label": [0]})
    pq.write_table(t, tmp_path / "pathonly.parquet")
    with pytest.raises(FileNotFoundError, match="path-only image"):
        open_dataset(tmp_path / "pathonly.parquet").read_bytes(0)


def test_tar_read_many_coalesces_per_shard(tmp_path, ref):
    for k in range(2):
        write_tar(tmp_path / f"t-{k}.tar", shard_samples(ref, range(k * 20, (k + 1) * 20)))
    got = open_dataset(str(tmp_path / "t-{0..1}.tar"), tmp_path / "c")
    idx = [39, 0, 21, 5, 5, 20]
    assert got.reader.read_many(idx) == [ref.read_bytes(i) for i in idx]
    (tmp_path / "t-1.tar").write_bytes((tmp_path / "t-1.tar").read_bytes()[:4096])
    many = got.reader.read_many(idx)
    assert isinstance(many[0], ObjectChanged) and many[1] == ref.read_bytes(0)


def test_local_loader_on_shards_equals_the_folder(tmp_path, folder, ref):
    from batchwire.pipeline.local import LocalLoader

    write_tar(tmp_path / "all.tar", shard_samples(ref, range(40)))
    (tmp_path / "classes.txt").write_text("\n".join(ref.classes))
    out = []
    for data in (folder, tmp_path / "all.tar"):
        loader = LocalLoader(data, batch_size=8, image_size=32, seed=3, with_indices=True)
        try:
            loader.set_epoch(1)
            out.append([tuple(t.clone() for t in b) for b in loader])
            assert loader.classes == ref.classes and loader.class_to_idx["circle"] == 1
        finally:
            loader.close()
    for a, b in zip(*out, strict=True):
        for x, y in zip(a, b, strict=True):
            assert (x == y).all()


# --------------------------------------------------------------------------- shard folders


def test_shard_sets_split_names_by_the_prefix_before_the_shard_number():
    from batchwire.pipeline.sources.shardsets import shard_sets

    def sets(names):
        return [(s.prefix, s.pattern, len(s.names)) for s in shard_sets(names)]

    split = [f"train-{k:06d}.tar" for k in range(10)] + ["val-000000.tar", "val-000001.tar"]
    assert sets(split) == [
        ("train-", "train-{000000..000009}.tar", 10),
        ("val-", "val-{000000..000001}.tar", 2),
    ]
    # One prefix each: digits inside the prefix, a constant "of N" after the number, no
    # padding, per-class names, a single shard, one name without a number.
    assert sets([f"imagenet1k-train-{k:04d}.tar" for k in range(3)]) == [
        ("imagenet1k-train-", "imagenet1k-train-{0000..0002}.tar", 3)
    ]
    assert sets([f"train-{k:05d}-of-00004.tar" for k in range(4)]) == [
        ("train-", "train-{00000..00003}-of-00004.tar", 4)
    ]
    assert sets([f"shard-{k}.tar" for k in range(12)]) == [("shard-", "shard-{0..11}.tar", 12)]
    assert sets(["n01440764.tar", "n01443537.tar"]) == [("n", None, 2)]  # not a range
    assert sets(["train-000000.tar"]) == [("train-", "train-000000.tar", 1)]
    assert sets(["all.tar"]) == [("all.tar", "all.tar", 1)]
    # Two prefixes that differ only in a digit, and a name without a number beside numbered ones.
    assert [s.prefix for s in shard_sets(["cc3m-000.tar", "cc3m-001.tar", "cc12m-000.tar"])] == [
        "cc12m-",
        "cc3m-",
    ]
    assert len(shard_sets(["train-0.tar", "train-1.tar", "extra.tar"])) == 2


def test_folder_of_two_prefixes_is_refused_naming_each_prefix_pattern(tmp_path, ref):
    shards = tmp_path / "shards"
    shards.mkdir()
    for k in range(2):
        write_tar(shards / f"train-{k:02d}.tar", shard_samples(ref, range(k * 15, k * 15 + 15)))
    write_tar(shards / "val-00.tar", shard_samples(ref, range(30, 40)))
    cache = tmp_path / "cache"
    with pytest.raises(ValueError) as refused:
        open_dataset(shards, cache, verify_checksums="off")
    text = str(refused.value)
    assert "holds shards of 2 prefixes" in text, text
    assert "train-* (2 shards: train-00.tar .. train-01.tar); val-* (1 shard: val-00.tar)" in text
    assert f"'{shards}/train-{{00..01}}.tar' or '{shards}/val-00.tar'" in text
    # The pattern it names serves that prefix alone; one naming both serves both, as named.
    train = open_dataset(str(shards / "train-{00..01}.tar"), cache, verify_checksums="off")
    assert len(train) == 30 and not any(":s0003" in p for p in train.paths)
    assert len(open_dataset(str(shards / "{train,val}-00.tar"), cache)) == 25
    # A folder of one prefix is served as before.
    (shards / "val-00.tar").unlink()
    assert len(open_dataset(shards, cache, verify_checksums="off")) == 30


@pytest.mark.parametrize("name", ["train-02.tar.gz", "train-02.tgz", "train-02.TAR.ZST"])
def test_compressed_tar_in_a_shard_folder_is_refused(tmp_path, ref, name):
    import gzip
    import re

    shards = tmp_path / "shards"
    shards.mkdir()
    for k in range(3):
        write_tar(shards / f"train-{k:02d}.tar", shard_samples(ref, range(k * 10, k * 10 + 10)))
    packed = shards / "train-02.tar"
    (shards / name).write_bytes(gzip.compress(packed.read_bytes()))
    packed.unlink()
    with pytest.raises(ValueError, match=rf"shards: {re.escape(name)}: compressed tars are not"):
        open_dataset(shards, tmp_path / "cache", verify_checksums="off")


def test_a_folder_of_only_compressed_tars_is_named_as_such(tmp_path, ref):
    """Not taken for an ImageFolder ("no class folders"): the error names the compressed tar."""
    import gzip

    shards = tmp_path / "shards"
    shards.mkdir()
    write_tar(tmp_path / "train-00.tar", shard_samples(ref, range(10)))
    packed = gzip.compress((tmp_path / "train-00.tar").read_bytes())
    (shards / "train-00.tar.gz").write_bytes(packed)
    with pytest.raises(ValueError, match=r"train-00\.tar\.gz: compressed tars are not"):
        open_dataset(shards, tmp_path / "cache", verify_checksums="off")
