"""Housekeeping: which sessions to drop, what memory to keep, whom a drain may tell now.

Part of the server's core (core.py, no I/O): pure functions of a session, what ZeroMQ holds for
its peer and ``now``; the core looks every `HOUSEKEEPING_S` and drops what these name.

- stalled: its peer took none of its sent batches for `STALL_S` (a stopped process, a vanished
  host): its session goes, its ready batches come back at once;
- silent: nothing heard for --client-timeout;
- idle: it owes nothing and asked for nothing for --client-timeout (messages that ask for
  nothing keep a session from the silence reaper, not from this one);
- buffers: what the clients may still need is kept allocated (`buffers_to_keep`), none once
  nobody has taken one for `BUFFERS_IDLE_S`.
"""

from __future__ import annotations

from batchwire.server.sessions import ClientSession

# ... a peer not reading (lending.NOT_READING_S) this long has its session dropped (as ZMTP
# heartbeats drop an idle dead peer).
STALL_S = 3.0
# Drops for silence, stalls and buffer trims are looked at this often.
HOUSEKEEPING_S = 1.0
# A chunk of batch buffers nobody has needed for this long is freed even if clients remain.
BUFFERS_IDLE_S = 30.0


def idle_without_progress(session: ClientSession, held: int, now: float) -> float:
    """How long a session that owes nothing has made no progress (``held``: its sent batches
    ZeroMQ still holds; while any, it is not idle)."""
    if session.owed or session.in_production or held:
        return 0.0
    since = session.opened_at if session.progress_at is None else session.progress_at
    return now - since


def why_drop(
    session: ClientSession, waiting: float, held: int, now: float, timeout: float
) -> str | None:
    """Why the session goes now (the log line, after the client's id), or None: ``waiting``,
    how long its peer has taken none of the ``held`` batches ZeroMQ holds for it;
    ``timeout``, --client-timeout."""
    if waiting > STALL_S:
        return (
            f"took none of its {held} sent batch(es) for {waiting:.1f} s (stopped, or its "
            f"host is gone): its session and {session.ready} queued batch(es) dropped; what "
            "ZeroMQ holds for it comes back when it reads or its connection closes"
        )
    if now - session.last_seen > timeout:
        return f"silent for {timeout:.0f} s: dropped"
    if idle_without_progress(session, held, now) > timeout:
        return f"asked for no batch for {timeout:.0f} s: dropped"
    return None


def buffers_to_keep(
    clients: int,
    idle_s: float,
    producers: int,
    prefetch_depth: int,
    max_buffers: int,
    window: int,
) -> int:
    """Buffers the current clients may need: at most their full share each (2 x
    prefetch-depth), the producers' jobs (2 x producers) and the share window; none once
    nobody has taken a buffer for `BUFFERS_IDLE_S` (``idle_s``), or no client is left. Only
    wholly free chunks go, so trimming never waits for anything."""
    if clients == 0 or idle_s > BUFFERS_IDLE_S:
        return 0
    need = 2 * producers + 2 * prefetch_depth * clients
    return min(max_buffers, need + window)


def may_tell_shutdown(session: ClientSession, not_reading: bool) -> bool:
    """Draining: may the session be told `Shutdown` and dropped now? Once every batch it was
    promised (in production or ready) is sent, or at once if its peer does not read."""
    return session.in_production == 0 and (session.ready == 0 or not_reading)
