"""Liveness: is each server still there, how fast is it, and what to say while the loader waits.

A server owing a welcome or batches and silent for longer than its heartbeat loses its session
and gets a new hello (`silent`). The heartbeat starts at the loader's ``heartbeat``, doubles per
such timeout up to max(timeout/2, 1 s), and each batch lowers it to max(heartbeat, min(it, 4x
that batch's gap)) (`delivered`), so a server that is merely slow is not restarted in a loop.
Each batch also updates the server's pace (`Peer.pace`), which `assignment` reads to ask little
of a server much slower than the fastest. While the consumer waits, `waiting_note` says for
whom and why, and past the loader's timeout `unavailable` is the error, naming the server most
at fault. Functions of `session.Peer`s, ``now`` given: no I/O, no clock.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

from batchwire import wire
from batchwire.client.errors import ServerUnavailable
from batchwire.client.session import Peer, PeerState

log = logging.getLogger(__name__)

PACE_SMOOTHING = 0.25  # the weight of a new gap in a server's smoothed pace


class Waiting(NamedTuple):
    """What a wait's messages name: the servers, the batch waited for, the loader's timeout."""

    peers: Sequence[Peer]
    cursor: int
    epoch: int
    split: str
    timeout: float


def delivered(p: Peer, heartbeat: float) -> None:
    """``p`` delivered a batch the loader uses (`Peer.last_heard` is its arrival): progress.
    Its error streaks reset; its heartbeat (not below the loader's ``heartbeat``) and pace
    follow this batch."""
    p.error_streak = p.transient_streak = p.silences = 0  # an error after this is a new one
    # How long this batch took to come (since we last heard or asked): the silence check
    # waits a few times that, so a server that is merely slow is not restarted in a loop.
    gap = p.last_heard - max(p.last_sent, p.prev_heard)
    p.heartbeat = max(heartbeat, min(p.heartbeat, 4 * gap))
    # Its pace: time since it was last heard or, if it was idle, since it was given work (a
    # credit to a server already busy does not restart the clock).
    busy = p.last_heard - max(p.busy_since, p.prev_heard)
    p.pace = busy if p.pace == 0.0 else p.pace + PACE_SMOOTHING * (busy - p.pace)


def silent(peers: Sequence[Peer], since: float, now: float, timeout: float) -> list[Peer]:
    """The servers that owe something and were silent past their heartbeat (counted from
    ``since`` at the earliest, when the consumer started waiting); each one's heartbeat doubles,
    up to max(``timeout``/2, 1 s). Their sessions are to end."""
    quiet_ones = []
    for p in peers:
        if not p.owes():
            continue
        quiet = now - max(p.last_heard, p.last_sent, since)
        if quiet > p.heartbeat:
            log.info(
                "no message from %s for %.1f s while it owes %s; its batches go to the "
                "other servers and it gets a new hello",
                p.endpoint,
                quiet,
                "batches" if p.state is PeerState.STREAMING else "a welcome",
            )
            p.heartbeat = min(2 * p.heartbeat, max(timeout / 2, 1.0))
            # Slow until it delivers (`assignment`): asked for one late batch at most, instead
            # of the one the consumer waits for.
            p.silences += 1
            quiet_ones.append(p)
    return quiet_ones


def in_fleet(peers: Sequence[Peer]) -> list[Peer]:
    """The servers of the fleet now (not removed, not retiring)."""
    return [p for p in peers if p.in_fleet()]


def blocking_peer(peers: Sequence[Peer]) -> Peer:
    """The server most at fault for the batch the consumer waits for."""
    members = in_fleet(peers) or [p for p in peers if p.state is not PeerState.REMOVED]
    members = members or peers
    return next((p for p in members if p.session is None or not p.session.welcomed), members[0])


def waiting_note(waiting: Waiting, now: float, since: float) -> str:
    """What the loader says while the consumer waits (every few seconds): where, how long,
    and what that server is doing."""
    p = blocking_peer(waiting.peers)
    if not p.connected:
        if p.connect_failures:
            doing = "nothing is listening there (connection refused); retrying"
        elif p.ever_connected:
            doing = f"the connection was lost {now - p.last_heard:.0f} s ago; reconnecting"
        else:
            doing = "no answer yet; connecting"
    elif p.state is PeerState.REFUSED:
        doing = f"it refused this loader ({p.refusal}); asking again"
    elif p.waits_out_busy():
        doing = f"it cannot serve this loader until this clears ({p.refusal}); asking again"
    elif p.state is PeerState.BACKING_OFF:
        doing = f"it answered with an error ({p.last_error}); asking again"
    elif p.session is None or not p.session.welcomed:
        doing = "connected, waiting for its answer to our hello"
    else:
        doing = f"connected, producing batch {waiting.cursor} of epoch {waiting.epoch}"
    n = len(in_fleet(waiting.peers))
    others = f" (and {n - 1} other server(s))" if n > 1 else ""
    return (
        f"waiting for pipeline-server at {p.endpoint}{others} for {now - since:.0f} s "
        f"(giving up after {waiting.timeout:g} s): {doing}"
    )


def unavailable(waiting: Waiting, now: float) -> ServerUnavailable:
    """Why the batch the consumer waits for did not come, naming the server most at fault."""
    p = blocking_peer(waiting.peers)
    t = f"{waiting.timeout:g}"
    if not p.ever_connected and p.connect_failures:
        msg = (
            f"no pipeline-server answered at {p.endpoint} within {t} s: nothing is listening "
            "there, every connection was refused (is the port, or the ipc:// path, right? "
            "pipeline-server says 'serving ... on ENDPOINT' when it starts)"
        )
    elif not p.ever_connected:
        msg = (
            f"no pipeline-server answered at {p.endpoint} within {t} s: no answer at all, "
            "the connection never completed (is the host up, and the port open in its "
            "firewall? is pipeline-server running there?)"
        )
    elif not p.connected:
        msg = (
            f"pipeline-server at {p.endpoint} went away (last heard "
            f"{now - p.last_heard:.1f} s ago) and did not come back within {t} s"
        )
    elif p.state is PeerState.REFUSED:
        msg = f"pipeline-server at {p.endpoint} refused this loader for {t} s"
    elif p.waits_out_busy():
        msg = (
            f"pipeline-server at {p.endpoint} could not serve this loader for {t} s, for "
            "a reason it said would clear"
        )
    elif p.state is PeerState.BACKING_OFF:
        msg = f"pipeline-server at {p.endpoint} answered with errors for {t} s"
    elif (p.session is None or not p.session.welcomed) and p.ever_welcomed:
        msg = (
            f"pipeline-server at {p.endpoint} is connected and served this loader before, but "
            f"did not answer its hello within {t} s (is the server stopped or overloaded?)"
        )
    elif p.session is None or not p.session.welcomed:
        msg = (
            f"pipeline-server at {p.endpoint} is connected but did not answer the hello "
            f"within {t} s (is it a pipeline-server speaking protocol "
            f"v{wire.PROTOCOL_VERSION}?)"
        )
    else:
        msg = (
            f"pipeline-server at {p.endpoint} is connected but sent no batch for {t} s "
            f"(waiting for batch {waiting.cursor} of epoch {waiting.epoch}, "
            f"split {waiting.split!r})"
        )
    others = [o for o in in_fleet(waiting.peers) if o is not p]
    if others:
        msg += f"; nor did {', '.join(o.endpoint for o in others)} deliver it"
        refusals = [f"{o.endpoint} refused: {o.refusal}" for o in others if o.refusal]
        if refusals:
            msg += f" ({'; '.join(refusals)})"
    if p.last_error:
        msg += f"; its last error: {p.last_error}"
    return ServerUnavailable(p.endpoint, msg)
