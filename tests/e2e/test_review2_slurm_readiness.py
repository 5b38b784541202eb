"""Review 2 (755aff2): the Slurm recipe's readiness wait, run by bash against stand-in Slurm
commands on PATH (srun, scontrol, scancel). Two server nodes whose servers both exit at once (a
wrong BATCHWIRE_DATA): the server step ends, and the job ends within seconds with their error
and exit 1, not after the 10-minute wait holding the trainers' nodes (the behaviour before it
was 600 tries of up to 3 s, however early the servers had gone)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SRUN = """#!/bin/bash
case "$*" in
  *--het-group=0*)  # one server task per node; srun ends with the last of them
    for node in n1 n2; do
      (echo "pipeline-server: error: no folder $BATCHWIRE_DATA/train" >&2; exit 2) &
    done
    wait; exit 2 ;;
  *) sleep 300 ;;  # the trainers: never reached here
esac
"""
SCONTROL = """#!/bin/bash
case "$1 $2" in
  "show hostnames") echo n1; echo n2 ;;
  "show node") [ "$3" = n1 ] && echo "NodeName=n1 NodeAddr=127.0.0.1 State=IDLE" \\
               || echo "NodeName=n2 NodeAddr=127.0.0.2 State=IDLE" ;;
esac
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_servers_that_exit_before_readyz_end_the_job_at_once(tmp_path: Path) -> None:
    stand_ins = tmp_path / "bin"
    stand_ins.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("scancel", "#!/bin/sh\nexit 1\n")):
        (stand_ins / name).write_text(text)
        (stand_ins / name).chmod(0o755)
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "server.key_secret").write_text("")  # so the recipe makes none
    env = {
        **os.environ,
        "PATH": f"{stand_ins}:{os.environ['PATH']}",
        "PYTHON": sys.executable,
        "BATCHWIRE_DATA": str(tmp_path / "nowhere"),
        "BATCHWIRE_KEYS": str(keys),
        "BATCHWIRE_METRICS_PORT": str(free_port()),  # nothing answers /readyz there
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST_HET_GROUP_0": "n[1-2]",
        "SLURM_JOB_NODELIST_HET_GROUP_1": "g1",
    }
    proc = subprocess.Popen(
        ["bash", str(ROOT / "deploy/slurm/batchwire.sbatch")],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True, text=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"still waiting 20 s after the servers exited:\n{out}") from None
    assert proc.returncode == 1, out
    assert "no folder" in out and "the servers exited (2) before" in out, out
    assert "servers ready" not in out, out
