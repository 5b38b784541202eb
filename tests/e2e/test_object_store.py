"""Datasets in a real S3 object store (SeaweedFS, `objectstore.py`), served by real servers.

The promise: the same images as a local ImageFolder and as an ImageFolder under `s3://` give
byte-identical batches (train epochs 0 and 1, val; uint8 and float16), through the real client
library's signed requests; a missing or forbidden object is a counted, replaced bad sample;
the store killed and restarted mid-epoch costs a wait, never a sample; setup problems exit 2
naming the URL and the fix; the secret key never reaches a log or a stats reply.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from batchwire.client import RemoteLoader
from batchwire.pipeline.dataset import open_dataset
from batchwire.pipeline.synthetic import default_dataset
from objectstore import ADMIN_KEY, READER_KEY, seaweed  # noqa: F401  (the fixture)
from serverproc import free_tcp_endpoint, running_server

BIN = Path(sys.executable).parent
BUCKET = "data"


@pytest.fixture(scope="module")
def local_root() -> Path:
    return default_dataset().val_root  # 400 JPEGs, 10 classes, 100 to 600 px


@pytest.fixture(scope="module")
def s3_folder(seaweed, local_root) -> str:  # noqa: F811
    """The embedded val split uploaded as an ImageFolder under s3://data/emb/val."""
    seaweed.upload_folder(local_root, BUCKET, "emb/val")
    return f"s3://{BUCKET}/emb/val"


def _args(root: str, dtype: str = "uint8", *extra: str) -> tuple[str, ...]:
    return (
        *("--train", root, "--val", root, "--batch-size", "16", "--image-size", "32"),
        *("--output-dtype", dtype, "--seed", "7", "--workers", "1", "--listing-ttl", "0"),
        *extra,
    )


def _env(store, identity: str = "admin") -> dict[str, str]:
    """The store's AWS_* environment (servers also get --listing-ttl 0: a listing cached by an
    earlier run on the same port must not stand in for this one)."""
    return store.env(identity)


