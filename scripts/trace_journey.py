"""Print one batch's journey through batchwire, traced: its hops per thread and its calls back.

    .venv/bin/python scripts/trace_journey.py [--batch 3]

ARCHITECTURE.md's "The journey of one batch" quotes the summary this prints (and
tests/e2e/test_journey_doc.py keeps the two equal), so the map is measured, not written by hand.

What runs: a real `pipeline-server` child (`SERVER_ARGS`: the embedded dataset, batch 4 of
32 px, CPU decoding on the producer threads (`--workers 1`, the default wherever the producers
fill the cores), everything else the defaults) and, in this process, one
`RemoteLoader(prefetch=1)` that takes `batch + 2` batches. A profile hook
(`threading.setprofile`/`sys.setprofile`; in the server through a `sitecustomize` on
PYTHONPATH) records every call between batchwire files in both processes, with a timestamp of
the machine's monotonic clock, which both processes share.

The rules:
- A hop is a call whose caller and callee are in different batchwire modules (a product file of
  one of the packages of tests/unit/test_import_rules.py's `ALLOWED`). Frames of anything else
  (the standard library, torch, zmq, this script) are looked through: the caller is the
  innermost batchwire frame below the callee, at the line it is executing. A function a
  thread pool runs is called by the batchwire frame that submitted it. Code that runs on an
  attribute read or an operator is not a hop (the caller writes no call): properties, and
  dunders but `__init__`, `__post_init__` and `__call__`.
- One batch's share: one batch is asked at a time (`prefetch=1`): the client asks for batch K
  when it hands K-1 out (`Fleet.on_handed_out(K-1)` makes the credit). The client's share is
  every call from that ask to its ask for K+1: sending the credit, receiving, staging, handing
  out, recycling an older batch. The server's, in whole turns of its loop: from its receiving
  the ask for K to the end of the turn that receives the ask for K+1 (up to its tick), every
  call of the loop thread (receiving, scheduling, submitting, collecting, sending, releasing
  the sent buffer, and the turns that find nothing to do meanwhile) and of the producer
  threads (the script checks that they planned batch K and no other). The release of a sent
  buffer races the next ask; a window in whole turns holds it either way (it may hold the
  previous batch's release too: the same calls).
- Loops and recursion collapse: a thread's hops are its distinct edges (caller file:line and
  function -> callee file and function), in the order each is first made. Threads of one
  role (the producer threads, a decoder's pool) are one list. Each thread's line also counts
  its hops in coarser units (`coarser`): distinct pairs of modules, and of packages.
- A call back is a hop that is not a call down the dependency graph: "up", the callee's
  module imports the caller's (for two packages: the callee's package sits above the caller's
  in the import table, `ALLOWED`'s closure), or "handed", neither module imports the other
  (the caller calls an object or function it was given: a callback, a decoder it was handed).
  The module graph is the import test's (`all_imports`: every import, lazy and type-only too).
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib.util
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_BATCH = 3
BATCH_SIZE = 4
SERVER_ARGS = ("--batch-size", str(BATCH_SIZE), "--image-size", "32", "--workers", "1")
ENV_OUT = "BW_TRACE_JOURNEY_OUT"  # the server child writes its calls here at exit
ENV_ROOTS = "BW_TRACE_JOURNEY_ROOTS"  # the batchwire folders, os.pathsep-separated
SUMMARY_START = "journey of batch"  # the summary's first line starts so (the doc quotes it)

# ---------------------------------------------------------------------------- recording

#: One call between batchwire files: (monotonic ns, thread name, caller file or "", caller
#: line, caller function, callee file, callee function, callee's first line, the marker's
#: argument or None).
Call = tuple[int, str, str, int, str, str, str, int, Any]

#: Callees whose argument the recorder keeps: the client's asks (`Fleet.on_handed_out(k)`
#: asks for the batch after k) bound the windows; the batches the producers plan check them.
HANDED_OUT = "Fleet.on_handed_out"
PLAN = "ShardSampler.plan"
MARKERS = {HANDED_OUT: "k", PLAN: "batch_index"}
#: The server loop's calls that bound its window (caller, callee).
LOOP_RECEIVES = ("ServerApp._receive", "RouterSocket.receive")
LOOP_TICKS = ("ServerApp._loop", "ServerCore.tick")


def _qualname(frame: FrameType) -> str:
    code = frame.f_code
    return getattr(code, "co_qualname", code.co_name)


class Recorder:
    """The profile hook: keeps every call whose callee is in a batchwire file and whose
    caller (the innermost batchwire frame below it, or the frame that submitted it to a
    thread pool) is in another one."""

    def __init__(self, roots: Iterable[str]) -> None:
        self.roots = tuple(str(r).rstrip(os.sep) + os.sep for r in roots)
        self.calls: list[Call] = []
        self._submitted: dict[object, tuple[str, int, str]] = {}  # code -> submitter
        from concurrent.futures import ThreadPoolExecutor

        self._submit_code = ThreadPoolExecutor.submit.__code__

    def _caller(self, frame: FrameType | None) -> FrameType | None:
        while frame is not None and not frame.f_code.co_filename.startswith(self.roots):
            frame = frame.f_back
        return frame

    def _note_submit(self, frame: FrameType) -> None:
        fn = frame.f_locals.get("fn")
        code = getattr(getattr(fn, "__func__", fn), "__code__", None)
        caller = self._caller(frame.f_back)
        if code is not None and caller is not None:
            where = (caller.f_code.co_filename, caller.f_lineno, _qualname(caller))
            self._submitted[code] = where

    def profile(self, frame: FrameType, event: str, arg: object) -> None:
        if event != "call":
            return
        code = frame.f_code
        if code is self._submit_code:
            self._note_submit(frame)
            return
        callee = code.co_filename
        if not callee.startswith(self.roots):
            return
        caller = self._caller(frame.f_back)
        if caller is not None:
            where = (caller.f_code.co_filename, caller.f_lineno, _qualname(caller))
        else:  # a thread's first batchwire frame: a pool's task, or a thread's body
            where = self._submitted.get(code, ("", 0, ""))
        if where[0] == callee:
            return
        name = _qualname(frame)
        arg_name = MARKERS.get(name)
        marker = None if arg_name is None else frame.f_locals.get(arg_name)
        thread = threading.current_thread().name
        first = code.co_firstlineno
        self.calls.append((time.monotonic_ns(), thread, *where, callee, name, first, marker))

    def start(self) -> None:
        threading.setprofile(self.profile)
        sys.setprofile(self.profile)

    def stop(self) -> None:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]


def record_server_calls() -> None:
    """Run by the server child's `sitecustomize`: record from now on, write at exit.

    `pipeline-server` leaves by ``os._exit`` (no interpreter teardown, no atexit): the hook
    writes before it, in this traced child only."""
    recorder = Recorder(os.environ[ENV_ROOTS].split(os.pathsep))
    out = Path(os.environ[ENV_OUT])
    exit_now = os._exit

    def write_then_exit(code: int) -> None:
        recorder.stop()
        out.write_text(json.dumps(recorder.calls))
        exit_now(code)

    os._exit = write_then_exit  # type: ignore[assignment]
    recorder.start()


SITECUSTOMIZE = f"""\
import os
if os.environ.get({ENV_OUT!r}):
    import trace_journey
    trace_journey.record_server_calls()
