"""Expired or revoked credentials: a real server reading a real S3 store (SeaweedFS,
`objectstore.py`) that answers most of its reads with 403 AccessDenied does not train the run
on substitutes: the batch fails as ``transient`` with a message saying why, `/readyz` fails
naming the split and why, and the log says it once; `/healthz` stays 200 (restarting would not
renew the credentials). The loader is told why in the error's words (no object's URL).

The data: a CSV manifest of 64 samples, one in eight a local file (readable), the rest objects
of a bucket the server's identity (`reader`) may not read, so the store itself denies them, as
it would every object once the credentials expire. The readable ones let the server start (its
probe finds one) and are what substitutes would be drawn from. That reads become allowed again
(renewed credentials) is `AccessWatch`'s (tests/unit/test_access.py): the store's identities
are fixed for its life.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import requests
from batchwire.pipeline.dataset import open_dataset
from batchwire.pipeline.synthetic import default_dataset
from batchwire.wire import ErrorReply
from batchwire.wire.raw_client import RawClient
from objectstore import ADMIN_KEY, READER_KEY, seaweed  # noqa: F401  (the fixture)
from rawclient import wait_for
from serverproc import running_server

BUCKET = "denied"  # the `reader` identity has no right on it: every read is a 403


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(120)
def test_most_reads_denied_fail_batches_and_readyz_not_substitutes(
    seaweed,  # noqa: F811
    tmp_path: Path,
    ctx,
) -> None:
    local = open_dataset(default_dataset().val_root)
    rows = ["path,label"]
    for i in range(64):
        name = f"{i:03d}.jpg"
        data, label = local.read_bytes(i), int(local.labels[i]) % 2
        if i % 8 == 0:
            (tmp_path / name).write_bytes(data)
            rows.append(f"{name},{label}")
        else:
            seaweed.put(BUCKET, f"aw/{name}", data)
            rows.append(f"s3://{BUCKET}/aw/{name},{label}")
    manifest = tmp_path / "samples.csv"
    manifest.write_text("\n".join(rows) + "\n")
    port = free_port()
    args = (
        *("--train", str(manifest), "--val", str(manifest), "--batch-size", "16"),
        *("--image-size", "32", "--output-dtype", "uint8", "--workers", "1"),
        *("--producers", "1", "--metrics-port", str(port), "--allow-outside-root"),
    )
    with running_server(*args, env=seaweed.env("reader")) as srv:
        readyz = requests.get(f"http://127.0.0.1:{port}/readyz", timeout=5)
        assert readyz.status_code == 200, readyz.text
        client = RawClient.connect(ctx, srv.endpoint, split="val", batches=(0,))
        client.start()
        msg, _ = client.recv(30)
        # Not a batch of substitutes drawn from the 8 readable samples: an error that says why.
        assert isinstance(msg, ErrorReply), (msg, srv.log())
        # The error's kind, and why in words without the object's URL (`JobResult.public`):
        # what a RemoteLoader logs as it backs off and ServerUnavailable quotes.
        assert msg.reason == "transient", (msg, srv.log())
        assert "(AccessDeniedError, transient): most reads are denied" in msg.message, msg
        assert "credentials expired or revoked?" in msg.message, msg
        assert "s3://" not in msg.message and "/aw/" not in msg.message, msg

        def readyz_fails() -> dict | None:
            reply = requests.get(f"http://127.0.0.1:{port}/readyz", timeout=5)
            return reply.json() if reply.status_code == 503 else None

        body = wait_for(readyz_fails, "/readyz 503", 10)
        assert body["checks"]["reads"] is False and body["checks"]["loop"] is True, body
        assert "credentials expired or revoked?" in body["denied"]["val"], body
        assert requests.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200
        stats = srv.stats()
        assert stats["counters"]["replaced_total"] == 0  # nothing was served on substitutes
        client.close()
        log = srv.log()
    warned = [line for line in log.splitlines() if "most reads are denied" in line]
    assert len(warned) >= 1 and "WARNING" in warned[0] and str(manifest) in warned[0], log
    assert "credentials expired or revoked?" in warned[0], log
    # The failed batch's log names the object whose read found it out, and why.
    assert f"AccessDeniedError: [Errno 13] reading s3://{BUCKET}/aw/" in log, log
    for secret in (ADMIN_KEY[1], READER_KEY[1]):
        assert secret not in log and secret not in str(stats)