def batches(
    endpoint: str, split: str, epoch: int, **kw: object
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    loader = RemoteLoader(
        endpoint, split, rank=0, world_size=1, device="cpu", with_indices=True, timeout=60, **kw
    )
    loader.set_epoch(epoch)
    try:
        return [tuple(t.clone() for t in batch) for batch in loader]  # type: ignore[misc]
    finally:
        loader.close()


def assert_same(want: list, got: list, what: str) -> None:
    assert len(want) == len(got) > 0, what
    for k, (x, y) in enumerate(zip(want, got, strict=True)):
        for tx, ty in zip(x, y, strict=True):
            assert tx.dtype == ty.dtype and tx.shape == ty.shape
            assert torch.equal(tx.view(torch.uint8), ty.view(torch.uint8)), f"{what} batch {k}"


def test_bucket_folder_opens_as_the_local_folder(seaweed, s3_folder, local_root, tmp_path):  # noqa: F811
    """Same order, labels and class names; the same bytes for every sample; the listing is
    cached for the next open."""
    os.environ.update(_env(seaweed))
    try:
        remote, local = open_dataset(s3_folder, tmp_path), open_dataset(local_root)
        again = open_dataset(s3_folder, tmp_path)
    finally:
        for name in _env(seaweed):
            os.environ.pop(name, None)
    assert remote.classes == local.classes and (remote.labels == local.labels).all()
    rel = [p.removeprefix(s3_folder + "/") for p in remote.paths]
    assert rel == [Path(p).relative_to(local_root).as_posix() for p in local.paths]
    got = remote.read_many(range(len(remote)))
    assert got == [local.read_bytes(i) for i in range(len(local))]
    assert not remote.from_cache and again.from_cache
    # The location as logs and stats show it: the URL itself (a Path would print "s3:/data").
    assert remote.root == s3_folder and isinstance(remote.root, str)
    assert f"folder '{s3_folder}'" in repr(remote)


@pytest.mark.parametrize("dtype", ["uint8", "float16"])
def test_s3_folder_serves_the_local_folders_batches(
    seaweed,  # noqa: F811
    s3_folder,
    local_root,
    dtype,
):
    env = _env(seaweed)
    with (
        running_server(*_args(str(local_root), dtype)) as a,
        running_server(*_args(s3_folder, dtype), env=env) as b,
    ):
        for split, epoch in (("train", 0), ("train", 1), ("val", 0)):
            assert_same(
                batches(a.endpoint, split, epoch),
                batches(b.endpoint, split, epoch),
                f"{split} epoch {epoch}",
            )
        stats = b.stats()
        assert stats["counters"]["bad_total"] == 0
        assert_no_secret(b.log(), str(stats))


def assert_no_secret(*texts: str) -> None:
    for text in texts:
        for secret in (ADMIN_KEY[1], READER_KEY[1]):
            assert secret not in text


def test_list_file_in_bucket_and_a_missing_object(seaweed, s3_folder, local_root):  # noqa: F811
    """A list file beside the images names 48 of them and one object that does not exist:
    served, the missing one counted once, logged by URL, and replaced."""
    local = open_dataset(local_root)
    lines = [
        f"{Path(p).relative_to(local_root).as_posix()} {int(label)}"
        for p, label in list(zip(local.paths, local.labels, strict=True))[::8]
    ]
    lines.insert(5, "fox/nowhere.jpg 3")
    seaweed.put(BUCKET, "emb/val/subset.txt", ("\n".join(lines) + "\n").encode())
    url = f"{s3_folder}/subset.txt"
    with running_server(*_args(url), env=_env(seaweed)) as srv:
        got = batches(srv.endpoint, "val", 0)
        indices = torch.cat([b[2] for b in got])
        assert sorted(i for i in indices.tolist() if i >= 0) == list(range(len(lines)))
        stats = srv.stats()
        assert stats["counters"]["bad_total"] == 1
        log = srv.log()
        assert f"{s3_folder}/fox/nowhere.jpg" in log and "no such object" in log
        assert_no_secret(log, str(stats))


def test_forbidden_objects_are_bad_samples(seaweed, local_root):  # noqa: F811
    """The `reader` identity may list bucket `mixed` and read `ok/...` but not `secret/...`
    (403 AccessDenied from the store): those samples are counted and replaced."""
    local = open_dataset(local_root)
    for i in range(0, 40):
        seaweed.put("mixed", f"ok/{i:03d}.jpg", local.read_bytes(i))
    for i in range(40, 43):
        seaweed.put("mixed", f"secret/{i:03d}.jpg", local.read_bytes(i))
    with running_server(*_args("s3://mixed"), env=_env(seaweed, "reader")) as srv:
        got = batches(srv.endpoint, "val", 0)
        assert len(got) == 3  # 43 samples, batches of 16
        stats = srv.stats()
        assert stats["counters"]["bad_total"] == 3
        log = srv.log()
        assert "s3://mixed/secret/040.jpg" in log and "access denied (HTTP 403" in log
        assert_no_secret(log, str(stats))


def test_store_killed_and_restarted_mid_epoch(seaweed, s3_folder, local_root):  # noqa: F811
    """SIGKILL the store after a few batches, start it again 3 s later (it serves again about
    3 s after that): the epoch completes with the batches a local server gives (every sample
    exactly once), no sample marked bad."""
    with (
        running_server(*_args(str(local_root))) as a,
        running_server(*_args(s3_folder, "uint8", "--producers", "1"), env=_env(seaweed)) as b,
    ):
        want = batches(a.endpoint, "train", 3)
        loader = RemoteLoader(
            b.endpoint,
            "train",
            rank=0,
            world_size=1,
            device="cpu",
            with_indices=True,
            timeout=90,
            prefetch=1,
        )
        loader.set_epoch(3)
        got: list[tuple[torch.Tensor, ...]] = []
        restarted = threading.Event()
        at_restart: list[int] = []

        def outage() -> None:
            seaweed.kill()
            time.sleep(3.0)  # longer than obstore's own retries (~3 s): the loader's path too
            seaweed.start()
            at_restart.append(len(got))
            restarted.set()

        worker = None
        try:
            for k, batch in enumerate(loader):
                got.append(tuple(t.clone() for t in batch))
                if k == 2:
                    worker = threading.Thread(target=outage)
                    worker.start()
        finally:
            loader.close()
            if worker is not None:
                worker.join(60)
        assert restarted.is_set()
        assert_same(want, got, "train epoch 3 across a store restart")
        indices = torch.cat([g[2] for g in got]).tolist()
        assert sorted(indices) == list(range(400))
        assert b.stats()["counters"]["bad_total"] == 0
        # The epoch spanned the outage (reads failed and were retried: by obstore, and past
        # its retries by the sample loader and the client, whose waits the log shows).
        assert at_restart and at_restart[0] < len(want), "the outage was not met"


def _start_fails(url: str, env: dict[str, str]) -> str:
    """Run a server that must exit 2 at start; its output."""
    command = [str(BIN / "pipeline-server"), "--train", url, "--listing-ttl", "0"]
    done = subprocess.run(
        [*command, "--bind", free_tcp_endpoint()],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    return out


def test_setup_problems_exit_2_naming_the_url_and_the_fix(seaweed, s3_folder):  # noqa: F811
    base = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    base.update(OMP_NUM_THREADS="1")
    env = {**base, **seaweed.env()}
    # No credentials: the chain ends at the instance-metadata endpoint, here a closed port.
    no_keys = {
        k: v for k, v in env.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
    }
    no_keys["AWS_METADATA_ENDPOINT"] = "http://127.0.0.1:9"
    out = _start_fails(s3_folder, no_keys)
    assert f"--train {s3_folder}" in out and "no credentials found" in out
    assert "AWS_ACCESS_KEY_ID" in out
    # Wrong secret: access denied, with what to check.
    wrong = {**env, "AWS_SECRET_ACCESS_KEY": "not-the-secret-key-at-all"}
    out = _start_fails(s3_folder, wrong)
    assert "access denied" in out and "not-the-secret-key-at-all" not in out
    # No such bucket.
    out = _start_fails("s3://no-such-bucket/train", env)
    assert "s3://no-such-bucket/train" in out and "NoSuchBucket" in out
    assert "Check the bucket name" in out
    # An empty prefix.
    out = _start_fails(f"s3://{BUCKET}/emb/nothing-here", env)
    assert f"s3://{BUCKET}/emb/nothing-here: no objects under this prefix" in out
    # Credentials in the URL are refused without being repeated.
    out = _start_fails(f"s3://AKIDX:{ADMIN_KEY[1]}@{BUCKET}/emb/val", env)
    assert "credentials in the URL are not accepted" in out
    assert_no_secret(out)
