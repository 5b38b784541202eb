"""Atomic checkpoint files and latest-checkpoint discovery.

A checkpoint is written to a temporary file in the same folder, flushed to disk, then renamed
over its final name with `os.replace` (atomic on POSIX), and the folder entry is synced. A rank
killed at any moment therefore leaves either the previous set of complete checkpoints or the new
one, never a torn file under a checkpoint name. Names carry the global optimizer step
(`ckpt-000001234.pt`), so "latest" is the highest step, not the newest modification time (a
copied folder keeps its order).

Only rank 0 calls `save_checkpoint`; every rank calls `load_latest` at start, which requires the
folder to be visible to all ranks (one node, or a shared file system).
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

_NAME = re.compile(r"^ckpt-(\d{9,})\.pt$")


def checkpoint_path(directory: str | os.PathLike, step: int) -> Path:
    return Path(directory) / f"ckpt-{step:09d}.pt"


def list_checkpoints(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint in `directory`, oldest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        m = _NAME.match(entry.name)
        if m and entry.is_file():
            found.append((int(m.group(1)), entry))
    return sorted(found)


def save_checkpoint(
    directory: str | os.PathLike, step: int, state: dict[str, Any], *, keep: int = 2
) -> Path:
    """Write `state` atomically as the checkpoint of `step`; keep only the newest `keep` files.

    "Newest" is among the steps up to this one: a higher-numbered file can only be one that
    `load_latest` skipped as unreadable, and counting it would delete what this run writes.
    """
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(root, step)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=root)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, final)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    _fsync_dir(root)
    if keep > 0:
        ours = [path for s, path in list_checkpoints(root) if s <= step]
        for old in ours[:-keep]:
            old.unlink(missing_ok=True)
    # Only rank 0 writes, one file at a time: any other temporary file is a killed writer's.
    for stale in root.glob(".ckpt-*.tmp"):
        stale.unlink(missing_ok=True)
    return final


def _fsync_dir(root: Path) -> None:
    """Persist the rename itself (the directory entry), where the OS allows it."""
    try:
        fd = os.open(root, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class NoUsableCheckpoint(RuntimeError):
    """Checkpoint files exist, but none of them loads."""


def load_latest(directory: str | os.PathLike) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that loads, as (path, state); None when the folder has none.

    A file that fails to load (truncated by a full disk, written by an incompatible version) is
    logged and skipped for the previous one rather than ending the run: every rank sees the same
    files, so every rank makes the same choice. When every file fails, `NoUsableCheckpoint`:
    silently training from step 0 would throw away the run's progress without a word.
    """
    found = list_checkpoints(directory)
    for step, path in reversed(found):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # any unreadable file is skipped the same way
            log.warning("skipping unreadable checkpoint %s: %s", path, exc)
            continue
        if not isinstance(state, dict) or state.get("step") != step:
            log.warning("skipping %s: not a pipeline-train checkpoint of step %d", path, step)
            continue
        return path, state
    if found:
        raise NoUsableCheckpoint(
            f"none of the {len(found)} checkpoint file(s) in {directory} loads (see the warnings "
            "above); move them aside to start this run from scratch"
        )
    return None
