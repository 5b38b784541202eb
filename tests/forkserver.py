"""A fork server for the suite's Python child processes: torch imported once, not ~300 times.

Half of the end-to-end tier's CPU went into starting Python: every `pipeline-server`, CLI and
`python -c` a test starts imports torch, numpy and OpenCV again (~1.4 s of CPU each on the
2-core hosts). This module keeps one process per test worker that has imported those libraries
and forks it for each such child (the zygote pattern of Android and of Python's own
multiprocessing "forkserver"): the child then runs the same `python -m module args`, `-c code`,
script or console script a fresh interpreter would, with the test's argv, environment, working
directory and standard streams, and exits the way the interpreter exits (non-daemon threads
joined, atexit handlers run, the same exit codes and signals).

    from forkserver import ForkServer
    with ForkServer.start() as server:
        server.install()            # subprocess.Popen forks here when it can; see `reusable`
        subprocess.run([sys.executable, "-m", "batchwire.server.cli", "--help"])

What stays a real exec (`reusable` says why not): anything but this interpreter or one of its
console scripts; interpreter options other than -m/-c; `preexec_fn`, `pass_fds`, user/group/
umask changes, `close_fds=False`, a shell; and an environment whose interpreter-start settings
differ from the fork server's (PYTHON*, LD_*, thread-pool and CUDA variables...), since those
take effect before any code runs and the fork server has already started. A child's own
Python children fork here too (torchrun's ranks...): they are the fork server's children, not
their parent's, and /proc shows the fork server's environment, so a test that looks up a
process by its parent or its /proc environ is marked `fresh_python`, and so is a test of
which modules a process imports: batchwire's command lines and loader are imported ahead too
(`OWN_PRELOAD`), which changes nothing else a child sees, since no batchwire module reads the
environment or a file at import (a variable a test sets for batchwire is read as in a fresh
process). One thing differs: batchwire's loggers exist already, so a child that calls
`logging.config.dictConfig` (whose `disable_existing_loggers` is on by default) before it imports
batchwire disables them, where a fresh interpreter would not; such a test is `fresh_python`.

The parent side is `ForkedPopen`, a `subprocess.Popen` whose `_execute_child` asks the fork
server instead of calling fork/exec and whose wait reads the exit status the fork server sends
(the child is the fork server's, so the test cannot `waitpid` it); pipes, `communicate`,
timeouts, `send_signal`/`kill` (the child's real pid) are Popen's own.
"""

from __future__ import annotations

import array
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from types import TracebackType

#: Imported once by the fork server: what batchwire's processes import that costs time.
#: Third-party only (see the module docstring).
PRELOAD = ("torch", "numpy", "zmq", "msgpack", "turbojpeg", "cv2", "xxhash", "prometheus_client")
#: batchwire's command lines and loader, imported once too: each child then skips about 0.1 s of
#: wall (0.2 s of CPU) of importing them, some 40 CPU-s of the end-to-end tier. A child sees
#: what a fresh interpreter sees, because no batchwire module reads the environment or a file
#: as it is imported (tests/unit/test_import_time.py holds that).
OWN_PRELOAD = (
    "batchwire.server.app",
    "batchwire.server.cli",
    "batchwire.client",
    "batchwire.train.cli",
    "batchwire.monitor.cli",
    "batchwire.prepare.cli",
)

#: Environment variables read when an interpreter or a preloaded library starts: a child whose
#: value differs from the fork server's is exec'd for real.
STARTUP_PREFIXES = (
    "PYTHON", "LD_", "OMP_", "MKL_", "KMP_", "GOMP", "OPENBLAS", "NPY_", "NUMPY", "TORCH",
    "PYTORCH", "CUDA", "NVIDIA", "OPENCV", "MALLOC", "VIRTUAL_ENV",
)  # fmt: skip

_STATUS_UNKNOWN = 255 << 8  # a wait status for a child whose status was lost: exit code 255


#: Start-up settings a child can still take after the fork: the fork server's streams are
#: unbuffered (PYTHONUNBUFFERED: a child that did not ask for it only flushes sooner); a child's
#: OMP_NUM_THREADS is given to torch (`torch.set_num_threads`, which sets OpenMP's and MKL's) and
#: its PYTHONWARNINGS to the warnings module, as the interpreter would at start.
TAKEN_AFTER_FORK = ("PYTHONUNBUFFERED", "OMP_NUM_THREADS", "PYTHONWARNINGS")


