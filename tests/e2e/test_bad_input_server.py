"""A real pipeline-server over a list file of corrupt files and FIFOs: it serves full batches,
counts each bad file once in `bad_total` although both of its splits hold it, and still stops
on SIGTERM (a FIFO used to block its producers for good)."""

from __future__ import annotations

from pathlib import Path

import pytest
from badinputcorpus import write_corpus
from batchwire.client.remote_loader import RemoteLoader
from serverproc import running_server


@pytest.mark.timeout(180)
def test_server_replaces_bad_files_and_counts_them_once_over_splits(tmp_path: Path) -> None:
    listing, bad_paths = write_corpus(tmp_path / "corpus")
    args = (
        *("--train", str(listing), "--val", str(listing), "--allow-outside-root"),
        *("--batch-size", "4", "--image-size", "24", "--output-dtype", "uint8"),
        *("--workers", "1", "--seed", "3"),
    )
    with running_server(*args) as srv:
        n = sum(1 for line in listing.read_text().splitlines() if line.strip())
        for split in ("val", "train"):
            with RemoteLoader(
                srv.endpoint, split, rank=0, world_size=1, with_indices=True, timeout=60
            ) as loader:
                seen = []
                for images, _labels, indices in loader:
                    assert images.shape[0] == 4
                    seen += [i for i in indices.tolist() if i >= 0]
            if split == "val":
                assert sorted(seen) == list(range(n))  # every slot served, bad ones replaced
        counters = srv.stats()["counters"]
        # val's centre crops read every corrupt file's damage; train meets some of the same
        # files again (the FIFO, the directory, ... whatever its crops read): counted once.
        assert counters["bad_total"] == len(bad_paths), srv.log()
        assert counters["replaced_total"] >= len(bad_paths) + 1  # pipe.jpg is listed twice
        assert counters["errors_total"] == 0, srv.log()
        log = srv.log()
    for path in bad_paths:
        assert f"image {path} (" in log, path
