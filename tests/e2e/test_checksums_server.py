"""A real pipeline-server catches a bit flip that every decoder accepts, through the checksums
pipeline-prepare recorded: train on a prepared tree (DST's manifest), val on a tree given
only `pipeline-prepare --checksums-only` (the manifest beside it). Each flipped file is counted
bad once, logged as a checksum mismatch and replaced; every slot is still served.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from batchwire.client.remote_loader import RemoteLoader
from batchwire.native.build import cache_root
from bitflips import clean_bit_flip, photos
from serverproc import running_server

PREPARE = Path(sys.executable).with_name("pipeline-prepare")


def fresh_cache(tmp_path: Path) -> dict[str, str]:
    """A server environment with its own dataset-index cache, but this checkout's native build
    (a fresh BATCHWIRE_CACHE alone would recompile the extension in the server: ~30 s)."""
    return {
        "BATCHWIRE_CACHE": str(tmp_path / "cache"),
        "BATCHWIRE_NATIVE_CACHE": str(cache_root()),
    }


def prepare(*args: str) -> None:
    done = subprocess.run(
        [str(PREPARE), *args, "--quiet", "--jobs", "1"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr


def tree(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def flip(path: Path) -> str:
    path.write_bytes(clean_bit_flip(path.read_bytes()))
    return str(path)


@pytest.mark.timeout(240)
def test_server_counts_and_replaces_clean_bit_flips(tmp_path: Path) -> None:
    files = photos(6)
    prepared = tmp_path / "prepared"
    prepare(str(tree(tmp_path / "src", files)), str(prepared))
    plain = tree(tmp_path / "plain", files)
    prepare("--checksums-only", str(plain))
    flipped = [flip(prepared / "class0/img2.jpg"), flip(plain / "class1/img5.jpg")]
    args = (
        *("--train", str(prepared), "--val", str(plain)),
        *("--batch-size", "2", "--image-size", "24", "--output-dtype", "uint8"),
        *("--workers", "1", "--seed", "3"),
    )
    with running_server(*args, env=fresh_cache(tmp_path)) as srv:
        for split in ("train", "val"):
            with RemoteLoader(
                srv.endpoint,
                split,
                rank=0,
                world_size=1,
                with_indices=True,
                timeout=60,
                prefetch_next_epoch=False,  # replaced_total counts only what is served here
            ) as loader:
                seen = [i for _, _, indices in loader for i in indices.tolist() if i >= 0]
            assert len(seen) == 6  # 6 files, batches of 2: every slot served
        counters = srv.stats()["counters"]
        log = srv.log()
    assert counters["bad_total"] == 2, log
    assert counters["replaced_total"] == 2, log
    for path in flipped:
        assert f"image {path} (checksum mismatch" in log, log


@pytest.mark.timeout(240)
def test_server_finds_a_manifest_in_a_checksum_dir(tmp_path: Path) -> None:
    """`pipeline-prepare --checksums-only SRC --manifest-dir DIR` leaves SRC untouched and
    writes the manifest in DIR (named after SRC); a server given `--checksum-dir DIR` finds
    it and catches a clean bit flip through it."""
    plain = tree(tmp_path / "plain", photos(6))
    sums = tmp_path / "sums"
    prepare("--checksums-only", str(plain), "--manifest-dir", str(sums))
    assert not any(p.name.startswith(".batchwire") for p in plain.iterdir())
    flipped = flip(plain / "class0/img4.jpg")
    args = (
        *("--train", str(plain), "--checksum-dir", str(sums)),
        *("--batch-size", "2", "--image-size", "24", "--output-dtype", "uint8"),
        *("--workers", "1", "--seed", "3"),
    )
    with running_server(*args, env=fresh_cache(tmp_path)) as srv:
        with RemoteLoader(
            srv.endpoint, "train", rank=0, world_size=1, with_indices=True, timeout=60
        ) as loader:
            seen = [i for _, _, indices in loader for i in indices.tolist() if i >= 0]
        counters = srv.stats()["counters"]
        log = srv.log()
    assert len(seen) == 6, log
    assert counters["bad_total"] == 1 and counters["replaced_total"] == 1, log
    assert f"image {flipped} (checksum mismatch" in log, log
