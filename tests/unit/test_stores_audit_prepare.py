"""Stores audit: `pipeline-prepare SRC DST` given tar shards, Parquet, a manifest or a bucket URL.

docs/your-data.md lists `pipeline-prepare SRC` among the places every source kind works; its copy
mode (JPEGs rewritten for cheaper crops) reads a folder tree or a list file only. Given another
kind it must say so, naming the modes that take it (`--shards`, `--checksums-only`), exit 2 and
write nothing: not "list file is not UTF-8 text" for a shard or a Parquet file, "expected 'path
label'" for a CSV, "SRC does not exist: s3:/bucket" for a URL, nor a DST of shards copied whole
under a note that it has no class folders."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from batchwire.prepare.cli import main
from jpegchecks import SAMPLE_DIR

JPEG = next(iter(sorted(SAMPLE_DIR.glob("*.JPEG"))), None)


def _shard(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for name, data in (("s0.jpg", JPEG.read_bytes()), ("s0.cls", b"0")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _parquet(path: Path) -> Path:
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    cells = pa.array([{"bytes": JPEG.read_bytes(), "path": "a.jpg"}], type=image)
    pq.write_table(pa.table({"image": cells, "label": [0]}), path)
    return path


def _csv(path: Path) -> Path:
    (path.parent / "a.jpg").write_bytes(JPEG.read_bytes())
    path.write_text("path,label\na.jpg,tench\n")
    return path


SOURCES = {
    "shard": (lambda tmp: str(_shard(tmp / "train-000000.tar")), "tar shards"),
    "folder-of-shards": (lambda tmp: str(_shard(tmp / "s" / "train-000000.tar").parent), "tar"),
    "parquet": (lambda tmp: str(_parquet(tmp / "train-0.parquet")), "Parquet"),
    "csv": (lambda tmp: str(_csv(tmp / "train.csv")), "CSV manifest"),
    "bucket": (lambda tmp: "s3://team-data/photos/train", "bucket URL"),
}


@pytest.mark.parametrize("kind", list(SOURCES))
def test_the_copy_mode_names_a_source_kind_it_does_not_rewrite(tmp_path, capsys, kind):
    if JPEG is None:
        pytest.skip("the sample JPEGs are not here")
    make, named = SOURCES[kind]
    src = make(tmp_path)
    dst = tmp_path / "dst"
    assert main([src, str(dst)]) == 2
    err = capsys.readouterr().err
    assert named in err and "--shards" in err and "--checksums-only" in err, err
    assert not dst.exists() or not any(dst.iterdir())
