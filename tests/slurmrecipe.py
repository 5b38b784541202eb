"""deploy/slurm/batchwire.sbatch run by bash against stand-in Slurm commands on PATH (srun as the
test writes it; scontrol's two server nodes n1 at 127.0.0.1 and n2 at 127.0.0.2 and a trainer
node g1; a scancel that fails, so the recipe falls back to signalling srun), then batchwire's
own commands (pipeline-keys, pipeline-server). Shared by the Slurm readiness tests; the real
Slurm run is scripts/slurm_check.sh."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[1] / "deploy" / "slurm" / "batchwire.sbatch"

SCONTROL = """#!/bin/bash
case "$1 $2" in
  "show hostnames") case "$3" in g1) echo g1 ;; *) echo n1; echo n2 ;; esac ;;
  "show node") case "$3" in n1) echo "NodeName=n1 NodeAddr=127.0.0.1" ;;
               n2) echo "NodeName=n2 NodeAddr=127.0.0.2" ;;
               *) echo "NodeName=$3 NodeAddr=127.0.0.3" ;; esac ;;
esac
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_recipe(
    tmp_path: Path, srun: str, job_id: str, timeout: float, **env_extra: str
) -> tuple[int, str]:
    """The recipe's exit code and output, run in ``tmp_path`` as job ``job_id`` with ``srun``'s
    text as srun. Fails if it is still running after ``timeout`` s; its process group is killed
    either way (a stand-in task may outlive srun)."""
    stand_ins = tmp_path / "bin"
    stand_ins.mkdir()
    for name, text in (("srun", srun), ("scontrol", SCONTROL), ("scancel", "#!/bin/sh\nexit 1\n")):
        (stand_ins / name).write_text(text)
        (stand_ins / name).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{stand_ins}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        "PYTHON": sys.executable,
        "BATCHWIRE_DATA": str(tmp_path / "nowhere"),
        "BATCHWIRE_KEYS": str(tmp_path / "keys"),
        "BATCHWIRE_PORT": str(free_port()),
        "BATCHWIRE_METRICS_PORT": str(free_port()),  # nothing answers /readyz there
        "SLURM_JOB_ID": job_id,
        "SLURM_JOB_NODELIST_HET_GROUP_0": "n[1-2]",
        "SLURM_JOB_NODELIST_HET_GROUP_1": "g1",
        **env_extra,
    }
    proc = subprocess.Popen(
        ["bash", str(RECIPE)],
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
