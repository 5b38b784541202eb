"""Device strings and the integers of the launcher's environment, read one way everywhere.

Server (``--device``), decoders, trainer (``--device``) and RemoteLoader (``device=``) all take
``"cpu"``, ``"cuda"`` or ``"cuda:N"``; what an index-less ``"cuda"`` means differs (the server's
decoders take GPU 0, a trainer's rank takes its LOCAL_RANK's), so that choice stays with the
caller: `parse_device` only says whether the string names a device we can use, and
`process_device` is the rank's choice (RemoteLoader and LocalLoader): this process's GPU, so
that the ranks of a node do not all land on GPU 0.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_KINDS = ("cpu", "cuda")
_SPEC = re.compile(r"(cpu(:0)?|cuda(:\d+)?)")


def check_device_spec(spec: str) -> None:
    """ValueError unless `spec` is cpu, cuda or cuda:N: the rule `parse_device` applies, without
    importing torch (a configuration is validated before `--help` has to wait for it)."""
    if not (isinstance(spec, str) and _SPEC.fullmatch(spec)):
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {spec!r}")


def parse_device(spec: str | torch.device, *, default_index: int | None = None) -> torch.device:
    """``spec`` as a torch.device; ``"cuda"`` gets ``default_index`` (None: left without one).

    ValueError for anything but cpu, cuda or cuda:N. Does not check that CUDA is available:
    a configuration may be validated on a machine without the GPU it is meant for.
    """
    import torch

    if isinstance(spec, str):
        check_device_spec(spec)
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


def local_cuda_index(device_count: int, current: int) -> int:
    """The GPU index of this process, given CUDA's device count and current device: the one
    `torch.cuda.set_device` chose (``current`` non-zero), else ``LOCAL_RANK``'s (what torchrun,
    Lightning and Accelerate set per process) when it names a visible GPU, else ``current``.
    Pure but for the environment: no CUDA call, so it is tested on any machine."""
    if current != 0:  # chosen explicitly with torch.cuda.set_device
        return current
    local_rank = env_int("LOCAL_RANK", -1)
    if 0 <= local_rank < device_count:
        return local_rank
    return current


def process_device(
    spec: str | torch.device, *, device_count: int | None = None, current: int | None = None
) -> torch.device:
    """``spec`` with an index-less ``"cuda"`` resolved to this process's GPU
    (`local_cuda_index`); other devices as `parse_device` gives them. ``device_count`` and
    ``current`` default to CUDA's own (asked only for an index-less "cuda")."""
    import torch

    dev = parse_device(spec)
    if dev.type == "cuda" and dev.index is None:
        if device_count is None:
            device_count = torch.cuda.device_count()
        if current is None:
            current = torch.cuda.current_device() if device_count else 0
        dev = torch.device("cuda", local_cuda_index(device_count, current))
    return dev
