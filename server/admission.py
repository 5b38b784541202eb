"""Admission: which hellos the server serves, at what spec, and who holds a split's world size.

Part of the server's core (core.py, no I/O): `ServerCore` hands a hello here for the rules and
opens the session itself. What decides:

- the split: one this server serves (`SplitInfo`, what the core knows of it);
- the session's spec (`spec_for`): the server's, or the batch size and output size the hello
  asks for, up to --max-batch-size and --max-image-size, never for multi-view batches or a user
  transform (their sizes are theirs);
- world-size agreement per (split, job) (`world_size_holder`): a session holds its world size
  only while it has progress (`holds_world_size`), so an anonymous hello cannot lock a split.
  --max-clients is the core's (it counts its sessions).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from batchwire import wire
from batchwire.pipeline.sampler import ShardSampler
from batchwire.pipeline.sources.metadata import batch_metadata
from batchwire.server.config import ServerConfig
from batchwire.server.sessions import ClientSession
from batchwire.wire import BatchSpec, Hello

if TYPE_CHECKING:
    from batchwire.pipeline.split import Split

# A session that owes nothing and has made no progress this long (a notebook done iterating)
# no longer holds its split's world size: a training loader asks for batches every step.
AGREEMENT_IDLE_S = 5.0


@dataclass(frozen=True)
class SplitInfo:
    """What the core needs of a split: its sampler and what a `Welcome` says about it."""

    name: str
    num_samples: int
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    sampler: Callable[[int, int, int, int], ShardSampler]  # (batch, seed, rank, world_size)
    classes: tuple[str, ...] = ()  # names in label id order (the welcome's `classes`)
    label_width: int = 0  # K of a multi-label split's [B, K] labels (the welcome's), else 0
    #: Per-sample metadata of the split's dataset (a manifest's other columns), or None.
    metadata: Sequence[dict | None] | None = None
    mix_fingerprint: str = ""  # a mix's (`Split.mix_fingerprint`, the welcome's), else ""

    def batch_metadata(self, indices: Sequence[int]) -> list[dict | None]:
        """The metadata of a batch's samples by index (None for padding, -1)."""
        return batch_metadata(self.metadata, indices)

    @classmethod
    def of(cls, split: Split) -> SplitInfo:
        return cls(
            name=split.name,
            num_samples=split.samples_per_epoch,
            num_classes=split.dataset.num_classes,
            mean=tuple(split.augment.mean),
            std=tuple(split.augment.std),
            sampler=split.sampler,
            classes=tuple(split.dataset.classes),
            label_width=getattr(split.dataset, "label_width", 0),
            metadata=getattr(split.dataset, "metadata", None),
            mix_fingerprint=split.mix_fingerprint,
        )


def spec_for(hello: Hello, spec: BatchSpec, config: ServerConfig) -> BatchSpec | str:
    """The spec of a hello's session: the server's (``spec``), or at the batch size and output
    size it asks for (a sweep's batch sizes, progressive resizing); a string says why that
    cannot be served."""
    batch = spec.batch_size if hello.batch_size is None else hello.batch_size
    most_batch = config.batch_size_cap
    if batch > most_batch:
        return (
            f"batch_size {batch} is larger than this server's --max-batch-size {most_batch} "
            "(its batch buffers are sized for that); restart it with a larger "
            "--max-batch-size, or ask for a smaller batch size"
        )
    size = hello.image_size
    if size is None or (size == (spec.height, spec.width) and not spec.views):
        if batch == spec.batch_size:
            return spec
        return dataclasses.replace(spec, batch_size=batch)
    h, w = size
    if spec.multi_view:
        return (
            f"image_size {h}x{w} asked, but this server serves multi-view batches "
            "(--views): their sizes are the views'"
        )
    transform = config.transform if hello.split == "train" else config.val_transform
    if transform is not None:
        return (
            f"image_size {h}x{w} asked, but this server's {hello.split} split runs a user "
            "transform (--transform): its output size is the transform's"
        )
    most = config.max_image_hw
    if h > most[0] or w > most[1]:
        return (
            f"image_size {h}x{w} is larger than this server's --max-image-size "
            f"{most[0]}x{most[1]} (its batch buffers are sized for that); restart it with "
            "a larger --max-image-size, or ask for a smaller size"
        )
    return BatchSpec(batch, h, w, spec.dtype, spec.layout)


def holds_world_size(session: ClientSession, now: float) -> bool:
    """Does this session keep others of its split and job from another world size?

    Only a session that has made progress holds it: one that asked for batches (and owes
    some), or that asked, was sent or took one in the last `AGREEMENT_IDLE_S`. A hello
    that asks for nothing, and empty credits, hold nothing: otherwise any anonymous peer
    could lock a split with one hello and a message now and then. A training loader asks
    for a batch every step and a next-epoch hello carries its batches, so an honest one
    between epochs or just started holds its world size as soon as it asks for anything.
    """
    if session.progress_at is None:
        return False
    return session.owed > 0 or now - session.progress_at < AGREEMENT_IDLE_S


def world_size_holder(
    sessions: Iterable[ClientSession], identity: bytes, hello: Hello, now: float
) -> ClientSession | None:
    """Another live session of the same split and job at another world size, if any."""
    for other in sessions:
        if (
            other.identity != identity
            and other.hello.split == hello.split
            and other.hello.job == hello.job
            and other.hello.world_size != hello.world_size
            and holds_world_size(other, now)
        ):
            return other
    return None


def world_size_conflict(hello: Hello, other: ClientSession, now: float, timeout: float) -> str:
    """The refusal of a hello whose world size differs from a live session's: who holds the
    split, when it was last heard from and when it stops counting (``timeout``:
    --client-timeout)."""
    silent = now - other.last_seen
    o = other.hello
    job = f" of job {wire.show(hello.job)}" if hello.job else ""
    return (
        f"world_size mismatch on split {hello.split!r}{job}: this client says "
        f"world_size={hello.world_size}, but client {other.peer_hex} (rank {o.rank} of "
        f"world_size={o.world_size}, epoch {o.epoch}) is streaming it, last heard from "
        f"{silent:.1f} s ago; it is dropped when it disconnects or says bye, else after "
        f"--client-timeout {timeout:g} s of silence, in {max(0.0, timeout - silent):.1f} s "
        "if it stays silent (a loader of another job, BATCHWIRE_JOB or torchrun's run id, "
        "is not refused)"
    )


def spec_text(spec: BatchSpec, server: BatchSpec) -> str:
    """How a session's spec differs from the server's, for its admission log line."""
    text = ""
    if (spec.height, spec.width) != (server.height, server.width):
        text += f" at {spec.height}x{spec.width}"
    if spec.batch_size != server.batch_size:
        text += f" in batches of {spec.batch_size}"
    return text