#: Read when used, not at start, though their prefix says otherwise: the variables torchrun
#: sets for each rank, and two that torch and Lightning write into a running process's
#: environment (torch's inductor its cache folder, the first time it asks for it; Lightning's
#: CUDA accelerator the NVML check): torch reads both again each time it needs them. Counted as
#: start-up settings, each test worker's children were exec'd for real from the first test
#: that set them on (99 of ~340 Python children, about 1.5 s of CPU each, in one `make test`).
READ_WHEN_USED = (
    "TORCHELASTIC_",
    "TORCH_NCCL_",
    "TORCHINDUCTOR_CACHE_DIR",
    "PYTORCH_NVML_BASED_CUDA_CHECK",
)


def startup_env(env: Mapping[str, str]) -> dict[str, str]:
    """The part of ``env`` that takes effect only when a process starts (and not after a fork)."""
    return {
        k: v
        for k, v in env.items()
        if k.startswith(STARTUP_PREFIXES)
        and not k.startswith(READ_WHEN_USED)
        and k not in TAKEN_AFTER_FORK
    }


def _own_random_state() -> None:
    """Seed torch's and numpy's global generators afresh, as a fresh interpreter's are (Python's
    `random` reseeds itself after a fork): children that share the fork server's state would
    draw the same numbers, and a test of seeding could not fail on a seed left unapplied."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _take_startup_settings(env: Mapping[str, str]) -> None:
    """In the child: what `TAKEN_AFTER_FORK` says, from the child's environment."""
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
    if env.get("PYTHONWARNINGS"):
        import warnings

        options = [o for o in env["PYTHONWARNINGS"].split(",") if o]
        sys.warnoptions[:] = options
        warnings._processoptions(options)  # type: ignore[attr-defined]  # what startup calls


# ---------------------------------------------------------------------------------------------
# The child: what a fresh interpreter does with `argv`, in a forked process.


def _launch_spec(
    argv: Sequence[str], executable: str, cwd: str, path: str | None
) -> tuple[str, str, list[str]] | None:
    """(kind, target, rest) for an argv this module can run, or None.

    kind "module" (`-m`), "code" (`-c`) or "script" (a file: a plain script, or a console
    script whose shebang is this interpreter, found as exec would: on ``path`` without a slash,
    from ``cwd`` with one)."""
    if not argv:
        return None
    first = os.fspath(argv[0])
    if "/" not in first:
        first = shutil.which(first, path=path) or first
    first = os.path.join(cwd, first)
    if first == executable:
        args = list(argv[1:])
        while args[:1] == ["-u"]:  # unbuffered: the fork server's streams already are
            args = args[1:]
        if len(args) >= 2 and args[0] in ("-m", "-c"):
            return ("module" if args[0] == "-m" else "code"), args[1], args[2:]
        if args and not args[0].startswith("-"):
            script = os.path.join(cwd, args[0])
            return ("script", script, args[1:]) if os.path.isfile(script) else None
        return None
    if os.path.isfile(first) and _shebang_is(first, executable):
        return "script", first, list(argv[1:])
    return None


def _shebang_is(path: str, executable: str) -> bool:
    try:
        with open(path, "rb") as f:
            line = f.readline(512)
    except OSError:
        return False
    return line.rstrip(b"\r\n") == b"#!" + os.fsencode(executable)


def _set_first_path(entry: str) -> None:
    """Put first on `sys.path` what the interpreter puts there for this argv, in place of the
    fork server's own script folder. Under PYTHONSAFEPATH (or -P) the interpreter puts nothing
    there, and the fork server's first entry is then PYTHONPATH's first: it stays (replacing it
    lost an overlay site of installed packages, scripts/gpu_check.sh's, for every child)."""
    if not getattr(sys.flags, "safe_path", False):  # -P / PYTHONSAFEPATH: Python 3.11+
        sys.path[0] = entry


