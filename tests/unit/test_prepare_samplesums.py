"""prepare/samplesums.py in-process on real tar shards of real JPEGs: one record per sample
("SHARD:MEMBER", the member's offset, the shard's size) whose checksum is XXH3-64 of the member's
bytes (recomputed here with xxhash from tarfile's own reading), the strict decode's verdict
(a damaged JPEG listed as corrupt, exit 1; a member that is no JPEG neither), other samples'
records kept and a manifest's bad rows dropped, --manifest-dir under its keyed name, usage
errors for what cannot run, and a manifest that is replaced whole or not at all."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import pytest
import xxhash
from batchwire.pipeline.checksums import CHECKSUMS_MANIFEST, keyed_name
from batchwire.pipeline.storage import LocalStore
from batchwire.pipeline.synthetic import default_dataset
from batchwire.prepare.samplesums import (
    SampleSumsSummary,
    checksum_samples,
    previous_records,
    write_checksum_manifest,
)
from batchwire.prepare.source import UsageError

SAMPLE = Path(__file__).resolve().parents[3] / "shared" / "imagenet-sample"


def jpegs(n: int) -> list[bytes]:
    """n real JPEGs: the ImageNet sample read in place, else the embedded dataset's."""
    if SAMPLE.is_dir():
        paths = sorted(SAMPLE.iterdir())[:n]
    else:
        paths = sorted(Path(default_dataset().train_root).rglob("*.jpg"))[:n]
    return [p.read_bytes() for p in paths]


def write_tar(path: Path, samples: list[tuple[str, bytes]]) -> None:
    """A webdataset shard: KEY.jpg and KEY.cls per sample."""
    with tarfile.open(path, "w") as tar:
        for i, (key, data) in enumerate(samples):
            for name, payload in ((f"{key}.jpg", data), (f"{key}.cls", str(i % 2).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))


def members(shard: Path) -> dict[str, tuple[int, bytes]]:
    """member name -> (data offset, bytes), as tarfile reads them (an independent reader)."""
    with tarfile.open(shard) as tar:
        return {
            m.name: (m.offset_data, tar.extractfile(m).read())  # type: ignore[union-attr]
            for m in tar.getmembers()
            if m.name.endswith(".jpg")
        }


def manifest(folder: Path, name: str = CHECKSUMS_MANIFEST) -> list[dict]:
    return [json.loads(line) for line in (folder / name).read_text().splitlines()]


