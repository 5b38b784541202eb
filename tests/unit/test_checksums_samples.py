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
from batchwire.prepare.run import Options, run
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
    write_shards(str(folder), str(out), total // 3, jobs=1)  # the real or the synthetic photos
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
    report = tmp_path / "report.json"
    assert sums(str(path), "--manifest-dir", str(dirs), "--report", str(report)) == 0
    doc = json.loads(report.read_text())
    assert doc["samples"] == doc["intact"] == 8 and doc["exit_status"] == 0
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


def records(folder: Path) -> dict[str, dict]:
    lines = (folder / CHECKSUMS_MANIFEST).read_text().splitlines()
    return {r["path"]: r for r in map(json.loads, lines) if "path" in r}


def test_shards_come_with_checksums_and_inherit_intact(folder: Path, tmp_path: Path) -> None:
    """`--shards` records every member it writes (what `--checksums-only` would, offsets and
    shard sizes included); a member is intact when SRC's manifest said so (a prepared tree),
    not otherwise; a SRC file damaged since its manifest is not copied on."""
    plain = tmp_path / "plain"
    write_shards(str(folder), str(plain), 64 << 10, jobs=1)
    written = records(plain)
    assert len(written) == 8 and not any(r["intact"] for r in written.values())
    assert sums(str(plain)) == 0  # the same records, judged afresh (all intact)
    judged = records(plain)
    assert written.keys() == judged.keys()
    for key, r in written.items():
        assert {**r, "intact": True} == {k: v for k, v in judged[key].items() if k != "outcome"}
    ds = open_dataset(plain, verify_checksums="on")
    assert ds.checksums is not None and ds.checksums.count == 8

    prepared = tmp_path / "prepared"
    run(Options(src=str(folder), dst=str(prepared), jobs=1, quiet=True))
    victim = sorted(prepared.rglob("*.jpg"))[3]
    damage(victim, victim.stat().st_size // 2)
    out = tmp_path / "from-prepared"
    summary = write_shards(str(prepared), str(out), 64 << 10, jobs=1)
    assert summary.samples == 7 and summary.exit_status == 3
    assert "checksum mismatch" in summary.text() and victim.name in summary.text()
    got = records(out)
    assert len(got) == 7 and all(r["intact"] for r in got.values())
    ds = open_dataset(out, verify_checksums="on")
    assert all(ds.checksum_verdict(i, ds.read_bytes(i)).intact for i in range(len(ds)))


def test_dataset_root_keeps_urls() -> None:
    from batchwire.pipeline.dataset import ImageDataset, dataset_root

    assert dataset_root("s3://bucket/a/b.tar") == "s3://bucket/a/b.tar"
    assert dataset_root("/data/x") == Path("/data/x")
    ds = ImageDataset(["s3://b/k.jpg"], [0], ["c"], root="s3://b")  # type: ignore[arg-type]
    assert ds.root == "s3://b" and "'s3://b'" in repr(ds)
