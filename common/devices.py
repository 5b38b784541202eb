"""Device strings and the integers of the launcher's environment, read one way everywhere.

Server (``--device``), decoders, trainer (``--device``) and RemoteLoader (``device=``) all take
``"cpu"``, ``"cuda"`` or ``"cuda:N"``; what an index-less ``"cuda"`` means differs (the server's
decoders take GPU 0, a trainer's rank takes its LOCAL_RANK's), so that choice stays with the
caller: `parse_device` only says whether the string names a device we can use.
"""

from __future__ import annotations

import os

import torch

_KINDS = ("cpu", "cuda")


def parse_device(spec: str | torch.device, *, default_index: int | None = None) -> torch.device:
    """``spec`` as a torch.device; ``"cuda"`` gets ``default_index`` (None: left without one).

    ValueError for anything but cpu, cuda or cuda:N. Does not check that CUDA is available:
    a configuration may be validated on a machine without the GPU it is meant for.
    """
    try:
        dev = torch.device(spec)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {spec!r}") from None
    if dev.type not in _KINDS or (dev.type == "cpu" and dev.index not in (None, 0)):
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {spec!r}")
    if dev.type == "cuda" and dev.index is None and default_index is not None:
        dev = torch.device("cuda", default_index)
    return dev


def env_int(name: str, default: int) -> int:
    """An integer environment variable (RANK, WORLD_SIZE, LOCAL_RANK); a clear error if not."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None