def _run_as_main(kind: str, target: str, rest: list[str]) -> None:
    """Run ``target`` as `__main__`, as the interpreter would for that argv."""
    import runpy
    import types

    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    if kind == "module":
        sys.argv = ["-m", *rest]
        _set_first_path(os.getcwd())
        if not hasattr(sys.modules.get(target), "__path__"):  # a package runs its __main__
            sys.modules.pop(target, None)  # preloaded: run afresh as __main__, as `-m` does
        runpy._run_module_as_main(target, alter_argv=True)  # what `python -m` calls
        return
    if kind == "code":
        sys.argv = ["-c", *rest]
        _set_first_path("")
        exec(compile(target, "<string>", "exec"), main.__dict__)
        return
    sys.argv = [target, *rest]
    _set_first_path(os.path.dirname(target))
    main.__file__ = target
    source = Path(target).read_bytes()
    exec(compile(source, target, "exec"), main.__dict__)


def _user_frames(tb: TracebackType | None) -> TracebackType | None:
    """``tb`` without this module's own frames, as a fresh interpreter's traceback would read."""
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return tb


def _exit_code(code: object) -> int:
    """The process exit code for `SystemExit(code)`, as the interpreter computes it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _finish(code: int, interrupted: bool) -> None:
    """Exit as the interpreter does: join non-daemon threads, atexit, then `__main__`'s names
    dropped and a collection (so `__del__`s run and files left open are flushed and closed),
    flush, then the code. (Objects still referenced from elsewhere are not finalized, as the
    interpreter's own shutdown does not promise either.)"""
    import atexit
    import gc
    import threading

    with suppress(BaseException):  # a Ctrl-C while joining: exit anyway
        threading._shutdown()  # type: ignore[attr-defined]  # what Py_FinalizeEx calls first
    atexit._run_exitfuncs()
    with suppress(BaseException):
        sys.modules["__main__"].__dict__.clear()
        gc.collect()
    for stream in (sys.stdout, sys.stderr):
        with suppress(OSError, ValueError):
            stream.flush()
    if interrupted:  # an uncaught KeyboardInterrupt: the interpreter dies by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def _child(request: dict, fds: list[int], close: list[int]) -> None:
    """In the forked child: become the process `request` describes, run it, never return."""
    try:
        for fd in close:
            os.close(fd)
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if request["new_session"]:
            os.setsid()
        elif request["process_group"] >= 0:
            os.setpgid(0, request["process_group"])
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in set(fds):
            if fd > 2:
                os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _take_startup_settings(request["env"])
        _own_random_state()
        ForkClient(request["server"], request["server_env"]).install()  # its children fork too
        sys.orig_argv = [sys.executable, *request["argv"][1:]]
    except BaseException:
        import traceback

        traceback.print_exc()
        os._exit(127)
    code, interrupted = 0, False
    try:
        _run_as_main(*request["spec"])
    except SystemExit as exit_:
        code = _exit_code(exit_.code)
    except KeyboardInterrupt as error:  # printed, then the interpreter dies by SIGINT
        error = error.with_traceback(_user_frames(error.__traceback__))
        sys.excepthook(type(error), error, error.__traceback__)
        code, interrupted = 1, True
    except BaseException as error:
        error = error.with_traceback(_user_frames(error.__traceback__))
        sys.excepthook(type(error), error, error.__traceback__)
        code = 1
    _finish(code, interrupted)


# ---------------------------------------------------------------------------------------------
# The fork server process.


def serve(path: str, preload: Sequence[str] = ()) -> None:
    """Listen on the unix socket ``path``; fork a child per request; report each exit status.

    ``preload``: third-party modules imported ahead besides `PRELOAD` (a test module's own
    fork server: `ForkServer.start`).

    One connection per child: the request (JSON and the child's stdin/stdout/stderr as
    SCM_RIGHTS), then the reply `{"pid": ...}`, later `{"status": ...}` when it ends.
    Single-threaded, so that forking is safe; SIGCHLD wakes the loop through a pipe."""
    import importlib

    _die_with_parent()
    own_env = startup_env(os.environ)
    for name in (*PRELOAD, *OWN_PRELOAD, *preload):
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}
    print("ready", flush=True)
    while True:
        for key, _ in selector.select():
            if key.fileobj is listener:
                conn, _ = listener.accept()
                own = [listener.fileno(), wake_r, wake_w, selector.fileno()]
                _spawn(conn, children, own, {"server": path, "server_env": own_env})
            else:
                with suppress(BlockingIOError):
                    os.read(wake_r, 4096)
                _reap(children)


