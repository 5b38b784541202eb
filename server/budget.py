"""The batch-buffer budget: how many buffers are lent, and who may borrow another.

Pure counting, no memory: the core (`core.py`) decides every loan and return here, and the
shell carries them out on the `BufferPool` (`bufpool.py`), which owns the tensors. The two
counts agree by construction: the shell acquires exactly when the core submits a job and
releases exactly when the core says `Release`.

Who may take a buffer when they are scarce (`may_lend`, the rule the docs state):

- a client that holds no buffer may take any free one: ``reserve`` buffers are kept for such
  clients, so a new client gets its batches even while others hold everything they may;
- any other client takes only from the rest (``max_buffers - reserve``, `shared`), and only
  while it holds fewer than its share of it (`share`, computed by the core over the clients
  that are actually taking their batches: see `ServerCore._share`).

A client over its share (it took buffers before others came) keeps what it holds until it
reads its batches or leaves; it only takes no more.
"""

from __future__ import annotations


class BufferBudget:
    """At most ``max_buffers`` lent at once, ``reserve`` of them for clients holding none."""

    def __init__(self, max_buffers: int, reserve: int = 1) -> None:
        if max_buffers < 1:
            raise ValueError(f"max_buffers must be >= 1, got {max_buffers}")
        self.max_buffers = int(max_buffers)
        self.reserve = max(0, min(int(reserve), self.max_buffers))
        self.held = 0

    @property
    def shared(self) -> int:
        """Buffers clients that already hold some may share (the cap less the reserve)."""
        return self.max_buffers - self.reserve

    @property
    def full(self) -> bool:
        return self.held >= self.max_buffers

    def share(self, clients: int, available: int | None = None) -> int:
        """What each of ``clients`` sharing clients may hold of ``available`` buffers (default:
        the whole shared part), at least 1."""
        pool = self.shared if available is None else available
        return max(1, pool // max(1, clients))

    def may_lend(self, holding: int, share: int) -> bool:
        """May a client that holds ``holding`` buffers take another (see the module doc)?"""
        if self.held >= self.max_buffers:
            return False
        if holding == 0:
            return True
        return self.held < self.shared and holding < share

    def lend(self) -> None:
        """Count one more buffer lent; the caller checked `may_lend` (RuntimeError past the
        cap: a bug, never a silent excess)."""
        if self.held >= self.max_buffers:
            raise RuntimeError(f"all {self.max_buffers} batch buffers are held")
        self.held += 1

    def returned(self) -> None:
        """Count one buffer given back (RuntimeError with none lent: a bug, which would
        otherwise let one buffer past the cap be lent later)."""
        if self.held <= 0:
            raise RuntimeError("a batch buffer was given back that was never lent")
        self.held -= 1
