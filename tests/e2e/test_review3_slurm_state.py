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

from pathlib import Path

from slurmrecipe import run_recipe

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


def _run(tmp_path: Path) -> tuple[int, str]:
    """The recipe with healthy servers and a keys folder and data it finds."""
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "server.key_secret").write_text("")  # so the recipe makes none
    (tmp_path / "data" / "train").mkdir(parents=True)
    return run_recipe(
        tmp_path, SRUN, "8", timeout=60,
        BATCHWIRE_DATA=str(tmp_path / "data"), BATCHWIRE_TRAIN_ARGS="pipeline-train",
    )  # fmt: skip


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