def _die_with_parent() -> None:
    """SIGKILL this fork server when the test worker that started it dies (Linux prctl), so a
    crashed worker leaves no process holding torch and a socket behind."""
    import ctypes

    parent = os.getppid()
    with suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the prctl
        os._exit(1)


def _spawn(
    conn: socket.socket, children: dict[int, socket.socket], own_fds: list[int], server: dict
) -> None:
    """Read one request from ``conn``, fork its child, answer its pid.

    ``server`` (this fork server's socket path and start-up environment) goes to the child,
    whose own children are then forked here too (torchrun's and Lightning's ranks...)."""
    try:
        message, fds = _recv_request(conn)
    except (OSError, ValueError) as err:
        print(f"forkserver: bad request: {err}", file=sys.stderr, flush=True)
        conn.close()
        return
    try:
        request = json.loads(message)
    except ValueError as err:
        print(f"forkserver: bad request: {err}", file=sys.stderr, flush=True)
        for fd in set(fds):
            os.close(fd)
        conn.close()
        return
    request.update(server)
    sys.stdout.flush()
    sys.stderr.flush()
    close = [*own_fds, *(c.fileno() for c in children.values()), conn.fileno()]
    try:
        pid = os.fork()
    except OSError as err:
        pid = -1
        with suppress(OSError):
            conn.sendall(json.dumps({"error": str(err)}).encode() + b"\n")
    if pid == 0:
        _child(request, fds, close)
    for fd in set(fds):
        os.close(fd)
    if pid < 0:
        conn.close()
        return
    children[pid] = conn
    with suppress(OSError):  # the test gave up on it (a timeout): _reap still reaps it
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")


