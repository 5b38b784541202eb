"""ARCHITECTURE.md's "The journey of one batch" quotes scripts/trace_journey.py's summary.

The script traces a real server child and a RemoteLoader (the embedded dataset, batch 4 of
32 px, a few batches: seconds) and prints one batch's hops per thread and its calls back; the
document must hold that summary verbatim, so its counts cannot drift from the code. After a
change of the path a batch takes, run the script and paste its summary into the document.

One part of a window depends on timing: a consumer that had to wait for its batch runs the
liveness check (`Fleet.tick` -> `liveness.silent` -> `Peer.owes`), one whose batch was already
there does not. On a loaded machine the trace can miss it, so the test traces up to three times
and passes when one summary is the document's.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "trace_journey.py"


def traced_summary() -> str:
    run = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("journey of batch"))
    summary = "\n".join(lines[start:])
    assert "calls back:" in summary and " hops, " in summary, run.stdout
    return summary


def test_architecture_quotes_the_traced_journey() -> None:
    doc = (REPO / "ARCHITECTURE.md").read_text()
    seen = []
    for _ in range(3):
        seen.append(traced_summary())
        if seen[-1] in doc:
            return
    raise AssertionError(
        "ARCHITECTURE.md's journey section must quote the traced summary verbatim "
        f"(`{SCRIPT.relative_to(REPO)}`); traced:\n" + "\n---\n".join(seen)
    )
