"""A deterministic preferred server per batch: rendezvous (highest random weight) hashing.

Jobs of a sweep ask for the same batches (same split, epoch, world size, rank and index: the
determinism contract makes them byte-identical), and a server produces such a batch once for
all of them (issue 23, shared production) only if they ask the *same* server. Rendezvous
hashing (Thaler and Ravishankar, 1998) gives every loader the same answer without talking to
each other: each server's weight for a batch is a hash of (batch key, server id), and the
batch prefers the server of highest weight. When a server joins or leaves, only the batches
whose top server changed move (about 1/n of them), so sharing survives a fleet changing size.

The server id is the endpoint string as the loader connects to it (``tcp://10.0.0.5:5555``):
jobs that name (or resolve) the same servers agree. The hash is BLAKE2b, not Python's
``hash``, which is salted per process.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import TypeVar

__all__ = ["batch_key", "preferred", "weight"]

T = TypeVar("T")


def batch_key(split: str, epoch: int, world_size: int, rank: int, k: int, start: int = 0) -> bytes:
    """What identifies one batch across jobs; ``start``: a resumed pass's first sample (its
    batches differ from the epoch's usual ones, see `RemoteLoader.state_dict`)."""
    key = f"{split}\x00{epoch}\x00{world_size}\x00{rank}\x00{k}"
    if start:
        key += f"\x00{start}"
    return key.encode()


def weight(key: bytes, server: str) -> int:
    """The server's random weight for the batch ``key``: 64 bits, the same in every process."""
    h = hashlib.blake2b(key, digest_size=8, person=b"batchwire-hrw")
    h.update(b"\x00" + server.encode())
    return int.from_bytes(h.digest(), "big")


def preferred(key: bytes, servers: Iterable[tuple[str, T]]) -> T | None:
    """The item of the ``(server id, item)`` pairs whose server weighs most for ``key`` (None
    for none); ties (64-bit collisions) go to the smaller id, so the answer is total."""
    best: tuple[int, str] | None = None
    choice: T | None = None
    for server, item in servers:
        w = (weight(key, server), server)
        if best is None or w[0] > best[0] or (w[0] == best[0] and server < best[1]):
            best, choice = w, item
    return choice
