"""docs/performance.md: "for a list file, [the server looks in] its own folder and the folder all
its files lie in, so a list kept elsewhere naming DST's files still finds DST's manifest". A list
dataset prepared with `pipeline-prepare list.txt DST` keeps its images in a folder of DST
(DST/imgs/...): a list kept elsewhere naming them must still find DST/.batchwire-prepare.jsonl,
one folder above the folder they all lie in."""

from __future__ import annotations

from pathlib import Path

from batchwire.pipeline.checksums import PREPARE_MANIFEST, checksum
from batchwire.pipeline.dataset import open_dataset
from batchwire.prepare.checksum_manifest import REWRITTEN, Record


def record(rel: str, data: bytes) -> str:
    """A manifest line as pipeline-prepare writes one for a rewritten, intact file."""
    n = len(data)
    return Record(rel, n, 0, REWRITTEN, n, n, 0, checksum=checksum(data), intact=True).to_line()


def test_a_list_elsewhere_naming_a_prepared_list_datasets_images_finds_its_manifest(
    tmp_path: Path,
) -> None:
    dst = tmp_path / "dst"
    (dst / "imgs").mkdir(parents=True)
    files = {f"imgs/{k}.jpg": bytes([k]) * 40 for k in range(3)}
    for rel, data in files.items():
        (dst / rel).write_bytes(data)
    (dst / "list.txt").write_text("".join(f"{rel} 0\n" for rel in files))
    (dst / PREPARE_MANIFEST).write_text("".join(record(r, d) for r, d in files.items()))
    assert open_dataset(dst / "list.txt").checksums.count == 3  # the list DST holds: found
    elsewhere = tmp_path / "lists" / "train.txt"
    elsewhere.parent.mkdir()
    elsewhere.write_text("".join(f"{dst / rel} 0\n" for rel in files))
    ds = open_dataset(elsewhere, allow_outside_root=True)
    assert ds.checksums is not None and ds.checksums.count == 3
    assert "differ" in (ds.checksum_problem(0, b"\x01" * 40) or "")
