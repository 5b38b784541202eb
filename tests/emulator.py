"""What the tests' storage emulators share (fake-gcs-server, Azurite): one process over a
temporary folder on a free 127.0.0.1 port, dying with the test process, started once per
test process by a session fixture (`session_of`) and thrown away after the last test.

SeaweedFS has the same shape but is `pipeline-store`'s class (batchwire.common.devstore), since
users run it too."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from batchwire.common.devstore import free_ports, kill_with_parent


class Emulator:
    """A loopback service process: subclasses give `name`, `command()` and `_ready()`."""

    name = "emulator"
    start_timeout_s = 20.0
    poll_s = 0.05

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_ports(1)[0]
        self.log_path = root / f"{self.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        raise NotImplementedError

    def _ready(self) -> bool:
        raise NotImplementedError

    def start(self) -> Emulator:
        """Start it and wait until it answers; RuntimeError with its log's tail if it does not."""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.root,
                preexec_fn=kill_with_parent,
            )
        deadline = time.monotonic() + self.start_timeout_s
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"{self.name} did not start:\n{self.log_tail()}")
            time.sleep(self.poll_s)
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


E = TypeVar("E", bound=Emulator)


def session_of(make: Callable[[Path], E], prefix: str) -> Iterator[E]:
    """The body of a session fixture: `make(folder)` started (once more on a fresh port if
    another process took its port in between), yielded, then killed and its folder removed."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    server = make(root)
    try:
        try:
            server.start()
        except RuntimeError:
            server.port = free_ports(1)[0]
            server.start()
        yield server
    finally:
        server.kill()
        shutil.rmtree(root, ignore_errors=True)
