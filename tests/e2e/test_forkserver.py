"""The suite's fork server (tests/forkserver.py) starts children that behave as fresh interpreters.

Each case runs twice, through the fork server and as a real exec, and the two must agree on
exit code, stdout and stderr: exit codes and `SystemExit` messages, an uncaught error's
traceback, signals, atexit handlers and non-daemon threads at exit, pipes both ways, the
environment and working directory, `-m`, `-c`, scripts and console scripts. And what must not
be forked (a changed interpreter-start environment, a `preexec_fn`) is exec'd for real.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from forkserver import ForkServer

CASES = {
    "exit code": ["-c", "import sys; print('out'); sys.exit(3)"],
    "exit message": ["-c", "import sys; sys.exit('bad thing')"],
    "uncaught error": ["-c", "def f():\n    raise ValueError('boom')\nf()"],
    "stdin to stdout": ["-c", "import sys; print(sys.stdin.read().upper(), end='')"],
    "argv": ["-c", "import sys; print(sys.argv)", "a", "--b"],
    "atexit after a thread": [
        "-c",
        "import atexit, threading, time\n"
        "atexit.register(lambda: print('atexit', flush=True))\n"
        "threading.Thread(target=lambda: (time.sleep(0.2), print('thread', flush=True))).start()\n"
        "print('main', flush=True)",
    ],
    "environment and cwd": ["-c", "import os; print(os.getcwd(), os.environ['BW_FORK_PROBE'])"],
    "module": ["-m", "json.tool", "--sort-keys"],
    "module argv0": ["-m", "batchwire.wire.keys", "--help"],
    "missing module": ["-m", "no_such_module_anywhere"],
    "__main__ name": ["-c", "print(__name__)"],
    "__del__ at exit": ["-c", "class A:\n    def __del__(self):\n        print('del')\na = A()"],
    "uncaught KeyboardInterrupt": ["-c", "raise KeyboardInterrupt"],
    "a file left open is flushed": [
        "-c",
        "f = open('left-open.txt', 'w'); f.write('data')\n"
        "import atexit; atexit.register(lambda: print('atexit'))",
    ],
}


def _run(argv: list[str], cwd: Path) -> tuple[int, str, str]:
    env = {**os.environ, "BW_FORK_PROBE": "probe"}
    done = subprocess.run(
        argv, input='{"b": 1, "a": 2}', capture_output=True, text=True, cwd=cwd, env=env,
        timeout=60,
    )  # fmt: skip
    return done.returncode, done.stdout, done.stderr


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_forked_child_behaves_as_a_fresh_interpreter(
    case: str, fork_server: ForkServer | None, tmp_path: Path
) -> None:
    if fork_server is None:
        pytest.skip("the fork server is off (BATCHWIRE_TEST_FORKSERVER=0)")
    argv = [sys.executable, *CASES[case]]
    forked_before = fork_server.forked
    forked = _run(argv, tmp_path)
    assert fork_server.forked == forked_before + 1, "the fork server did not start it"
    forked_files = {p.name: p.read_text() for p in tmp_path.iterdir()}
    for p in tmp_path.iterdir():
        p.unlink()
    with fork_server.real_execs():
        fresh = _run(argv, tmp_path)
    assert forked == fresh
    assert forked_files == {p.name: p.read_text() for p in tmp_path.iterdir()}


def test_a_console_script_is_forked_and_answers_as_exec_d(
    fork_server: ForkServer | None, tmp_path: Path
) -> None:
    if fork_server is None:
        pytest.skip("the fork server is off (BATCHWIRE_TEST_FORKSERVER=0)")
    script = str(Path(sys.executable).parent / "pipeline-keys")
    before = fork_server.forked
    forked = _run([script, "--help"], tmp_path)
    assert fork_server.forked == before + 1
    with fork_server.real_execs():
        assert forked == _run([script, "--help"], tmp_path)


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, -15), (signal.SIGINT, -2)])
def test_signals_end_a_forked_child_as_they_end_an_interpreter(
    sig: int, code: int, fork_server: ForkServer | None
) -> None:
    if fork_server is None:
        pytest.skip("the fork server is off (BATCHWIRE_TEST_FORKSERVER=0)")
    probe = "import sys, time\nprint('up', flush=True)\ntime.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", probe], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "up\n"
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(0.1)
        assert proc.poll() is None
        proc.send_signal(sig)
        assert proc.wait(10) == code
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def test_what_a_fork_would_change_is_exec_d_for_real(fork_server: ForkServer | None) -> None:
    if fork_server is None:
        pytest.skip("the fork server is off (BATCHWIRE_TEST_FORKSERVER=0)")
    probe = "import sys; print('torch' in sys.modules)"
    argv = [sys.executable, "-c", probe]
    fresh_env = {**os.environ, "PYTHONHASHSEED": "7"}
    cases = [({}, "True"), ({"env": fresh_env}, "False"), ({"preexec_fn": os.getpid}, "False")]
    for options, torch_loaded in cases:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, **options)
        assert done.stdout.strip() == torch_loaded, (options, done.stderr)
    assert fork_server.execd.get("startup environment: PYTHONHASHSEED", 0) >= 1
    assert fork_server.execd.get("preexec_fn", 0) >= 1


def test_thread_counts_and_warning_options_reach_a_forked_child(
    fork_server: ForkServer | None,
) -> None:
    if fork_server is None:
        pytest.skip("the fork server is off (BATCHWIRE_TEST_FORKSERVER=0)")
    probe = "import sys, torch; print(torch.get_num_threads(), sys.warnoptions)"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore::UserWarning"}
    before = fork_server.forked
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert fork_server.forked == before + 1
    assert done.stdout.split(maxsplit=1) == ["1", "['ignore::UserWarning']\n"], done.stderr


def test_variables_torch_reads_when_used_reach_a_forked_child(
    fork_server: ForkServer | None, tmp_path: Path
) -> None:
    """torch and Lightning set these in a running test worker (torch's inductor cache folder,
    Lightning's NVML check); torch reads them when it needs them, so a fork serves."""
    if fork_server is None:
        pytest.skip("the fork server is off (BATCHWIRE_TEST_FORKSERVER=0)")
    probe = (
        "import torch; from torch._inductor.runtime.cache_dir_utils import cache_dir; "
        "print(cache_dir(), torch.cuda._nvml_based_avail())"
    )
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
        "PYTORCH_NVML_BASED_CUDA_CHECK": "1",
    }
    before = fork_server.forked
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert fork_server.forked == before + 1, fork_server.execd
    assert done.stdout.split() == [str(tmp_path / "inductor"), "True"], done.stderr


