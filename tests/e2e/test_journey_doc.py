"""ARCHITECTURE.md's "The journey of one batch" quotes scripts/trace_journey.py's summary.

The script traces a real server child and a RemoteLoader (the embedded dataset, batch 4 of
32 px, a few batches: seconds) and prints one batch's hops per thread and its calls back; the
document must hold that summary verbatim, so its counts cannot drift from the code. After a
change of the path a batch takes, run the script and paste its summary into the document.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "trace_journey.py"


def test_architecture_quotes_the_traced_journey() -> None:
    run = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("journey of batch"))
    summary = "\n".join(lines[start:])
    assert "calls back:" in summary and " hops, " in summary, run.stdout
    doc = (REPO / "ARCHITECTURE.md").read_text()
    assert summary in doc, (
        "ARCHITECTURE.md's journey section must quote the traced summary verbatim "
        f"(`{SCRIPT.relative_to(REPO)}`):\n{summary}"
    )