@pytest.fixture
def shards(tmp_path: Path) -> Path:
    real = jpegs(3)
    folder = tmp_path / "shards"
    folder.mkdir()
    write_tar(folder / "train-000000.tar", [("a", real[0]), ("sp ace ünï", real[1])])
    write_tar(
        folder / "train-000001.tar",
        [("cut", real[2][: len(real[2]) // 2]), ("empty", b""), ("text", b"not a jpeg")],
    )
    return folder


def test_every_member_checksummed_as_tarfile_reads_it(shards: Path, tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    s = checksum_samples(str(shards), jobs=2, report=str(report))
    lines = manifest(shards)
    assert lines[0] == {"source": f"tar:{shards}"} and lines[-1] == {"finished": True}
    records = {r["path"]: r for r in lines[1:-1]}
    expected = {}
    for shard in sorted(shards.glob("*.tar")):
        for name, (offset, data) in members(shard).items():
            expected[f"{shard.name}:{name}"] = (offset, data, shard.stat().st_size)
    assert list(records) == list(expected)  # in dataset order, each once
    for key, (offset, data, shard_size) in expected.items():
        r = records[key]
        assert r["checksum"] == "xxh3_64:" + xxhash.xxh3_64_hexdigest(data), key
        assert (r["size"], r["offset"], r["object_size"]) == (len(data), offset, shard_size)
        assert r["outcome"] == "checksummed"
    intact = {k for k, r in records.items() if r["intact"]}
    assert intact == {"train-000000.tar:a.jpg", "train-000000.tar:sp ace ünï.jpg"}
    assert (s.samples, s.intact, s.kept, s.unreadable) == (5, 2, 0, [])
    # named as the dataset names the sample; not "empty" nor "text" (no JPEG: no verdict)
    assert [name for name, _ in s.corrupt] == [f"{shards}/train-000001.tar:cut.jpg"]
    assert s.exit_status == 1
    assert "5 samples" in s.text() and "train-000001.tar:cut.jpg: not intact" in s.text()
    doc = json.loads(report.read_text())
    assert doc["exit_status"] == 1 and doc["samples"] == 5 and doc["intact"] == 2


def test_other_samples_records_kept_and_bad_rows_dropped(shards: Path) -> None:
    other = {"path": "val-000000.tar:v.jpg", "size": 3, "checksum": "xxh3_64:0123456789abcdef"}
    stale = {"path": "train-000000.tar:a.jpg", "size": 1, "checksum": "xxh3_64:ffffffffffffffff"}
    rows = [
        json.dumps({"source": "tar:elsewhere"}),
        json.dumps(other),
        json.dumps(stale),
        "not json at all",
        "[1, 2, 3]",
        json.dumps({"path": 5, "checksum": "x"}),
        json.dumps({"path": "no-checksum.jpg"}),
        '{"path": "cut short',
    ]
    (shards / CHECKSUMS_MANIFEST).write_text("\n".join(rows))
    s = checksum_samples(str(shards), jobs=1)
    assert s.kept == 1
    lines = manifest(shards)
    by_path = {r["path"]: r for r in lines if "path" in r}
    assert by_path["val-000000.tar:v.jpg"] == other
    assert by_path["train-000000.tar:a.jpg"]["checksum"] != stale["checksum"]
    assert len(by_path) == 6 and lines[-1] == {"finished": True}
    again = checksum_samples(str(shards), jobs=1)  # a rerun: the same manifest, no growth
    assert again.kept == 1 and manifest(shards)[1:] == lines[1:]


def test_previous_records_keeps_only_checksummed_rows() -> None:
    text = (
        "\n".join(
            [
                '{"path": "a", "checksum": "xxh3_64:00"}',
                '{"path": "a", "checksum": "xxh3_64:01"}',  # the last one wins
                '{"path": "b"}',
                '{"path": null, "checksum": "c"}',
                '"just a string"',
                "{broken",
                '{"source": "tar:x"}',
                '{"finished": true}',
            ]
        ).encode()
        + b'\n{"path": "odd \xff name", "checksum": "xxh3_64:02"}\n'
    )
    got = previous_records(text)
    assert list(got) == ["a", "odd \udcff name"]
    assert json.loads(got["a"])["checksum"] == "xxh3_64:01"


def test_manifest_dir_gets_the_keyed_name(shards: Path, tmp_path: Path) -> None:
    sums = tmp_path / "sums" / "nested"
    s = checksum_samples(str(shards), manifest_dir=str(sums), jobs=1)
    name = keyed_name(str(shards))
    assert s.manifest == str(sums / name)
    assert not (shards / CHECKSUMS_MANIFEST).exists()
    assert len([r for r in manifest(sums, name) if "path" in r]) == 5
    checksum_samples(str(shards), manifest_dir=str(sums), jobs=1)
    assert sorted(os.listdir(sums)) == [name]  # rerun: replaced, no temporaries left


def test_what_cannot_run_is_a_usage_error(shards: Path, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="inside SRC's folder"):
        checksum_samples(str(shards), manifest_dir=str(shards / "sums"))
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(UsageError, match="cannot create --manifest-dir"):
        checksum_samples(str(shards), manifest_dir=str(tmp_path / "a_file" / "sub"))
    with pytest.raises(UsageError, match=r"^SRC .*missing"):
        checksum_samples(str(tmp_path / "missing"))
    with pytest.raises(UsageError, match="--checksums-only takes"):
        checksum_samples(default_dataset().train_root)  # a local folder: pipeline-prepare's
    with pytest.raises(UsageError, match="cannot write --report"):
        checksum_samples(str(shards), report=str(tmp_path / "no" / "such" / "r.json"))
    assert not (tmp_path / "sums").exists()


def test_a_manifest_is_replaced_whole_or_not_at_all(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    old = b'{"source":"tar:x"}\n{"finished":true}\n'
    (tmp_path / CHECKSUMS_MANIFEST).write_bytes(old)
    spool = tmp_path / "spool"
    with open(spool, "wb") as unreadable, pytest.raises(OSError):
        write_checksum_manifest(store, CHECKSUMS_MANIFEST, "tar:y", [], unreadable)
    assert (tmp_path / CHECKSUMS_MANIFEST).read_bytes() == old
    assert sorted(os.listdir(tmp_path)) == [CHECKSUMS_MANIFEST, "spool"]  # no temporary left
    spool.write_bytes(b'{"path":"s.tar:1.jpg","checksum":"xxh3_64:00"}\n')
    with open(spool, "rb") as records:
        write_checksum_manifest(store, CHECKSUMS_MANIFEST, "tar:y", ['{"path":"k"}'], records)
    assert manifest(tmp_path) == [
        {"source": "tar:y"},
        {"path": "k"},
        {"path": "s.tar:1.jpg", "checksum": "xxh3_64:00"},
        {"finished": True},
    ]


def test_summary_text_and_exit_status() -> None:
    s = SampleSumsSummary("s3://bucket/shards", "m.jsonl", samples=30, intact=5)
    assert s.exit_status == 0
    s.corrupt = [(f"x.tar:{i}", "not intact: bad") for i in range(25)]
    assert s.exit_status == 1
    text = s.text()
    assert "  corrupt: x.tar:19: not intact: bad" in text and "x.tar:20" not in text
    assert "  ... 5 more corrupt samples" in text
    s.unreadable = [("y.tar:0", "Input/output error")]
    assert s.exit_status == 3 and "  unreadable: y.tar:0: Input/output error" in s.text()
