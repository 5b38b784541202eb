"""gs:// and az:// serve the batches their local ImageFolder serves, byte for byte (train epochs 0
and 1, val; uint8), as test_sources_s3.py shows for s3://: real emulators of each API, started
by the tests (fake-gcs-server, tests/gcsemulator.py; Azurite, tests/azurite.py), reached by a
real pipeline-server through nothing but the environment a user exports (`env()`).

One server per store reads tar shards for train (`pipeline-prepare --shards`: listed, HEADed,
indexed and read by byte ranges) and the ImageFolder itself for val (a prefix per class:
listed with a delimiter, read object by object)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from batchwire.pipeline.dataset import open_dataset
from batchwire.pipeline.synthetic import default_dataset
from loaderchecks import assert_identical, epoch, loader
from serverproc import running_server

# The emulators' session fixtures (each skips, saying why, where its emulator is missing).
fake_gcs = pytest.importorskip("gcsemulator", reason="needs tests/gcsemulator.py").fake_gcs
azurite = pytest.importorskip("azurite", reason="needs tests/azurite.py").azurite

PREPARE = Path(sys.executable).with_name("pipeline-prepare")
BUCKET = "sources"
FIXTURE = {"gs": "fake_gcs", "az": "azurite"}


@pytest.fixture(scope="module")
def local(tmp_path_factory) -> dict[str, Path | int]:
    """The local ImageFolder (4 classes of 12 images) and its shards."""
    root = tmp_path_factory.mktemp("gcs-azure-src")
    folder = root / "folder"
    src = default_dataset().val_root
    for cls in sorted(p for p in src.iterdir() if p.is_dir())[:4]:
        (folder / cls.name).mkdir(parents=True)
        for f in sorted(cls.iterdir())[:12]:
            shutil.copyfile(f, folder / cls.name / f.name)
    done = subprocess.run(
        [str(PREPARE), str(folder), str(root / "shards"), "--shards", "150KB", "--quiet"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    count = len(list((root / "shards").glob("train-*.tar")))
    assert count >= 3
    return {"folder": folder, "shards": root / "shards", "count": count}


def args(train: str, val: str) -> tuple[str, ...]:
    return (
        *("--train", train, "--val", val, "--batch-size", "8", "--image-size", "32"),
        *("--output-dtype", "uint8", "--seed", "9", "--workers", "1"),
    )


@pytest.fixture(scope="module")
def want(local) -> dict:
    """The local ImageFolder's batches: (split, epoch) -> batches."""
    folder = str(local["folder"])
    with running_server(*args(folder, folder)) as ref:
        return {
            (s, e): epoch(ref.endpoint, s, e) for s, e in (("train", 0), ("train", 1), ("val", 0))
        }


@pytest.mark.parametrize("scheme", ["gs", "az"])
def test_a_bucket_serves_the_local_batches(scheme, request, local, want):
    store = request.getfixturevalue(FIXTURE[scheme])
    files = store.upload_folder(local["folder"], BUCKET, "folder")
    assert files == 48
    store.upload_folder(local["shards"], BUCKET, "shards")
    shards = f"{scheme}://{BUCKET}/shards/train-{{000000..{int(local['count']) - 1:06d}}}.tar"
    with running_server(*args(shards, f"{scheme}://{BUCKET}/folder"), env=store.env()) as srv:
        for (split, n), batches in want.items():
            assert_identical(batches, epoch(srv.endpoint, split, n), f"{scheme} {split} epoch {n}")
        ld = loader(srv.endpoint, "val")
        try:
            assert ld.classes == open_dataset(local["folder"], verify_checksums="off").classes
        finally:
            ld.close()
        assert srv.stats()["counters"]["bad_total"] == 0
