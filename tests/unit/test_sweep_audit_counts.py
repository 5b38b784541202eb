"""Sweep audit: how the jobs' shared counts relate to the server's (docs/sweeps.md, "What a
trainer sees"), in the server's core with a fake clock.

A job counts a batch shared when another connected job waited for it or was sent it first
(`BatchHeader.shared`); the server counts the sends of a batch after its first. A batch two jobs
waited for counts once on the server and in both jobs, so the jobs' figures add up to at most
twice the server's, except for batches a job waited for and never took (it crashed or left
first): the one that took it still counts it, the server does not.
"""

from __future__ import annotations

from batchwire.server.core import SendBatch
from coresim import Server


def _shared(s: Server, identity: bytes) -> int:
    return sum(1 for x in s.sends if x.identity == identity and x.header.shared)


def test_a_batch_a_crashed_job_waited_for_counts_for_the_other_job_only() -> None:
    s = Server(config={"share_window": 16})
    s.hello(b"a", batches=(0, 1, 2, 3, 4), session=1)
    s.hello(b"b", batches=(0, 1, 2, 3, 4), session=2)
    s.turn(readers=(b"a",))  # batches 0-3 for both; b's stay in ZeroMQ's hands (its prefetch)
    s.tick()
    s.finish()  # batch 4, which both waited for
    sends = [a for a in s.tick() if isinstance(a, SendBatch)]
    assert [x.identity for x in sends] == [b"a"]  # b has --prefetch-depth batches unread
    s.run(s.core.on_peer_gone(b"b", "crashed", s.clock()))
    jobs = _shared(s, b"a") + _shared(s, b"b")
    server = s.telemetry.counters()["batches_shared_total"]
    assert (_shared(s, b"a"), _shared(s, b"b"), server) == (5, 4, 4)
    assert jobs == 2 * server + 1  # the one batch b waited for and never took
