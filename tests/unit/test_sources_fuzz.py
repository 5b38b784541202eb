"""Fuzzed bytes for every parser of pipeline.sources never crash or hang: tar headers (the
member listing and sample grouping), manifest lines (CSV, JSON lines), Parquet metadata. Each
either opens (then reads or fails per sample with an OSError, a bad sample) or raises a
ValueError / FileNotFoundError naming the file: the errors a server turns into a clear exit."""

from __future__ import annotations

import contextlib
import io
import random
import tarfile
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from batchwire.pipeline.dataset import open_dataset
from batchwire.pipeline.sources.tarheaders import list_members
from batchwire.pipeline.sources.tarindex import group_samples

ROUNDS = 300
JPEG = b"\xff\xd8\xff\xe0" + bytes(range(256)) * 4 + b"\xff\xd9"


def _tar(fmt: int) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as t:
        for k in range(4):
            for ext, data in (("jpg", JPEG), ("cls", str(k).encode()), ("json", b'{"label": 1}')):
                info = tarfile.TarInfo(f"{'long' * 30 if k == 2 else 'd'}/s{k}.{ext}")
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 12)):
        kind = rng.random()
        pos = rng.randrange(len(b))
        if kind < 0.6:
            b[pos] = rng.randrange(256)
        elif kind < 0.8:
            del b[pos : pos + rng.randint(1, 600)]
        else:
            b[pos:pos] = rng.randbytes(rng.randint(1, 600))
        if not b:
            b = bytearray(b"\0")
    return bytes(b)


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_tar_header_parser_survives_any_bytes(fmt):
    rng = random.Random(fmt)
    clean = _tar(fmt)
    started = time.monotonic()
    for round_ in range(ROUNDS):
        data = _mutate(rng, clean) if round_ % 5 else rng.randbytes(rng.randint(0, 4096))
        if round_ % 7 == 0:  # a random header checksum made right: the fields get parsed
            data = bytearray(data[:512].ljust(512, b"\0")) + data[512:]
            data[148:156] = b"        "
            data[148:156] = f"{sum(data[:512]):06o}\0 ".encode()
            data = bytes(data)

        def read_at(offset: int, n: int, data: bytes = data) -> bytes:
            return data[offset : offset + n]

        listing = list_members(read_at, len(data))
        for m in listing.members:
            assert m.offset >= 0 and m.offset + m.size <= len(data)
        index = group_samples(listing, read_at, "fuzz.tar")
        assert len(index.keys) == len(index.offsets) == len(index.label_text)
    assert time.monotonic() - started < 30


def test_tar_files_survive_any_bytes(tmp_path):
    rng = random.Random(7)
    clean = _tar(tarfile.GNU_FORMAT)
    for round_ in range(60):
        path = tmp_path / f"f{round_}.tar"
        path.write_bytes(_mutate(rng, clean))
        try:
            ds = open_dataset(path, tmp_path / "cache", verify_checksums="off")
        except ValueError:
            continue
        for i in range(len(ds)):
            ds.read_bytes(i)  # within the shard: never raises


def _manifest_lines(rng: random.Random, jsonl: bool) -> str:
    pieces = [
        "a.jpg",
        "tench",
        "3",
        "-1",
        ",",
        '"',
        "\n",
        "{",
        "}",
        "[1,2]",
        "path",
        "label",
        "\t",
        "../x.jpg",
        "/abs.jpg",
        "\x00",
        "é",
        " ",
        ":",
        "null",
        "true",
        '{"path": "a.jpg", "label": 2}',
    ]
    base = '{"path": "a.jpg", "label": 1}\n' if jsonl else "path,label\na.jpg,1\n"
    extra = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
    return base + extra


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_manifest_parsers_survive_any_lines(tmp_path, suffix):
    rng = random.Random(suffix)
    for round_ in range(ROUNDS):
        path = tmp_path / f"m{round_}{suffix}"
        if round_ % 10 == 0:
            path.write_bytes(rng.randbytes(rng.randint(0, 300)))
        else:
            path.write_text(_manifest_lines(rng, suffix == ".jsonl"), encoding="utf-8")
        try:
            ds = open_dataset(path, verify_checksums="off")
        except ValueError as exc:
            assert path.name in str(exc), exc  # names the file (and the line)
            continue
        assert len(ds) >= 1 and (ds.labels >= 0).all()


def test_parquet_metadata_survives_any_bytes(tmp_path):
    table = pa.table(
        {
            "image": [{"bytes": JPEG, "path": f"{i}.jpg"} for i in range(12)],
            "label": pa.array(list(range(12)), pa.int64()),
        }
    )
    clean_path = tmp_path / "clean.parquet"
    pq.write_table(table, clean_path, row_group_size=4)
    clean = clean_path.read_bytes()
    rng = random.Random(3)
    started = time.monotonic()
    for round_ in range(ROUNDS):
        # Mostly the footer (metadata, its length, the magic), sometimes anywhere.
        b = bytearray(clean)
        lo = 0 if round_ % 4 == 0 else max(0, len(b) - 1200)
        for _ in range(rng.randint(1, 6)):
            b[rng.randrange(lo, len(b))] = rng.randrange(256)
        path = tmp_path / f"p{round_}.parquet"
        path.write_bytes(bytes(b))
        try:
            ds = open_dataset(path, verify_checksums="off")
        except (ValueError, FileNotFoundError) as exc:
            assert path.name in str(exc), exc
            continue
        for i in range(len(ds)):
            with contextlib.suppress(OSError):  # a bad sample (replaced by the loader)
                ds.read_bytes(i)
    assert time.monotonic() - started < 60