def test_a_dead_fork_server_fails_its_children_s_waits_instead_of_hanging() -> None:
    with ForkServer.start() as server:
        server.install()
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        server.uninstall()
        server.proc.kill()
        server.proc.wait()
        started = time.monotonic()
        assert proc.wait(10) == 255
        assert time.monotonic() - started < 10
        proc.kill()  # its status is lost, not the child: it can still be stopped
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the child outlived kill()")


def test_a_wait_with_a_timeout_returns_on_time_while_another_thread_waits(
    fork_server: ForkServer | None,
) -> None:
    if fork_server is None:
        pytest.skip("the fork server is off (BATCHWIRE_TEST_FORKSERVER=0)")
    import threading

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"])
    waiter = threading.Thread(target=proc.wait)
    waiter.start()
    time.sleep(0.2)
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.5)
    assert time.monotonic() - started < 1.5
    proc.kill()
    waiter.join(10)
    assert proc.returncode == -9


def test_a_forked_child_s_own_python_children_are_forked_too(
    fork_server: ForkServer | None,
) -> None:
    """torchrun's and Lightning's ranks are children of a child: `-u script`, `-m`, `-c`."""
    if fork_server is None:
        pytest.skip("the fork server is off (BATCHWIRE_TEST_FORKSERVER=0)")
    probe = (
        "import subprocess, sys\n"
        "child = [sys.executable, '-u', '-c', \"import sys; print('torch' in sys.modules)\"]\n"
        "print(subprocess.run(child, capture_output=True, text=True, check=True).stdout, end='')\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.stdout == "True\n", done.stderr  # torch was there before the grandchild ran


@pytest.mark.skipif(sys.version_info < (3, 11), reason="PYTHONSAFEPATH is Python 3.11's")
def test_a_safe_path_interpreter_keeps_pythonpath_first_in_a_forked_child(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under PYTHONSAFEPATH the interpreter puts no script folder or working directory first on
    sys.path, so PYTHONPATH's first entry is first; a forked child must keep it. (The GPU check
    installs batchwire into an overlay site on PYTHONPATH with PYTHONSAFEPATH=1: every server
    a CUDA test started was forked without that site and could not import batchwire.)"""
    site = tmp_path / "site"
    (site / "bw_overlay_probe").mkdir(parents=True)
    (site / "bw_overlay_probe" / "__init__.py").write_text("")
    (site / "bw_overlay_probe" / "__main__.py").write_text(
        "import sys; print('imported', sys.argv[1:], sys.path[0])"
    )
    script = tmp_path / "script.py"
    script.write_text("import bw_overlay_probe, sys; print('script', sys.path[0])")
    monkeypatch.setenv("PYTHONSAFEPATH", "1")
    monkeypatch.setenv("PYTHONPATH", str(site))
    argvs = [
        [sys.executable, "-m", "bw_overlay_probe", "arg"],
        [sys.executable, "-c", "import bw_overlay_probe, sys; print('code', sys.path[0])"],
        [sys.executable, str(script)],
    ]
    fresh = [_run(argv, tmp_path) for argv in argvs]  # real execs: this environment is new
    with ForkServer.start() as server:
        server.install()
        try:
            forked = [_run(argv, tmp_path) for argv in argvs]
        finally:
            server.uninstall()
        assert server.forked == len(argvs), server.execd
    assert fresh[0] == (0, f"imported ['arg'] {site}\n", "")
    assert forked == fresh


def test_forked_children_draw_their_own_random_numbers(
    fork_server: ForkServer | None, tmp_path: Path
) -> None:
    """torch and numpy, imported ahead, would hand every child the fork server's generator
    state; fresh interpreters each draw their own (Python's `random` reseeds itself)."""
    if fork_server is None:
        pytest.skip("the fork server is off (BATCHWIRE_TEST_FORKSERVER=0)")
    code = (
        "import numpy, torch; "
        "print(torch.initial_seed(), torch.rand(1).item(), numpy.random.rand())"
    )
    before = fork_server.forked
    draws = [_run([sys.executable, "-c", code], tmp_path) for _ in range(2)]
    assert fork_server.forked == before + 2
    (torch_a, rand_a, np_a), (torch_b, rand_b, np_b) = (d[1].split() for d in draws)
    assert torch_a != torch_b and rand_a != rand_b and np_a != np_b, draws


def test_python_m_of_a_package_imported_ahead_keeps_one_package_object(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`python -m PACKAGE` runs its __main__; a package the fork server imported ahead (as
    `batchwire.server`) must stay the one package object, its submodules its attributes."""
    pkg = tmp_path / "site" / "preloadedpkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub.py").write_text("")
    (pkg / "__main__.py").write_text(
        "import sys\n"
        "import preloadedpkg.sub\n"
        "print(sys.modules['preloadedpkg'].sub is sys.modules['preloadedpkg.sub'])\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(pkg.parent))  # the fork server's and the children's
    argv = [sys.executable, "-m", "preloadedpkg"]
    with ForkServer.start(preload=["preloadedpkg.sub"]) as server:
        server.install()
        try:
            forked = _run(argv, tmp_path)
        finally:
            server.uninstall()
        assert server.forked == 1, server.execd
    assert forked == (0, "True\n", "")
