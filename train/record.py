"""Per-rank record of the dataset indices each training batch carried (`--record-indices DIR`).

It exists so a test (or a doubtful user) can check that an epoch interrupted by a crash and
resumed from a checkpoint still trained on every sample exactly once. One JSON line per batch:
`{"epoch": e, "batch": k, "indices": [...]}` in `DIR/indices-rank{r}.jsonl`, with `"pass": s` added
for a pass resumed at another world size (an elastic restart): the rest of epoch e from its sample
s on, whose batches are numbered from 0 again. Records order by (epoch, pass, batch).

Batches trained after the last checkpoint and before a crash are trained again after the
restart, because the checkpoint does not contain their effect. So on resume the record is cut
back to what the checkpoint covers: lines with (epoch, batch) before the checkpoint's position
are kept and everything else (including a line half-written when the process was killed) is
dropped. After that cut the record holds exactly the batches whose updates the model carries. Rank 0
cuts every rank's file (`truncate_records`): after a restart at another world size no rank of the
new run owns the files of the old run's other ranks.
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


def record_position(record: dict) -> tuple[int, int, int]:
    """A line's (epoch, pass, batch): the order of training."""
    return int(record["epoch"]), int(record.get("pass", 0)), int(record["batch"])


def truncate_records(directory: str | os.PathLike, epoch: int, pass_start: int, batch: int) -> None:
    """Cut every rank's record in `directory` back to before (epoch, pass_start, batch); a fresh
    run passes (0, 0, 0), and every file then starts empty."""
    for path in Path(directory).glob("indices-rank*.jsonl"):
        kept = [r for r in read_record(path) if record_position(r) < (epoch, pass_start, batch)]
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for r in kept:
                f.write(json.dumps(r) + "\n")
        os.replace(tmp, path)


class IndexRecorder:
    """Appends one line per trained batch to this rank's record."""

    def __init__(self, directory: str | os.PathLike, rank: int) -> None:
        self.directory = Path(directory)
        self.path = record_path(directory, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = None

    def append(self, epoch: int, batch: int, indices: Sequence[int], pass_start: int = 0) -> None:
        if self._file is None:
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open
        line: dict = {"epoch": int(epoch), "batch": int(batch)}
        if pass_start:
            line["pass"] = int(pass_start)
        line["indices"] = [int(i) for i in indices]
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
