"""Process-group setup from torchrun's environment, and the few collectives the loop needs.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; without them the
trainer is a single process and never touches torch.distributed (no rendezvous to configure for a
quick CPU run). The backend follows the device: NCCL for CUDA, gloo otherwise.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def resolve_device(requested: str, local_rank: int) -> torch.device:
    """`auto` -> this rank's GPU when CUDA is usable, else the CPU; `cuda` -> cuda:LOCAL_RANK."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(requested)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda was requested but CUDA is not available")
        if device.index is None:
            device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    return device


def init_distributed(requested_device: str, timeout_s: float = 600.0) -> DistContext:
    """Read rank and world size from the environment; join the process group when > 1."""
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} is outside WORLD_SIZE={world_size}")
    device = resolve_device(requested_device, local_rank)
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=timeout_s)
        kwargs: dict[str, Any] = {"timeout": timeout}
        if device.type == "cuda":
            kwargs["device_id"] = device  # binds NCCL to this GPU, no guessing
        store = _restart_scoped_store(rank, world_size, timeout)
        if store is not None:
            kwargs["store"] = store
        dist.init_process_group(backend, rank=rank, world_size=world_size, **kwargs)
    return DistContext(rank, world_size, local_rank, device)


def _restart_scoped_store(rank: int, world_size: int, timeout: timedelta) -> dist.Store | None:
    """torchrun's key-value store, seen under a prefix unique to this restart attempt.

    torchrun (2.x, static and c10d rendezvous alike) hands every restart attempt the same store
    without a per-attempt prefix. After `--max-restarts` relaunches the workers, the new ranks
    read the previous attempt's gloo/NCCL addresses, still in the store, and fail to connect
    ("Connection refused"). TORCHELASTIC_RESTART_COUNT names the attempt; it is the same for
    all ranks only when one agent launched them all (a single node), so only then is it used;
    several nodes keep torch's default behaviour.
    """
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if restart is None or not addr or not port:
        return None
    if _env_int("LOCAL_WORLD_SIZE", -1) != world_size:
        return None
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = dist.TCPStore(
        addr,
        int(port),
        world_size,
        is_master=(not agent_hosts and rank == 0),
        timeout=timeout,
        multi_tenant=not agent_hosts,
    )
    return dist.PrefixStore(f"batchwire/attempt-{restart}", store)


_group_destroyed = False


def shutdown_distributed() -> None:
    global _group_destroyed
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        _group_destroyed = True


def exit_after_distributed(code: int) -> None:
    """End the process now with ``code`` if it ran a process group, skipping interpreter teardown.

    torch (2.13) keeps a gloo group that DDP wrapped alive past ``destroy_process_group()``: its
    worker threads are still running when the interpreter finalizes, and one that releases the
    last collective's tensor then has to take the GIL, is ended by CPython inside C++ code and
    aborts the rank ("terminate called without an active exception", SIGABRT, exit -6) after a
    run that finished. It happens on a loaded host (twice in our CI). Everything of the run is
    written and closed by now (checkpoints renamed into place, logs flushed), so leaving with
    ``os._exit`` loses nothing. A process without a group returns normally.
    """
    if not _group_destroyed:
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def all_reduce_sum(t: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """Sum `t` over ranks in place (no-op for a single process) and return it."""
    if ctx.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def broadcast_buffers(module: torch.nn.Module, ctx: DistContext) -> None:
    """Copy rank 0's buffers (BatchNorm running statistics) to every rank."""
    if ctx.distributed:
        for buf in module.buffers():
            dist.broadcast(buf, src=0)


def all_gather_objects(obj: Any, ctx: DistContext) -> list[Any]:
    """Every rank's `obj`, in rank order (picklable: loader states, the multi-label val set's
    logits and targets, host tensors)."""
    if not ctx.distributed:
        return [obj]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        if ctx.device.type == "cuda":
            dist.barrier(device_ids=[ctx.device.index])
        else:
            dist.barrier()
