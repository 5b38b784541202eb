"""Pacing: a job far ahead of the others on its split waits for them, so a sweep stays shared.

Part of the server's core (no I/O, `now` given). Jobs of a sweep read the same epoch order,
and a sample is decoded once only while every job asks for it within the share window
(sharing.py: batches; pipeline/sample_window.py: samples across batch sizes). Unpaced, a job
that reads faster drifts ahead until the others' samples have left the window and are decoded
again (a mixed sweep of batch sizes 64/128 decoded 1.9x its distinct samples with the default
window, bench/RESULTS.md, issue 23). So a session whose next batch would start a new
production more than `PACE_FRACTION` of the window ahead of another session on its split, and
not more than `PACE_REACH` windows ahead (a job that far behind, say one started late, cannot
catch up by a short wait: it produces its own, `lagging`), waits while that one keeps up:

- it made progress (asked for a batch) within `PACE_IDLE_S`: a stopped or finished job holds
  nobody for longer than that;
- and the held session's hold allowance lasts: a session is held at most `PACE_SHARE` of the
  time (a token bucket of `PACE_BURST_S`), so a job much faster than the others on the split
  (another model, another trainer) loses at most that share of its rate to pacing, while jobs
  of one speed, which drift only by the server's own unevenness, are kept together by short
  holds.

A held session loses its turn, not its place; joining a production (a batch already made or
being made for another session) is never held. Positions are in samples of the epoch order
(`sample_position`): a batch of world size W, rank r and size B starts at sample (kW + r) B,
later epochs after earlier ones. Only sessions that could share are compared (`pace_group`: one
split at one output size; another image size shares no batch and no sample; another batch size
shares samples only through the sample window, so without one it is another group). The window
holds the batches and samples of every group read at the time, so each group active now (in
`laggards`) paces to its share of the span: two sizes read at once have half the window each.
The allowance is the peer's, not the session's: each new hello of a loader (every epoch, a
resume) is a new session, and a fresh allowance per hello would hold a job of short epochs far
beyond its share.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from batchwire.server.sessions import ClientSession

#: A job behind by this long without asking for a batch holds nobody (seconds).
PACE_IDLE_S = 1.0
#: A session waits when its next new batch is this fraction of the window ahead of another's,
#: and no more than this many windows ahead.
PACE_FRACTION = 0.75
PACE_REACH = 2.0
#: The most of its time a session spends held, and the longest hold at once (seconds).
PACE_SHARE = 0.25
PACE_BURST_S = 2.0


@dataclass
class _Allowance:
    """A session's hold allowance: earned at `PACE_SHARE` seconds a second, spent while held."""

    seconds: float = PACE_BURST_S
    at: float = 0.0
    held: bool = False

    def hold(self, wanted: bool, now: float) -> bool:
        elapsed = max(0.0, now - self.at)
        spent = 1.0 if self.held else 0.0  # it was held since the last look
        self.seconds = min(PACE_BURST_S, self.seconds + elapsed * (PACE_SHARE - spent))
        self.at = now
        self.held = wanted and self.seconds > 0
        return self.held


def sample_position(session: ClientSession, batch_size: int, num_samples: int) -> int | None:
    """Where the session's next batch to start begins, in samples (epochs laid end to end);
    None for a session outside the shared order (a resumed pass)."""
    h = session.hello
    if h.start_sample:
        return None
    if session.next_pos < len(session.batches):
        k = session.batches[session.next_pos]
    else:  # nothing asked beyond what started: it will ask for the batch after its last
        k = session.batches[-1] + 1 if session.batches else 0
    return h.epoch * num_samples + (k * h.world_size + h.rank) * batch_size


#: What a session is paced against: (split, output height and width, and the batch size where
#: batch sizes share nothing; None: the server's).
PaceGroup = tuple[str, "tuple[int, ...] | None"]
#: Per group: (position, session serial, job) of the sessions that hold others back, sorted.
Laggards = dict[PaceGroup, list[tuple[int, int, "tuple | None"]]]


