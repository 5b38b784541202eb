"""Review 2: behaviours the reviewed commits got wrong (each FAILS on main at 756ff53)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from batchwire.pipeline.checksums import PREPARE_MANIFEST, ChecksumManifestError, checksum
from batchwire.pipeline.dataset import open_dataset
from batchwire.pipeline.index_cache import scan_image_folder
from batchwire.prepare.checksum_manifest import REWRITTEN, Record


def test_a_class_folder_link_the_os_cannot_resolve_is_not_dropped_silently(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """81ddc68's `_is_dir` turns every OSError into "not a folder": a class folder whose link
    cannot be followed (here ENOTDIR; EACCES, EIO, ESTALE alike) vanishes from the classes, every
    later class's label moves down by one, and no line says so."""
    root = tmp_path / "train"
    for cls in ("a", "b", "c"):
        (root / cls).mkdir(parents=True)
        (root / cls / "x.jpg").write_bytes(b"\xff\xd8")
    (tmp_path / "plain").write_text("a file")
    (root / "b").rename(tmp_path / "b_real")
    (root / "b").symlink_to(tmp_path / "plain" / "b")  # stat: ENOTDIR
    with caplog.at_level(logging.WARNING):
        try:
            index = scan_image_folder(root)
        except OSError:
            return  # refused loudly: fine (what it did before 81ddc68)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "b" in index.classes or "b" in said, (index.classes, said)


def record(rel: str, data: bytes) -> str:
    """A manifest line as pipeline-prepare writes one for a rewritten, intact file."""
    n = len(data)
    return Record(rel, n, 0, REWRITTEN, n, n, 0, checksum=checksum(data), intact=True).to_line()


def test_verify_on_is_not_satisfied_by_another_datasets_manifest_folders_above(
    tmp_path: Path,
) -> None:
    """81ddc68's walk up (`data_manifest_folder`) takes the first manifest up to 3 folders
    above a list's files, whatever it records: with --verify-checksums on, a list whose files
    no manifest records opens with 0 files checked instead of the 'no usable checksum
    manifest' error it gave before."""
    data = tmp_path / "data"
    (data / "mine" / "imgs").mkdir(parents=True)
    (data / "other").mkdir()
    (data / "other" / "0.jpg").write_bytes(b"o" * 40)
    (data / PREPARE_MANIFEST).write_text(record("other/0.jpg", b"o" * 40))  # not ours
    files = [data / "mine" / "imgs" / f"{k}.jpg" for k in range(3)]
    for k, f in enumerate(files):
        f.write_bytes(bytes([k]) * 40)
    lst = tmp_path / "lists" / "train.txt"
    lst.parent.mkdir()
    lst.write_text("".join(f"{f} 0\n" for f in files))
    try:
        ds = open_dataset(lst, allow_outside_root=True, verify_checksums="on")
    except ChecksumManifestError:
        return
    assert ds.checksums is not None and ds.checksums.count > 0, (
        f"verify on: {ds.checksums.count if ds.checksums else None} of 3 files checked"
    )
