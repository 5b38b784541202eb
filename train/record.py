"""Per-rank record of the dataset indices each training batch carried (`--record-indices DIR`).

It exists so a test (or a doubtful user) can check that an epoch interrupted by a crash and
resumed from a checkpoint still trained on every sample exactly once. One JSON line per batch:
`{"epoch": e, "batch": k, "indices": [...]}` in `DIR/indices-rank{r}.jsonl`.

Batches trained after the last checkpoint and before a crash are trained again after the
restart, because the checkpoint does not contain their effect. So on resume the record is cut
back to what the checkpoint covers: lines with (epoch, batch) before the checkpoint's position
are kept and everything else (including a line half-written when the process was killed) is
dropped. After that cut the record holds exactly the batches whose updates the model carries.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path


def record_path(directory: str | os.PathLike, rank: int) -> Path:
    return Path(directory) / f"indices-rank{rank}.jsonl"


def read_record(path: str | os.PathLike) -> list[dict]:
    """The complete lines of a record file (a torn last line is ignored)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                break
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return out


class IndexRecorder:
    """Appends one line per trained batch; `truncate_to` cuts it back to a resume point."""

    def __init__(self, directory: str | os.PathLike, rank: int) -> None:
        self.path = record_path(directory, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = None

    def truncate_to(self, epoch: int, batch: int) -> None:
        """Keep only batches before (epoch, batch); a fresh run passes (0, 0) and starts empty."""
        kept = []
        if self.path.exists():
            kept = [r for r in read_record(self.path) if (r["epoch"], r["batch"]) < (epoch, batch)]
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for r in kept:
                f.write(json.dumps(r) + "\n")
        os.replace(tmp, self.path)

    def append(self, epoch: int, batch: int, indices: Sequence[int]) -> None:
        if self._file is None:
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open
        line = {"epoch": int(epoch), "batch": int(batch), "indices": [int(i) for i in indices]}
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