"""

# ---------------------------------------------------------------------------- the run


def import_rules() -> ModuleType:
    """tests/unit/test_import_rules.py: the layer table and the module import graph."""
    path = REPO / "tests" / "unit" / "test_import_rules.py"
    spec = importlib.util.spec_from_file_location("_import_rules", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class Traced:
    """A recorded call, with the process it was made in ("server" or "client")."""

    process: str
    t_ns: int
    thread: str
    caller_file: str  # "" where no batchwire frame called it (a thread's body)
    caller_line: int
    caller_func: str
    callee_file: str
    callee_func: str
    callee_line: int  # the callee's first line (its first decorator's, if any)
    marker: Any  # the argument `MARKERS` names for this callee, else None


def run_traced(batch: int) -> list[Traced]:
    """Serve `batch + 2` batches to one RemoteLoader, both processes traced: every call."""
    from batchwire.client import RemoteLoader
    from batchwire.common.launcher import PipelineServer, free_tcp_endpoint
    from batchwire.pipeline.synthetic import default_dataset

    rules = import_rules()
    roots = [str(rules.folder_of(pkg)) for pkg in rules.ALLOWED]
    data = str(default_dataset().val_root)
    with tempfile.TemporaryDirectory(prefix="bw-journey-") as tmp:
        Path(tmp, "sitecustomize.py").write_text(SITECUSTOMIZE)
        out = Path(tmp, "server-calls.json")
        paths = (tmp, str(REPO / "scripts"), os.environ.get("PYTHONPATH", ""))
        env = {
            ENV_OUT: str(out),
            ENV_ROOTS: os.pathsep.join(roots),
            "PYTHONPATH": os.pathsep.join(p for p in paths if p),
        }
        log = Path(tmp, "server.log")
        server = PipelineServer(
            ("--train", data, *SERVER_ARGS), free_tcp_endpoint(), env=env, log_path=log
        )
        recorder = Recorder(roots)
        server.start()
        try:
            with RemoteLoader(server.endpoint, prefetch=1, timeout=30.0) as loader:
                recorder.start()
                try:
                    for taken, _ in enumerate(loader, 1):
                        if taken == batch + 2:
                            break
                finally:
                    recorder.stop()
        finally:
            stopped = server.stop()
        if stopped.returncode != 0 or not out.exists():
            raise RuntimeError(f"the traced server did not exit cleanly:\n{log.read_text()}")
        server_calls = json.loads(out.read_text())
    return [Traced("server", *c) for c in server_calls] + [
        Traced("client", *c) for c in recorder.calls
    ]


# ---------------------------------------------------------------------------- the journey


@dataclass(frozen=True)
class Hop:
    role: str  # "server, loop thread", ...
    caller: str  # "server/app.py"
    line: int
    caller_func: str
    callee: str
    callee_func: str
    back: str  # "" (a call down), "up" or "handed"

    def __str__(self) -> str:
        text = f"{self.caller}:{self.line} {self.caller_func} -> {self.callee} {self.callee_func}"
        return f"{text}  [back: {self.back}]" if self.back else text

    def summary(self) -> str:
        """The call back without its line (the doc quotes it; lines move with every edit)."""
        return f"{self.back}: {self.caller} {self.caller_func} -> {self.callee} {self.callee_func}"


def role(process: str, thread: str) -> str:
    """Threads by what they do; the threads of a pool are one role."""
    if thread == "MainThread":
        return "client, consumer thread" if process == "client" else "server, loop thread"
    if thread.startswith("bw-producer-"):
        return f"{process}, producer threads"
    if thread.startswith("bw-decode"):
        return f"{process}, decoder pool threads"
    return f"{process}, thread {thread.rstrip('0123456789_-')}"


def windows(calls: list[Traced], batch: int) -> dict[str, tuple[int, int]]:
    """Each process's share of the batch's journey, [start, end) in monotonic ns.

    The client's: from its ask for `batch` to its ask for the next one. The server loop's,
    in whole loop turns: from its receiving the ask for `batch` to the end of the turn that
    receives the next ask (its tick), so that the release of the batch's buffer, in the turn
    before or in that one, is inside (module docstring)."""
    calls = sorted(calls, key=lambda c: c.t_ns)

    def first(process: str, caller: str, callee: str, after: int, what: str) -> int:
        for c in calls:
            if c.t_ns >= after and (c.process, c.caller_func, c.callee_func) == (
                process,
                caller,
                callee,
            ):
                return c.t_ns
        raise RuntimeError(f"the trace has no {caller} -> {callee} {what}")

    def asked(k: int) -> int:
        for c in calls:
            if c.process == "client" and c.callee_func == HANDED_OUT and c.marker == k - 1:
                return c.t_ns
        raise RuntimeError(f"the trace has no {HANDED_OUT}({k - 1}): too few batches taken")

    ask, ask_next = asked(batch), asked(batch + 1)
    received = first("server", *LOOP_RECEIVES, ask, f"of the ask for {batch}")
    received_next = first("server", *LOOP_RECEIVES, ask_next, f"of the ask for {batch + 1}")
    turn_end = first("server", *LOOP_TICKS, received_next, f"after the ask for {batch + 1}")
    return {"client": (ask, ask_next), "server": (received, turn_end)}


class Layers:
    """Which way a call goes, from tests/unit/test_import_rules.py's table and graph."""

    def __init__(self, rules: ModuleType) -> None:
        self.rules = rules
        edges: dict[str, set[str]] = {}
        for imp in rules.all_imports():
            edges.setdefault(imp.importer, set()).add(imp.target)
        self.modules = _closure(edges)
        self.packages = _closure({pkg: set(allowed) for pkg, allowed in rules.ALLOWED.items()})

    def _depends(self, a: str, b: str) -> bool:
        """Module `a` imports module `b`, directly or not (or `a`'s package is above `b`'s)."""
        pa, pb = self.rules.package_of(a), self.rules.package_of(b)
        if pa != pb:
            return pb == self.rules.ROOT or pb in self.packages.get(pa, set())
        return b in self.modules.get(a, set())

    def direction(self, caller: str, callee: str) -> str:
        """ "" for a call down, "up" or "handed" for a call back (module docstring)."""
        a = self.rules.module_name(REPO / caller)
        b = self.rules.module_name(REPO / callee)
        if self._depends(a, b):
            return ""
        return "up" if self._depends(b, a) else "handed"