def pace_group(session: ClientSession, batch_sizes_share: bool = True) -> PaceGroup:
    """The sessions a session may be held for: its split's at its output size (and batch size,
    unless ``batch_sizes_share``: the server's sample window). Sessions at another image size
    share nothing with it (sharing.py's key carries the size, and a sample's bytes depend on
    it), nor do other batch sizes without a sample window, so holding it for them would cost
    time and save no decoding."""
    spec = session.spec
    if spec is None:
        return (session.hello.split, None)
    size = (spec.height, spec.width)
    return (session.hello.split, size if batch_sizes_share else (*size, spec.batch_size))


def _job_of(session: ClientSession) -> tuple | None:
    """What tells a session's job apart: its hello's job name and world size; None for an
    unnamed job of world size 1 (a job of its own). Ranks of an unnamed multi-rank job cannot be
    told from another unnamed job of that size: such sessions do not pace each other."""
    h = session.hello
    if not h.job and h.world_size == 1:
        return None
    return (h.job, h.world_size)


class Pacing:
    """Holds sessions more than `PACE_FRACTION` of ``span`` samples ahead (module doc)."""

    def __init__(
        self,
        span: int,
        position: Callable[[ClientSession], int | None],
        batch_sizes_share: bool = True,
    ) -> None:
        self.span = int(span)  # the window, in samples; 0: no pacing
        self.position = position
        # Jobs of other batch sizes share samples (the producers' sample window): paced together.
        self.batch_sizes_share = batch_sizes_share
        self._allowances: dict[bytes, _Allowance] = {}  # by peer (identity), module doc

    @property
    def enabled(self) -> bool:
        return self.span > 0

    def laggards(self, sessions: Iterable[ClientSession], now: float) -> Laggards:
        """Per `pace_group`, the sessions that made progress within `PACE_IDLE_S`, by
        position (sorted); the allowances of peers gone are dropped."""
        out: Laggards = {}
        live: set[bytes] = set()
        for s in sessions:
            live.add(s.identity)
            if s.closed or s.progress_at is None or now - s.progress_at > PACE_IDLE_S:
                continue
            pos = self.position(s)
            if pos is not None:
                out.setdefault(pace_group(s, self.batch_sizes_share), []).append(
                    (pos, s.serial, _job_of(s))
                )
        for entries in out.values():
            entries.sort()
        for identity in self._allowances.keys() - live:
            del self._allowances[identity]
        return out

    def holds(self, session: ClientSession, laggards: Laggards, now: float) -> bool:
        """Must ``session`` wait before starting a new production of its next batch?"""
        entries = laggards.get(pace_group(session, self.batch_sizes_share))
        pos = self.position(session) if entries else None
        # The window holds every group's batches (and samples): each group active now has its
        # share of it, so a group's jobs must keep within that share.
        ahead = pos is not None and self._another_in_reach(
            session,
            entries,  # type: ignore[arg-type]
            pos,
            self.span / len(laggards),
        )
        allowance = self._allowances.get(session.identity)
        if allowance is None:
            if not ahead:
                return False
            allowance = self._allowances[session.identity] = _Allowance(at=now)
        return allowance.hold(ahead, now)

    def _another_in_reach(
        self,
        session: ClientSession,
        entries: list[tuple[int, int, tuple | None]],
        pos: int,
        span: float,
    ) -> bool:
        """Is another job's session between `PACE_REACH` and `PACE_FRACTION` of ``span``
        behind ``pos``? (Not this session's own earlier place, nor a rank of its own job: a job's
        ranks are apart by design and never share a batch.)"""
        job = _job_of(session)
        i = bisect_left(entries, (pos - PACE_REACH * span,))
        for other_pos, serial, other_job in entries[i:]:
            if other_pos >= pos - PACE_FRACTION * span:
                return False
            if serial != session.serial and (job is None or other_job != job):
                return True
        return False

    def started(self, session: ClientSession, now: float) -> None:
        """The session started a batch: it is held no more (its allowance counts that)."""
        allowance = self._allowances.get(session.identity)
        if allowance is not None:
            allowance.hold(False, now)
