"""Which GETs read a set of byte ranges of one object: merge two ranges into one request when
the bytes between them cost less to read than a request does.

A shuffled batch asks each tar shard for a few members far apart (50 samples over 7 shards of
16 MB: about 7 members per shard, ~2 MB apart). Each GET costs a fixed amount (the request, its
signing, a connection's turn, the store's lookup) and each byte read costs again, needed or not:
so two neighbours are fetched in one request when `gap x MB_COST < REQUEST_COST`, i.e. when the
gap is under `GAP_BYTES`, and never into a request over `MAX_REQUEST_BYTES`.

The constants were measured on loopback against SeaweedFS (`weed` pinned to one core, the
client to the other; obstore 0.12.1; 2026-11-27: `python -m batchwire.bench.bench_storage
--request-costs --pin-store 0`, bench/RESULTS.md "Coalescing ranged reads"):
a GET of a 110 kB range costs the client 0.12 ms of CPU and the store 0.58 ms; each MB more in
one request costs the client 0.35-0.56 ms and the store 0.4-0.8 ms. Both sides count: on
loopback both are this host's, and in a deployment the store's share is its request rate and
latency on one side and its bandwidth on the other. So a request is worth about 0.67 MB of gap.
The server bench agrees: with gaps up to 0.25, 0.5 or 1 MiB merged, the server's CPU per image
is the same within noise, while 4 MiB (11 GETs per batch instead of 31) costs it 22 % more and
whole spans (7 GETs) 36 % more: bytes are not free. Fewer GETs without more bytes needs more
members of a shard per read (several batches' members read together: see RESULTS.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: CPU of one GET, client and store together (ms: 0.12 + 0.58), and of one more MB read in a
#: request (ms: about 0.45 + 0.6): see the doc.
REQUEST_COST_MS = 0.70
MB_COST_MS = 1.05
#: The gap below which two ranges are read in one request: the bytes between cost less than a
#: request.
GAP_BYTES = int(REQUEST_COST_MS / MB_COST_MS * 1e6)
#: No merged request grows past this (a range larger on its own is read alone): bounds the
#: memory of one read and the waste of one merge.
MAX_REQUEST_BYTES = 16 << 20


@dataclass(frozen=True)
class Request:
    """One GET: bytes [start, end) of the object, serving the ranges `members` (indices into
    the caller's list), each at `range - start` within the answer."""

    start: int
    end: int
    members: tuple[int, ...]


def plan_requests(
    ranges: Sequence[tuple[int, int]],
    gap_bytes: int = GAP_BYTES,
    max_bytes: int = MAX_REQUEST_BYTES,
) -> list[Request]:
    """The requests that read every non-empty range of `ranges` ([start, end) pairs, any
    order, overlaps allowed): ranges sorted by start, a range joining the request before it
    when the gap between them is under `gap_bytes` (overlapping or touching ranges always)
    and the request stays within `max_bytes`. Empty ranges belong to no request."""
    order = sorted((i for i, (s, e) in enumerate(ranges) if e > s), key=lambda i: ranges[i])
    out: list[Request] = []
    start = end = 0
    members: list[int] = []
    for i in order:
        s, e = int(ranges[i][0]), int(ranges[i][1])
        if members and (s - end <= 0 or (s - end < gap_bytes and max(e, end) - start <= max_bytes)):
            end = max(end, e)
            members.append(i)
            continue
        if members:
            out.append(Request(start, end, tuple(members)))
        start, end, members = s, e, [i]
    if members:
        out.append(Request(start, end, tuple(members)))
    return out


def slice_members(
    ranges: Sequence[tuple[int, int]], requests: Sequence[Request], answers: Sequence[bytes]
) -> list[bytes]:
    """Each range's bytes cut from its request's answer (`b""` for an empty range). An answer
    shorter than its request (the object ends early) gives its ranges what it holds: short,
    as a separate read of each would be."""
    out = [b""] * len(ranges)
    for request, answer in zip(requests, answers, strict=True):
        view = memoryview(answer)
        for i in request.members:
            s, e = ranges[i]
            out[i] = bytes(view[int(s) - request.start : int(e) - request.start])
    return out
