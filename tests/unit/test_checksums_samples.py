"""Checksum manifests per sample (pipeline/checksums.py `SampleKeys`, prepare/samplesums.py):
tar shards and Parquet files get records "SHARD:MEMBER" / "FILE#ROW" over the image bytes as
read, found beside the data or in a --checksum-dir folder; a damaged member or row is a
mismatch, a shard rewritten since (another size, members moved) has its records dropped, and
the intact verdict of a sound JPEG reaches the sample loader."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from batchwire.pipeline.checksums import CHECKSUMS_MANIFEST, ChecksumManifestError, keyed_name
from batchwire.pipeline.dataset import open_dataset
from batchwire.prepare.cli import main as prepare_main
from batchwire.prepare.shards import write_shards
from bitflips import photos


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    root = tmp_path / "src"
    for rel, data in photos(8).items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


@pytest.fixture
def shards(folder: Path, tmp_path: Path) -> Path:
    out = tmp_path / "shards"
    total = sum(p.stat().st_size for p in folder.rglob("*.jpg"))
    write_shards(str(folder), str(out), max(64 << 10, total // 3), jobs=1)
    assert len(list(out.glob("train-*.tar"))) >= 2
    return out


def sums(*args: str) -> int:
    return prepare_main(["--checksums-only", *args, "--quiet", "--jobs", "1"])


def damage(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def test_tar_members_checked_and_a_damaged_one_caught(shards: Path, folder: Path) -> None:
    assert sums(str(shards)) == 0
    records = [json.loads(x) for x in (shards / CHECKSUMS_MANIFEST).read_text().splitlines() if x]
    named = [r for r in records if "path" in r]
    assert named[0]["path"] == "train-000000.tar:000000000.jpg"
    assert all(r["intact"] and r["object_size"] > 0 and r["offset"] > 0 for r in named)
    ds = open_dataset(shards, verify_checksums="on")
    assert ds.checksums is not None and ds.checksums.count == len(ds) == 8
    for i in range(len(ds)):
        verdict = ds.checksum_verdict(i, ds.read_bytes(i))
        assert verdict.problem is None and verdict.intact, i
    reader = ds.reader
    shard = shards / reader.located.keys[int(reader.shard_of[5])]
    damage(shard, int(reader.offsets[5]) + int(reader.sizes[5]) // 2)  # in place: same size
    again = open_dataset(shards, verify_checksums="on")
    problems = [again.checksum_problem(i, again.read_bytes(i)) for i in range(len(again))]
    assert [i for i, p in enumerate(problems) if p] == [5]
    assert "checksum mismatch" in str(problems[5])


def test_a_rewritten_shard_drops_its_records(shards: Path, folder: Path, caplog) -> None:
    assert sums(str(shards)) == 0
    first = shards / "train-000000.tar"
    before = open_dataset(shards, verify_checksums="off")
    in_first = int((before.reader.shard_of == 0).sum())
    first.write_bytes(first.read_bytes() + b"\0" * 10240)  # another size: rewritten
    with caplog.at_level(logging.WARNING, logger="batchwire.pipeline"):
        ds = open_dataset(shards, verify_checksums="auto")
    assert ds.checksums is not None and ds.checksums.count == len(ds) - in_first
    assert "train-000000.tar changed since its checksums were recorded" in caplog.text
    assert all(ds.checksum_problem(i, ds.read_bytes(i)) is None for i in range(len(ds)))


def test_parquet_rows_and_a_checksum_dir(folder: Path, tmp_path: Path) -> None:
    ds0 = open_dataset(folder, verify_checksums="off")
    images = [ds0.read_bytes(i) for i in range(len(ds0))]
    pdir = tmp_path / "pq"
    pdir.mkdir()
    path = pdir / "train.parquet"
    table = pa.table(
        {
            "image": [{"bytes": b, "path": None} for b in images],
            "label": pa.array(ds0.labels.tolist(), pa.int64()),
        }
    )
    pq.write_table(table, path, row_group_size=3, compression="none")
    dirs = tmp_path / "sums"
    assert sums(str(path), "--manifest-dir", str(dirs)) == 0
    assert (dirs / keyed_name(str(pdir))).is_file() and not (pdir / CHECKSUMS_MANIFEST).exists()
    with pytest.raises(ChecksumManifestError):
        open_dataset(path, verify_checksums="on")  # not told where the manifest is
    ds = open_dataset(path, verify_checksums="on", checksum_dirs=[dirs])
    assert ds.checksums is not None and ds.checksums.count == len(ds)
    raw = path.read_bytes()
    at = raw.index(images[4][1000:1032]) + 8  # row 4's image bytes, stored uncompressed
    damage(path, at)
    ds = open_dataset(path, verify_checksums="on", checksum_dirs=[dirs])
    bad = [i for i in range(len(ds)) if ds.checksum_problem(i, ds.read_bytes(i))]
    assert bad == [4]
