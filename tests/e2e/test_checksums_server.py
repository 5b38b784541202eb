"""A real pipeline-server catches a bit flip that every decoder accepts, through the checksums
pipeline-prepare recorded: train on a prepared tree (DST's manifest), val on a tree given
only `pipeline-prepare --checksums-only` (the manifest beside it). Each flipped file is counted
bad once, logged as a checksum mismatch and replaced; every slot is still served. The same for
a member of a WebDataset tar shard, in a folder and in a real S3 bucket (SeaweedFS), checksummed
per sample by `pipeline-prepare --checksums-only SHARDS`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import obstore
import pytest
from batchwire.native.build import cache_root
from batchwire.pipeline.dataset import open_dataset
from bitflips import SAMPLE_DIR, clean_bit_flip, photos
from loaderchecks import counting_loader
from objectstore import seaweed  # noqa: F401  (the fixture)
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


def served_indices(endpoint: str, split: str) -> list[int]:
    """The sampler indices of every slot served in one epoch of `split` (padding, -1, left
    out), read by `counting_loader`: nothing asked ahead, so the server's `replaced_total`
    counts only these slots."""
    with counting_loader(endpoint, split) as loader:
        return [i for _, _, indices in loader for i in indices.tolist() if i >= 0]


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
            seen = served_indices(srv.endpoint, split)
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
        with counting_loader(srv.endpoint, "train") as loader:  # nothing of epoch 1 asked ahead
            seen = [i for _, _, indices in loader for i in indices.tolist() if i >= 0]
        counters = srv.stats()["counters"]
        log = srv.log()
    assert len(seen) == 6, log
    assert counters["bad_total"] == 1 and counters["replaced_total"] == 1, log
    assert f"image {flipped} (checksum mismatch" in log, log


def flip_member(shards: Path, index: int) -> tuple[str, int]:
    """A clean bit flip in sample `index`'s image member, in place (the shard keeps its size
    and its members their offsets: damage, not a rewrite); (its shard's name, sample index)."""
    ds = open_dataset(shards, verify_checksums="off")
    reader = ds.reader
    shard = shards / reader.located.keys[int(reader.shard_of[index])]
    start, size = int(reader.offsets[index]), int(reader.sizes[index])
    data = shard.read_bytes()
    flipped = clean_bit_flip(data[start : start + size])
    assert len(flipped) == size
    shard.write_bytes(data[:start] + flipped + data[start + size :])
    return shard.name, index


@pytest.mark.timeout(300)
def test_server_catches_a_flipped_tar_member_local_and_s3(tmp_path: Path, seaweed) -> None:  # noqa: F811
    """train: shards in a folder; val: the same shards in a bucket, checksummed there by
    `pipeline-prepare --checksums-only s3://...` (the manifest written into the bucket). One
    member of each flipped in place; `--verify-checksums on` counts each bad once, names it
    (SHARD:MEMBER) as a checksum mismatch and replaces it; every slot is served."""
    n = 6 if SAMPLE_DIR.is_dir() else 24  # over 100 KB either way: two shards or more
    src = tree(tmp_path / "src", photos(n))
    local, remote = tmp_path / "shards", tmp_path / "shards-s3"
    for out in (local, remote):
        prepare(str(src), str(out), "--shards", "100KB")
    assert len(list(local.glob("train-*.tar"))) >= 2
    prepare("--checksums-only", str(local))
    env = seaweed.env()
    seaweed.upload_folder(remote, "sums", "shards")
    done = subprocess.run(
        [str(PREPARE), "--checksums-only", "s3://sums/shards", "--quiet", "--jobs", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{n} samples of s3://sums/shards checksummed ({n} intact JPEGs" in done.stdout
    shard_l, k_l = flip_member(local, 2)
    shard_r, k_r = flip_member(remote, 4)
    obstore.put(seaweed.client("sums"), f"shards/{shard_r}", (remote / shard_r).read_bytes())
    args = (
        *("--train", str(local), "--val", "s3://sums/shards", "--verify-checksums", "on"),
        *("--batch-size", "2", "--image-size", "24", "--output-dtype", "uint8"),
        *("--workers", "1", "--seed", "3"),
    )
    with running_server(*args, env={**fresh_cache(tmp_path), **env}) as srv:
        for split in ("train", "val"):
            assert len(served_indices(srv.endpoint, split)) == n
        counters = srv.stats()["counters"]
        log = srv.log()
    assert counters["bad_total"] == 2, log
    assert counters["replaced_total"] == 2, log
    assert f"image {local / shard_l}:{k_l:09d}.jpg (checksum mismatch" in log, log
    assert f"image s3://sums/shards/{shard_r}:{k_r:09d}.jpg (checksum mismatch" in log, log
    assert env["AWS_SECRET_ACCESS_KEY"] not in log + done.stdout + done.stderr