def _closure(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """Everything each node reaches."""
    reach: dict[str, set[str]] = {}
    for start in edges:
        seen: set[str] = set()
        todo = list(edges[start])
        while todo:
            node = todo.pop()
            if node not in seen:
                seen.add(node)
                todo += edges.get(node, ())
        reach[start] = seen
    return reach


def journey(calls: list[Traced], batch: int, layers: Layers) -> dict[str, list[Hop]]:
    """Each role's distinct hops inside the batch's window, in order (roles in the order of
    their first hop)."""
    bounds = windows(calls, batch)
    inside = [c for c in calls if bounds[c.process][0] <= c.t_ns < bounds[c.process][1]]
    planned = [c.marker for c in inside if c.callee_func == PLAN]
    if planned != [batch]:
        raise RuntimeError(
            f"the producers planned batches {planned} in batch {batch}'s window, not just it: "
            "the windows assume one batch in flight at a time"
        )
    hops: dict[str, dict[tuple, Hop]] = {}
    for c in sorted(inside, key=lambda c: c.t_ns):
        if not c.caller_file:
            continue
        if not written_as_call(c.callee_file, c.callee_func, c.callee_line):
            continue
        caller, callee = _rel(c.caller_file), _rel(c.callee_file)
        hop = Hop(
            role(c.process, c.thread),
            caller,
            c.caller_line,
            c.caller_func,
            callee,
            c.callee_func,
            layers.direction(caller, callee),
        )
        hops.setdefault(hop.role, {}).setdefault(
            (caller, c.caller_line, c.caller_func, callee, c.callee_func), hop
        )
    return {r: list(edges.values()) for r, edges in hops.items()}


#: Dunders a caller writes as a call: constructing (`__init__`, a dataclass's `__post_init__`)
#: and calling an instance.
_CALLED_DUNDERS = ("__init__", "__post_init__", "__call__")


def written_as_call(path: str, func: str, first_line: int) -> bool:
    """False for code that runs on an attribute read or an operator, not a call the caller
    writes: properties and dunders (`__len__`, `__bool__`, `__iter__`, ...)."""
    name = func.rpartition(".")[2]
    if name.startswith("__") and name.endswith("__") and name not in _CALLED_DUNDERS:
        return False
    return first_line not in _property_lines(path)


@functools.cache
def _property_lines(path: str) -> frozenset[int]:
    """The first lines (a code object's `co_firstlineno`: its first decorator's) of the
    file's properties."""
    lines = set()
    for node in ast.walk(ast.parse(Path(path).read_text(), path)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
            _is_property(d) for d in node.decorator_list
        ):
            lines.add(min([node.lineno, *(d.lineno for d in node.decorator_list)]))
    return frozenset(lines)


def _is_property(decorator: ast.expr) -> bool:
    """``@property``, ``@functools.cached_property``, ``@name.setter``/``.getter``."""
    if isinstance(decorator, ast.Name):
        return decorator.id in ("property", "cached_property")
    if isinstance(decorator, ast.Attribute):
        return decorator.attr in ("cached_property", "setter", "getter", "deleter")
    return False


def _rel(path: str) -> str:
    return Path(path).resolve().relative_to(REPO).as_posix()


def _package(path: str) -> str:
    """A product file's top folder: `pipeline/decode/cpu.py` -> `pipeline`."""
    return path.split("/", 1)[0]


def coarser(role_hops: list[Hop]) -> tuple[int, int]:
    """The same hops counted in coarser units: distinct (caller module, callee module) pairs
    and distinct pairs of different packages. The hop stays the unit of the target; these
    say how much of the count is calls inside one module pair or one package."""
    modules = {(h.caller, h.callee) for h in role_hops}
    packages = {(_package(a), _package(b)) for a, b in modules if _package(a) != _package(b)}
    return len(modules), len(packages)


def summary(hops: dict[str, list[Hop]], batch: int) -> list[str]:
    """The lines ARCHITECTURE.md quotes: totals per thread, and the calls back."""
    every = [h for role_hops in hops.values() for h in role_hops]
    back = [h for h in every if h.back]
    lines = [
        f"{SUMMARY_START} {batch}: {len(every)} hops, {len(back)} calls back "
        f"(pipeline-server {' '.join(SERVER_ARGS)}; RemoteLoader(prefetch=1))"
    ]
    for r, role_hops in hops.items():
        modules, packages = coarser(role_hops)
        lines.append(
            f"  {r}: {len(role_hops)} hops ({modules} module pairs, {packages} package pairs), "
            f"{sum(bool(h.back) for h in role_hops)} back"
        )
    lines.append("calls back:")
    lines += [f"  {h.summary()}" for h in back]
    return lines


def report(hops: dict[str, list[Hop]], batch: int) -> Iterator[str]:
    """Every hop, numbered per thread, then the summary."""
    for r, role_hops in hops.items():
        yield f"{r}: {len(role_hops)} hops"
        for i, hop in enumerate(role_hops, 1):
            yield f"  {i:2d}. {hop}"
        yield ""
    yield from summary(hops, batch)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--batch", type=int, default=DEFAULT_BATCH, help="the batch to follow (at least 1)"
    )
    args = parser.parse_args(argv)
    if args.batch < 1:
        parser.error("--batch must be at least 1: batch 0 is asked by the hello, not a credit")
    hops = journey(run_traced(args.batch), args.batch, Layers(import_rules()))
    for line in report(hops, args.batch):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