def _reap(children: dict[int, socket.socket]) -> None:
    """Collect every ended child and send its wait status to whoever started it."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is None:
            continue
        with suppress(OSError):  # the test may have let its Popen go
            conn.sendall(json.dumps({"status": status}).encode() + b"\n")
        conn.close()


def _recv_request(conn: socket.socket) -> tuple[bytes, list[int]]:
    """One length-prefixed JSON message and the three file descriptors sent with it."""
    fds = array.array("i")
    header, ancillary, _, _ = conn.recvmsg(8, socket.CMSG_SPACE(3 * fds.itemsize))
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
    if len(header) != 8 or len(fds) != 3:
        for fd in fds:
            os.close(fd)
        raise ValueError("expected an 8-byte length and 3 descriptors")
    size = int.from_bytes(header, "big")
    body = b""
    try:
        while len(body) < size:
            chunk = conn.recv(size - len(body))
            if not chunk:
                raise ValueError("request cut short")
            body += chunk
    except (OSError, ValueError):
        for fd in fds:
            os.close(fd)
        raise
    return body, list(fds)


# ---------------------------------------------------------------------------------------------
# The test side.


class ForkClient:
    """What asks a fork server for children: decides, sends the request, counts."""

    def __init__(self, path: str, env: Mapping[str, str]) -> None:
        self.path = path
        self.env = dict(env)  # the fork server's start-up environment (`startup_env`)
        self.executable = sys.executable
        self.forked = 0
        self.execd: dict[str, int] = {}
        self._saved_popen: type[subprocess.Popen] | None = None

    def install(self) -> None:
        """Make `subprocess.Popen` (and so run/check_output/call) fork here when it can."""
        server = self

        class Bound(ForkedPopen):
            fork_server = server

        self._saved_popen = subprocess.Popen
        subprocess.Popen = Bound  # type: ignore[misc]

    def uninstall(self) -> None:
        if self._saved_popen is not None:
            subprocess.Popen = self._saved_popen  # type: ignore[misc]
            self._saved_popen = None

    @contextmanager
    def real_execs(self) -> Iterator[None]:
        """Within the block, `subprocess.Popen` is the real one (if it was installed)."""
        if self._saved_popen is None:
            yield
            return
        self.uninstall()
        try:
            yield
        finally:
            self.install()

    def reusable(self, argv: Sequence[str], options: Mapping[str, object]) -> str | None:
        """None when the fork server can start ``argv`` with Popen's ``options``, else why not."""
        for name, unset in (
            ("shell", False),
            ("preexec_fn", None),
            ("pass_fds", ()),
            ("uid", None),
            ("gid", None),
            ("gids", None),
            ("close_fds", True),
        ):
            if options[name] != unset:
                return name
        if options["umask"] >= 0:  # type: ignore[operator]
            return "umask"
        if options["executable"] not in (None, argv[0] if argv else None):
            return "executable"
        env = options["env"] if options["env"] is not None else os.environ
        changed = startup_env(env).items() ^ self.env.items()  # type: ignore[arg-type]
        if changed:
            return f"startup environment: {', '.join(sorted({k for k, _ in changed}))}"
        cwd = options["cwd"]
        if cwd is not None and not os.path.isdir(cwd):  # type: ignore[arg-type]
            return "cwd"
        if self.launch_spec(argv, options) is None:
            return f"not this interpreter's -m, -c or script: {os.path.basename(argv[0])}"
        return None

    def launch_spec(
        self, argv: Sequence[str], options: Mapping[str, object]
    ) -> tuple[str, str, list[str]] | None:
        """What the child runs (`_launch_spec`), with Popen's ``cwd`` and ``env`` options."""
        env = options["env"] if options["env"] is not None else os.environ
        cwd = os.path.abspath(os.fspath(options["cwd"] or os.getcwd()))  # type: ignore[call-overload]
        argv = [os.fspath(a) for a in argv]
        return _launch_spec(argv, self.executable, cwd, env.get("PATH"))  # type: ignore[union-attr]

    def spawn(
        self, argv: list[str], options: Mapping[str, object], fds: Sequence[int]
    ) -> socket.socket:
        """Ask for a child; returns the connection its pid (then its status) arrives on."""
        env = dict(options["env"] if options["env"] is not None else os.environ)  # type: ignore[call-overload]
        cwd = os.fspath(options["cwd"]) if options["cwd"] is not None else os.getcwd()  # type: ignore[call-overload]
        request = {
            "argv": argv,
            "spec": self.launch_spec(argv, options),
            "env": env,
            "cwd": os.path.abspath(cwd),
            "new_session": bool(options["start_new_session"]),
            "process_group": options["process_group"],
        }
        body = json.dumps(request).encode()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.path)
        conn.sendmsg(
            [len(body).to_bytes(8, "big")],
            [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))],
        )
        conn.sendall(body)
        self.forked += 1
        return conn


