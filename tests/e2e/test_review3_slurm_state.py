"""Review 3 (cf75f09): the Slurm recipe's server exit files (BATCHWIRE_STATE/JOB_ID.RUN/NODE)
outlive the job, and the readiness wait takes any file there as this job's server exiting.

An operator's day: BATCHWIRE_STATE is the default `./batchwire-state` of the folder jobs are
submitted from, and a job ID comes round again (the cluster's Slurm was reinstalled and counts
from FirstJobId again, or a second cluster shares the home filesystem). The earlier job 8's
server on n2 exited 2 (its data mount was missing); today's job 8 runs on n2 too, its servers
are healthy, and it must start its trainers, not end at once blaming n2.

Run by bash against stand-in Slurm commands, as tests/e2e/test_review2_slurm_readiness.py
does: srun's server step here is a real HTTP server answering /readyz 200 for both nodes, the
trainer step ends at once (exit 0).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Both server tasks stand for healthy servers: one /readyz answering 200 on every interface
# (127.0.0.1 is n1, 127.0.0.2 is n2) until SIGTERM (the recipe's stop_servers).
SRUN = """#!/bin/bash
case "$*" in
  *--het-group=0*)
    exec "$PYTHON" -c '
import http.server, os, signal, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/readyz" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
signal.signal(signal.SIGTERM, lambda *a: os._exit(0))
http.server.HTTPServer(("0.0.0.0", int(os.environ["BATCHWIRE_METRICS_PORT"])), H).serve_forever()
' ;;
  *--het-group=1*) echo "trainers ran"; exit 0 ;;
esac
"""
SCONTROL = """#!/bin/bash
case "$1 $2" in
  "show hostnames") case "$3" in g1) echo g1 ;; *) echo n1; echo n2 ;; esac ;;
  "show node") case "$3" in n1) echo "NodeName=n1 NodeAddr=127.0.0.1" ;;
               n2) echo "NodeName=n2 NodeAddr=127.0.0.2" ;;
               *) echo "NodeName=$3 NodeAddr=127.0.0.3" ;; esac ;;
esac
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path: Path, timeout: float = 60) -> tuple[int, str]:
    stand_ins = tmp_path / "bin"
    stand_ins.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("scancel", "#!/bin/sh\nexit 1\n")):
        (stand_ins / name).write_text(text)
        (stand_ins / name).chmod(0o755)
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "server.key_secret").write_text("")  # so the recipe makes none
    (tmp_path / "data" / "train").mkdir(parents=True)
    env = {
        **os.environ,
        "PATH": f"{stand_ins}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        "PYTHON": sys.executable,
        "BATCHWIRE_DATA": str(tmp_path / "data"),
        "BATCHWIRE_KEYS": str(keys),
        "BATCHWIRE_PORT": str(_free_port()),
        "BATCHWIRE_METRICS_PORT": str(_free_port()),
        "BATCHWIRE_TRAIN_ARGS": "pipeline-train",
        "SLURM_JOB_ID": "8",
        "SLURM_JOB_NODELIST_HET_GROUP_0": "n[1-2]",
        "SLURM_JOB_NODELIST_HET_GROUP_1": "g1",
    }
    proc = subprocess.Popen(
        ["bash", str(ROOT / "deploy/slurm/batchwire.sbatch")],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True, text=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"the recipe still ran after {timeout} s:\n{out}") from None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, out


def test_healthy_servers_start_the_trainers(tmp_path: Path) -> None:
    """The stand-ins' own check: with no earlier job's files, the job runs (passes today)."""
    code, out = _run(tmp_path)
    assert "servers ready" in out and "trainers ran" in out, out
    assert code == 0, out


def test_an_earlier_job_of_the_same_id_does_not_end_this_one(tmp_path: Path) -> None:
    earlier = tmp_path / "batchwire-state" / "8.1"
    earlier.mkdir(parents=True)
    (earlier / "n2").write_text("2\n")  # the earlier job 8's server on n2
    code, out = _run(tmp_path)
    assert "the server on n2 exited" not in out, out
    assert "servers ready" in out and "trainers ran" in out, out
    assert code == 0, out
