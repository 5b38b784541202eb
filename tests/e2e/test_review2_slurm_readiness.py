"""Review 2 (755aff2): the Slurm recipe's readiness wait, run by bash against stand-in Slurm
commands on PATH (srun, scontrol, scancel). Two server nodes whose servers both exit at once (a
wrong BATCHWIRE_DATA): the server step ends, and the job ends within seconds with their error
and exit 1, not after the 10-minute wait holding the trainers' nodes (the behaviour before it
was 600 tries of up to 3 s, however early the servers had gone). And one server node failing
while the other's server is still starting: the job ends naming that node (its exit file in
BATCHWIRE_STATE). The real Slurm run of both is scripts/slurm_check.sh."""

from __future__ import annotations

from pathlib import Path

from slurmrecipe import run_recipe

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


def test_servers_that_exit_before_readyz_end_the_job_at_once(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "server.key_secret").write_text("")  # so the recipe makes none
    code, out = run_recipe(tmp_path, SRUN, "7", timeout=20)
    assert code == 1, out
    assert "no folder" in out and "the servers exited (2) before" in out, out
    assert "servers ready" not in out, out


# One server task per node as Slurm runs it: the recipe's own task command (after srun's
# options), with SLURMD_NODENAME set. n2's is run for real (a real pipeline-server that finds no
# data); n1 stands for a slow node whose server is still starting (its index scan), so the step
# goes on running.
SRUN_ONE_BAD = """#!/bin/bash
case "$*" in
  *--het-group=0*)
    while [ "${1#--}" != "$1" ]; do shift; done
    SLURMD_NODENAME=n2 "$@" &
    SLURMD_NODENAME=n1 sleep 300 >/dev/null 2>&1 &  # not on the job's output: it outlives srun
    wait ;;
  *) sleep 300 ;;  # the trainers: never reached here
esac
"""


def test_one_server_node_failing_while_the_other_runs_ends_the_job_naming_it(
    tmp_path: Path,
) -> None:
    """Before: the step ran on (n1's task), so the recipe waited the 10 minutes on n2's
    /readyz. Now n2's task leaves its server's exit code in BATCHWIRE_STATE, and the recipe
    ends the job within seconds, naming n2 and with the server's own error (the keys: made by
    the recipe's own pipeline-keys)."""
    code, out = run_recipe(
        tmp_path, SRUN_ONE_BAD, "8", timeout=30, BATCHWIRE_STATE=str(tmp_path / "state")
    )
    assert code == 1, out
    assert "dataset path does not exist" in out, out  # the real server's own error
    assert "the server on n2 exited (2) before" in out, out
    assert (tmp_path / "state" / "8.1" / "n2").read_text().strip() == "2"
    assert "servers ready" not in out, out