class ForkServer(ForkClient):
    """A running fork server (a child of this process) and the client that asks it."""

    def __init__(self, proc: subprocess.Popen, path: str, tmp: tempfile.TemporaryDirectory) -> None:
        super().__init__(path, startup_env(os.environ))
        self.proc = proc
        self._tmp = tmp

    @classmethod
    @contextmanager
    def start(cls, timeout: float = 120.0, preload: Sequence[str] = ()) -> Iterator[ForkServer]:
        """Start one, wait until its imports are done, stop it on exit. ``preload``: more
        third-party modules to import ahead, for a test module whose children all import them
        (tests/e2e/test_frameworks.py: Lightning, 1.4 s of CPU in each of its ranks)."""
        tmp = tempfile.TemporaryDirectory(prefix="bw-forkserver-")
        path = os.path.join(tmp.name, "fork.sock")
        proc = subprocess.Popen(
            [sys.executable, __file__, path, *preload],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        server = cls(proc, path, tmp)
        try:
            line = proc.stdout.readline()  # type: ignore[union-attr]
            if line.strip() != b"ready":
                raise RuntimeError(f"fork server did not start (exit {proc.wait(timeout)})")
            yield server
        finally:
            server.uninstall()
            proc.kill()
            proc.wait()
            proc.stdout.close()  # type: ignore[union-attr]
            tmp.cleanup()


class ForkedPopen(subprocess.Popen):
    """`subprocess.Popen`, started by `fork_server` when `reusable` allows, else as usual."""

    fork_server: ForkClient
    _status_conn: socket.socket | None = None
    _status_buf = b""
    _status_lost = False  # the fork server died: returncode says 255, the child may live on

    def send_signal(self, sig: int) -> None:
        """Popen's, except that a child whose status was lost can still be signalled (its
        returncode, 255, says nothing of whether it runs)."""
        if not self._status_lost:
            super().send_signal(sig)
            return
        with suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def _execute_child(  # type: ignore[override]
        self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
        creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
        restore_signals, gid, gids, uid, umask, start_new_session, process_group,
    ):  # fmt: skip
        argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
        options = {
            "shell": shell, "preexec_fn": preexec_fn, "pass_fds": tuple(pass_fds), "uid": uid,
            "gid": gid, "gids": gids, "close_fds": close_fds, "umask": umask,
            "executable": executable, "env": env, "cwd": cwd,
            "start_new_session": start_new_session, "process_group": process_group,
        }  # fmt: skip
        server = self.fork_server
        why = None if all(isinstance(a, (str, os.PathLike)) for a in argv) else "bytes argv"
        why = why or server.reusable(argv, options)
        if why is not None:
            server.execd[why] = server.execd.get(why, 0) + 1
            return super()._execute_child(
                args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                restore_signals, gid, gids, uid, umask, start_new_session, process_group,
            )  # fmt: skip
        fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1]
        fds.append(errwrite if errwrite != -1 else 2)
        conn = server.spawn([os.fspath(a) for a in argv], options, fds)
        self._status_conn = conn
        try:
            reply = self._read_message(None)
            if reply is None or "pid" not in reply:
                raise OSError(f"the fork server did not start {argv}: {reply}")
            self.pid = reply["pid"]
        except BaseException:
            conn.close()
            self._status_conn = None
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
            raise
        self._child_created = True
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)

    def _read_message(self, timeout: float | None) -> dict | None:
        """The next line from the fork server, or None if none came within ``timeout``."""
        conn = self._status_conn
        assert conn is not None
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._status_buf:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            conn.settimeout(remaining)
            try:
                chunk = conn.recv(4096)
            except (TimeoutError, BlockingIOError):
                return None
            if not chunk:  # the fork server died: the status is lost
                self._status_lost = True
                return {"status": _STATUS_UNKNOWN}
            self._status_buf += chunk
        line, _, self._status_buf = self._status_buf.partition(b"\n")
        return json.loads(line)

    def _collect(self, timeout: float | None) -> None:
        """Set `returncode` if the status arrived within ``timeout`` (0: just look)."""
        if self._status_conn is None:
            return
        message = self._read_message(timeout)
        if message is not None:
            self._handle_exitstatus(message["status"])
            self._status_conn.close()
            self._status_conn = None

    def _internal_poll(  # the signature Popen calls it with (__del__ passes _deadstate)
        self, _deadstate=None, _waitpid=os.waitpid, _WNOHANG=os.WNOHANG, _ECHILD=10
    ):
        if self._status_conn is None and self.returncode is None:
            return super()._internal_poll(_deadstate, _waitpid, _WNOHANG, _ECHILD)
        if self.returncode is None and self._waitpid_lock.acquire(False):
            try:
                if self.returncode is None:
                    self._collect(0)
            except OSError:
                if _deadstate is not None:
                    self.returncode = _deadstate
            finally:
                self._waitpid_lock.release()
        return self.returncode

    def _wait(self, timeout):
        if self._status_conn is None:
            return super()._wait(timeout)
        endtime = None if timeout is None else time.monotonic() + timeout
        # Another thread may be waiting already: as Popen's own wait, give up on time.
        if not self._waitpid_lock.acquire(timeout=-1 if timeout is None else max(timeout, 0)):
            raise subprocess.TimeoutExpired(self.args, timeout)
        try:
            if self.returncode is None and self._status_conn is not None:
                self._collect(0)  # already over: a wait(0) sees it
            while self.returncode is None:
                remaining = None if endtime is None else endtime - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                self._collect(remaining)
        finally:
            self._waitpid_lock.release()
        return self.returncode


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2:])
