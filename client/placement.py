"""Where a loader runs: its rank, world size and device, resolved from the process it lives in.

Resolved late on purpose: a loader built before the process group exists (in a
LightningModule's ``__init__``, in the launcher's parent process) must not freeze world size 1.
`RemoteLoader` resolves once, when it first connects.
"""

from __future__ import annotations

import os

import torch
from batchwire.common import devices
from batchwire.common.devices import env_int, parse_device


def resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Explicit values, else torch.distributed when initialised, else RANK/WORLD_SIZE, else 0/1.

    ``WORLD_SIZE > 1`` without ``RANK`` is an error: every process would claim rank 0 and the
    other shards would never be read.
    """
    if rank is None or world_size is None:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            env_rank, env_world = dist.get_rank(), dist.get_world_size()
        else:
            env_world = env_int("WORLD_SIZE", 1)
            if env_world > 1 and "RANK" not in os.environ and rank is None:
                raise ValueError(
                    f"WORLD_SIZE={env_world} is set but RANK is not: this process cannot tell "
                    "which shard is its own. Launch with torchrun (it sets both), initialise "
                    "torch.distributed before the loader connects, or pass rank= explicitly"
                )
            env_rank = env_int("RANK", 0)
        rank = env_rank if rank is None else rank
        world_size = env_world if world_size is None else world_size
    check_rank(rank, world_size)
    return rank, world_size


def check_rank(rank: int | None, world_size: int | None) -> None:
    """Validate whichever of the two is known now."""
    for name, value in (("rank", rank), ("world_size", world_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    if world_size is not None and world_size < 1:
        raise ValueError(f"need world_size >= 1, got world_size={world_size}")
    if rank is not None and rank < 0:
        raise ValueError(f"need rank >= 0, got rank={rank}")
    if rank is not None and world_size is not None and rank >= world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` picks CUDA when available; ``"cuda"`` without an index is this process's GPU.

    This process's GPU: the one `torch.cuda.set_device` chose, else ``LOCAL_RANK``'s (what
    torchrun, Lightning and Accelerate set per process), else the current one. Without this,
    every rank of a node would land on ``cuda:0``.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = parse_device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} asked for, but CUDA is not available")
        if dev.index is None:
            dev = torch.device("cuda", local_cuda_index(torch.cuda.device_count()))
    return dev


def local_cuda_index(device_count: int) -> int:
    """The GPU index of this process (see `resolve_device`): `common.devices.local_cuda_index`
    (shared with LocalLoader) given CUDA's current device."""
    current = torch.cuda.current_device() if device_count else 0
    return devices.local_cuda_index(device_count, current)


def default_job() -> str:
    """The job a loader belongs to: ``BATCHWIRE_JOB``, else torchrun's ``TORCHELASTIC_RUN_ID``.

    A server agrees world sizes per job, so two jobs (or a notebook beside a job) sharing one
    server never refuse each other; without either variable every loader is in job "".
    """
    return os.environ.get("BATCHWIRE_JOB") or os.environ.get("TORCHELASTIC_RUN_ID") or ""
