"""Shared production: one batch produced once for every session that asks for it.

The determinism contract makes a batch a pure function of (split, seed, epoch, rank,
world_size, batch size, batch index), and the sampler's layout makes it a function of (split,
epoch, batch size B, global batch g) with g = k * world_size + rank (pipeline/sampler.py: global
batch g takes slots [g*B, (g+1)*B) of the epoch's order, whatever the world size). The seed is
the server's, so on one server `BatchKey(split, epoch, g, sizes)` names the batch's bytes:
two jobs of world size 1, or a job of world size 1 and one of world size 2 (its rank r batch k
is the first's batch 2k + r), ask for the same buffer. Only the header differs per session
(session id, batch index), and the core builds it per send.

A `Production` is one buffer's life: in production (sessions waiting on it: `waiters`), then
done and referenced (`refs`: each session's ready batch or sent batch ZeroMQ still holds), and
possibly kept in the window of recently produced batches after its last reference went, so a
session that asks shortly after is served without producing again. The window is bounded in
batches (--share-window); its idle buffers (no reference) are not counted by the
`BufferBudget` (they are no one's work-ahead) but they count against --max-buffers: when the
core needs a buffer and lent + idle reach the cap, the oldest idle one goes first
(`make_room`), so the window only ever lives in the slack of the cap.

Mixtures (pipeline/sources/mix.py): a train mix's epoch order is its `MixPlan`'s, fixed by the
server's --train mix and --mix-schedule and the seed, the same for every session (a hello cannot
change it), so the key names a mix's batch as it names any other; a restart with another
schedule starts with an empty window, so no batch of the old schedule is ever handed out.

Batches, and samples across batch sizes: on one server the seed and augmentation are fixed, so a
job of another world size reads the same global batches and shares them whole, zero-copy. A job
of another batch size (`Hello.batch_size`, up to --max-batch-size) reads other batches (the key
carries the batch size) made of the same samples: those are shared one level down, by the
producers' sample window (pipeline/sample_window.py), sized by `sample_window_batches` and only
on servers that expect a mix of batch sizes (a lone job elsewhere pays nothing).

Pure bookkeeping, loop thread only, no I/O: it returns the slots to release; the core turns
them into `Release` actions.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from batchwire.pipeline.sample_window import CHUNK as SAMPLE_CHUNK

if TYPE_CHECKING:
    from batchwire.server.bufpool import Slot
    from batchwire.server.config import ServerConfig
    from batchwire.server.sessions import Produced

#: (split, epoch, global batch index g = k * world_size + rank, (batch size, H, W) or None for
#: the server's --batch-size and --image-size): a session's batch size and output size
#: (sweeps, progressive resizing) are part of what a batch is.
BatchKey = tuple[str, int, int, tuple[int, int, int] | None]

#: (split, epoch) pairs whose produced batches are remembered, to tell a lagging session.
_SEEN_EPOCHS = 8

#: The default --share-window in batches (bounded by a quarter of --max-buffers): jobs that
#: start together drift apart by a few batches (their work-ahead, --prefetch-depth), a
#: follower catches up at once (its batches cost nothing), so a few times the depth suffices.
DEFAULT_WINDOW = 16


def window_batches(requested: int | None, max_buffers: int) -> int:
    """The window's bound in batches: ``requested`` (None: `DEFAULT_WINDOW`), at most a
    quarter of --max-buffers so the window never crowds the trainers' work-ahead out."""
    want = DEFAULT_WINDOW if requested is None else max(0, int(requested))
    return min(want, max_buffers // 4)


def window_statement(requested: int | None, max_buffers: int, sample_batches: int = 0) -> str:
    """The share window in use, said at start: a bound the operator asked for and did not get
    (capped at a quarter of the batch buffers, ``max_buffers``) is named, not applied unsaid.
    ``sample_batches``: the batches' bytes --max-buffers gave the sample window first, so the
    line names the --max-buffers the operator set, not what was left of it."""
    window = window_batches(requested, max_buffers)
    if sample_batches:
        of = (
            f"the {max_buffers} batch buffers (--max-buffers {max_buffers + sample_batches} "
            f"less {sample_batches} for the sample window)"
        )
    else:
        of = f"--max-buffers {max_buffers}"
    if window == 0:
        why = "--share-window 0" if requested == 0 else f"a quarter of {of} is 0"
        return f"share window: off ({why})"
    asked = DEFAULT_WINDOW if requested is None else requested
    batches = "batch" if window == 1 else "batches"
    if window < asked:
        return (
            f"share window: {window} {batches}, capped from {asked} at a quarter of "
            f"{of} (raise --max-buffers for more)"
        )
    how = "the default" if requested is None else "--share-window"
    return f"share window: {window} {batches} ({how})"


def sample_window_applies(config: ServerConfig) -> bool:
    """Does this server share samples across batch sizes (pipeline/sample_window.py)? The one
    place that decides: only a server that expects a mix of batch sizes (--max-batch-size above
    --batch-size), decodes on the CPU and writes single-view batches with the fused op (no user
    transform); the module doc of pipeline/sample_window.py says why not otherwise. The core
    marks orders `share_samples` only where it applies (and sharing is on)."""
    return not (
        config.batch_size_cap == config.batch_size
        or config.device != "cpu"
        or config.views
        or config.transform
        or config.val_transform
    )


def sample_window_batches(config: ServerConfig, max_buffers: int) -> int:
    """The sample window's bound, in batches of the largest size (`capacity_spec`): half the
    batch window's bound where it applies (`sample_window_applies`); 0: no sample window. The
    server takes these batches' bytes out of --max-buffers (server/sizing.py), so the memory
    bound stays."""
    if not sample_window_applies(config):
        return 0
    return window_batches(config.share_window, max_buffers) // 2


def sample_window_samples(config: ServerConfig, max_buffers: int) -> int:
    """How many samples the sample window holds (0: none): its batches of the largest size
    (`sample_window_batches`) less what each producer may pin past the window's bytes (its
    scratch chunk and an evicted chunk a live entry still shares, 2 x CHUNK - 1 samples):
    those come out of the window's bytes (server/sizing.py), so pacing, which keeps a sweep's
    jobs within the window, must count without them."""
    batches = sample_window_batches(config, max_buffers)
    if not batches:
        return 0
    pinned = config.producers * (2 * SAMPLE_CHUNK - 1)
    return max(0, batches * config.batch_size_cap - pinned)


@dataclass(eq=False)
class Production:
    """One produced (or being produced) batch buffer and who holds it."""

    id: int
    key: BatchKey | None  # None: not shareable (sharing off)
    leader: int  # serial of the session that asked first
    cancelled: bool = False  # nobody waits for it any more (the core returned `Cancel`)
    waiters: list[tuple[int, int, int]] = field(default_factory=list)  # (serial, pos, k)
    output: Produced | None = None  # set when it finished
    refs: int = 0  # ready or sent batches of sessions that point at this buffer
    windowed: bool = False
    sends: int = 0
    # The peers (ZeroMQ identities) that waited for it or joined it: a send says the batch is
    # shared when another of them is still connected (`ServerCore._shared_with_another`).
    # Peers, not sessions: a loader's own new hello that finds its batch in the window shares
    # it with nobody.
    peers: set[bytes] = field(default_factory=set)

    @property
    def done(self) -> bool:
        return self.output is not None


class SharedBatches:
    """Productions by id and by key, and the window of recently produced ones."""

    def __init__(self, window: int) -> None:
        self.window = max(0, int(window))
        self._by_id: dict[int, Production] = {}
        self._by_key: dict[BatchKey, Production] = {}
        self._recent: OrderedDict[int, Production] = OrderedDict()  # done, windowed, by age
        self.idle = 0  # windowed productions nobody references: buffers held for the window
        self._seen: OrderedDict[tuple[str, int], set[tuple]] = OrderedDict()
        self._next_id = 0

    @property
    def enabled(self) -> bool:
        return self.window > 0

    def key(
        self,
        split: str,
        epoch: int,
        rank: int,
        world_size: int,
        k: int,
        size: tuple[int, int, int] | None = None,
    ) -> BatchKey | None:
        """The batch's name on this server, or None when sharing is off (``size``: the batch
        size and output size a session asked for, None for the server's own)."""
        if not self.enabled:
            return None
        return (split, int(epoch), int(k) * int(world_size) + int(rank), size)

    def find(self, key: BatchKey | None) -> Production | None:
        """A production of ``key`` a session may join: in production and not cancelled, or
        done and still held or windowed."""
        if key is None:
            return None
        p = self._by_key.get(key)
        if p is None or (not p.done and p.cancelled):
            return None
        return p

    def costs_a_buffer(self, p: Production | None) -> bool:
        """Would joining ``p`` (None: producing anew) take a buffer from the budget?"""
        return p is None or (p.done and p.refs == 0)

    def lagging(self, key: BatchKey | None) -> bool:
        """Was this batch produced before and let go: the session asking fell behind?"""
        if key is None:
            return False
        seen = self._seen.get((key[0], key[1]))
        return seen is not None and key[2:] in seen

    # ---------------------------------------------------------------- life of a production

    def start(self, key: BatchKey | None, serial: int, pos: int, k: int) -> Production:
        self._next_id += 1
        p = Production(self._next_id, key, serial)
        p.waiters.append((serial, pos, k))
        self._by_id[p.id] = p
        if key is not None:
            self._by_key[key] = p
        return p

    def get(self, production_id: int) -> Production | None:
        return self._by_id.get(production_id)

    def in_production(self) -> list[Production]:
        return [p for p in self._by_id.values() if not p.done]

    def forget_waiter(self, serial: int, identity: bytes) -> list[int]:
        """A session closed: it waits for nothing any more, and its peer (``identity``) no
        longer shares what it waited for (its socket may live on with another session).
        Returns the productions nobody waits for now, marked cancelled (the core's `Cancel`:
        skipped if not started)."""
        cancelled: list[int] = []
        for p in self.in_production():
            if any(w[0] == serial for w in p.waiters):
                p.waiters = [w for w in p.waiters if w[0] != serial]
                p.peers.discard(identity)
                if not p.waiters:
                    p.cancelled = True
                    cancelled.append(p.id)
        return cancelled

    def failed(self, p: Production) -> None:
        """A production that gave up: forgotten (the caller releases its slot)."""
        self._forget(p)

    def finished(self, p: Production, output: Produced) -> None:
        """A production succeeded: its slot now holds the batch."""
        p.output = output
        if p.key is not None:
            split, epoch = p.key[0], p.key[1]
            seen = self._seen.get((split, epoch))
            if seen is None:
                seen = self._seen[(split, epoch)] = set()
                while len(self._seen) > _SEEN_EPOCHS:
                    self._seen.popitem(last=False)
            seen.add(p.key[2:])
            self._recent[p.id] = p
            p.windowed = True

    def join_done(self, p: Production) -> bool:
        """A session takes a reference to a done production; True when that took the buffer
        out of the window's idle ones (the caller lends it from the budget)."""
        p.refs += 1
        if p.refs == 1 and p.windowed:
            self.idle -= 1
            return True
        return False

    def settle(self, p: Production) -> list[Slot]:
        """After the references of a done production changed: one nobody references stays
        as an idle window buffer or is released; then the window is trimmed to its bound.
        Returns the slots to release (the caller has returned their budget count)."""
        out: list[Slot] = []
        if p.refs == 0:
            if p.windowed:
                self.idle += 1
            else:
                out.append(self._remove(p))
        while len(self._recent) > self.window:
            _, old = self._recent.popitem(last=False)
            old.windowed = False
            if old.refs == 0:
                self.idle -= 1
                out.append(self._remove(old))
        return out

    def unref(self, production_id: int) -> tuple[bool, list[Slot]]:
        """A session let go of its reference (sent and taken, or dropped unsent). Returns
        whether the budget gets a buffer back (the last reference went) and the slots to
        release."""
        p = self._by_id.get(production_id)
        if p is None or p.refs <= 0:
            return False, []
        p.refs -= 1
        if p.refs:
            return False, []
        return True, self.settle(p)

    def make_room(self, lent: int, cap: int) -> list[Slot]:
        """Free idle window buffers, oldest first, until ``lent`` plus idle is below ``cap``
        (the core is about to lend one more)."""
        out: list[Slot] = []
        for pid in list(self._recent):
            if lent + self.idle < cap:
                break
            p = self._recent[pid]
            if p.refs == 0:
                del self._recent[pid]
                p.windowed = False
                self.idle -= 1
                out.append(self._remove(p))
        return out

    def flush(self) -> list[Slot]:
        """Release every idle window buffer (nobody has asked for a batch for long)."""
        return self.make_room(0, 0)

    def _remove(self, p: Production) -> Slot:
        """Forget a done production; its slot, which the caller releases."""
        self._forget(p)
        assert p.output is not None
        return p.output.slot

    def _forget(self, p: Production) -> None:
        self._by_id.pop(p.id, None)
        if p.key is not None and self._by_key.get(p.key) is p:
            del self._by_key[p.key]
        self._recent.pop(p.id, None)
