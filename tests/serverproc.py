"""Run a real `pipeline-server` process for a test.

    from serverproc import running_server

    with running_server("--batch-size", "4", "--image-size", "32") as srv:
        srv.endpoint          # "tcp://127.0.0.1:PORT" (or the ipc:// path you passed)
        srv.stats()           # the server's stats map (as it travels), via a `stats` request
    # on exit: SIGTERM, and the test fails unless the process exits 0 within `stop_timeout`

Other tools on the handle: `srv.stop()` (SIGTERM, returns the exit code, fails if not 0),
`srv.kill()` (SIGKILL, for crash tests), `srv.start()` (start again on the same endpoint, e.g.
after `kill()`), `srv.pid`, `srv.log()` (everything the server wrote to stdout/stderr, handy
in assertion messages), `srv.dealer()` (a raw zmq DEALER connected to it, linger 0).

`start()` returns once the server answers a `stats` request (no sleeps); a server that exits
or stays silent meanwhile fails the test with its log. Extra args are the CLI's.
`endpoint="ipc"` picks a fresh ipc:// path in a temporary folder.

Starting, waiting and stopping are `batchwire.common.launcher.PipelineServer`'s (the benchmarks
and the demo use it too); this wrapper adds what only tests want: a failed test instead of a
quiet kill, a zmq context for raw sockets, and the handy argument sets below.
"""

from __future__ import annotations

import signal
import tempfile
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import zmq
from batchwire.common.launcher import PipelineServer, free_tcp_endpoint
from batchwire.wire.stats_client import fetch_stats

__all__ = [
    "ServerProcess",
    "free_tcp_endpoint",
    "running_server",
    "running_servers",
    "small_server_args",
]


class ServerProcess(PipelineServer):
    """A `PipelineServer` whose stop fails the test unless the server exits 0 on SIGTERM."""

    def __init__(
        self,
        args: tuple[str, ...],
        endpoint: str | None,
        env: Mapping[str, str] | None,
        start_timeout: float,
        stop_timeout: float,
        log_dir: Path,
    ) -> None:
        super().__init__(args, endpoint, env=env, log_path=log_dir / "server.log")
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self._ctx = zmq.Context()

    def start(self, timeout: float | None = None) -> ServerProcess:
        """Start the process and return once it answers a stats request."""
        super().start(self.start_timeout if timeout is None else timeout)
        return self

    def stats(self, timeout: float = 5.0) -> dict[str, Any]:
        """The server's stats as the map that travels (checked against the schema on the
        way: `wire.ServerStats`), so end-to-end tests assert on the wire's own keys."""
        return fetch_stats(self.endpoint, timeout, ctx=self._ctx, keys=self.keys).to_map()

    def dealer(self, endpoint: str | None = None) -> zmq.Socket:
        """A raw DEALER connected to the server (linger 0); the caller closes it.

        ``endpoint`` picks another of the server's endpoints (e.g. a second ``--bind``).
        """
        sock = self._ctx.socket(zmq.DEALER)
        sock.linger = 0
        if self.keys is not None:
            self.keys.apply(sock)
        sock.connect(endpoint or self.endpoint)
        return sock

    def stop(self, timeout: float | None = None) -> int:  # type: ignore[override]
        """SIGTERM and wait; fails the test unless it exits 0 in time. Returns the exit code."""
        assert self._proc is not None, "server not started"
        timeout = self.stop_timeout if timeout is None else timeout
        stopped = super().stop(timeout)
        assert not stopped.killed, f"pipeline-server ignored SIGTERM for {timeout}s:\n{self.log()}"
        code = stopped.returncode
        assert code == 0, f"pipeline-server exited with {code}:\n{self.log()}"
        return code

    def close(self) -> None:
        self._ctx.destroy(linger=0)


@contextmanager
def running_server(
    *args: str,
    endpoint: str | None = None,
    env: Mapping[str, str] | None = None,
    start_timeout: float = 120.0,
    stop_timeout: float = 10.0,
) -> Iterator[ServerProcess]:
    """Start `pipeline-server *args` on ``endpoint`` (default: a free 127.0.0.1 port).

    On a clean exit of the block the server must stop with exit code 0 on SIGTERM; if the block
    raised, the server is killed and the original error propagates. ``start_timeout`` is
    generous because the first start may generate the embedded dataset.
    """
    with tempfile.TemporaryDirectory(prefix="bw-server-") as tmp:
        if endpoint == "ipc":
            endpoint = f"ipc://{tmp}/server.sock"
        srv = ServerProcess(args, endpoint, env, start_timeout, stop_timeout, Path(tmp))
        try:
            srv.start()
            yield srv
        except BaseException:
            srv.kill()
            raise
        else:
            if srv.running:
                srv.stop()
        finally:
            srv.kill()
            srv.close()


@contextmanager
def running_servers(count: int, *args: str) -> Iterator[tuple[ServerProcess, ...]]:
    """``count`` identical servers started side by side (each start takes seconds); those that
    started are stopped as `running_server` stops one, and a failed start raises."""
    cms = [running_server(*args) for _ in range(count)]
    with ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(cm.__enter__) for cm in cms]
    started = [cm for cm, f in zip(cms, futures, strict=True) if f.exception() is None]
    try:
        yield tuple(f.result() for f in futures)
    finally:
        for cm in started:
            cm.__exit__(None, None, None)


def small_server_args(*, seed: int, root: str | None = None, val: bool = False) -> tuple[str, ...]:
    """A cheap server for client tests: batches of 16 uint8 32-px images from `root` (default: the
    embedded dataset's val split, 400 images), one decode thread; `val` serves `root` as val too."""
    from batchwire.pipeline.synthetic import default_dataset

    root = root or str(default_dataset().val_root)
    args = ("--train", root, *(("--val", root) if val else ()))
    return (
        *args,
        *("--batch-size", "16", "--image-size", "32", "--output-dtype", "uint8"),
        *("--workers", "1", "--seed", str(seed)),
    )


def default_sigint() -> None:
    """`preexec_fn` for a child a test will Ctrl-C: SIGINT back to its default.

    A test runner started in the background by a shell without job control inherits SIGINT
    ignored, and Python keeps an inherited SIG_IGN: the child would never see the Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
