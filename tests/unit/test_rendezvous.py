"""Rendezvous hashing (`client.rendezvous`) and the Fleet's use of it: a deterministic
preferred server per batch, balanced, moving little when the fleet changes (issue 23 item 4)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter

from batchwire.client import rendezvous
from batchwire.client.fleet import SendCredit
from batchwire.client.rendezvous import batch_key, preferred
from fleetsim import NUM_BATCHES, Shell, streaming, welcome_for

SERVERS = [f"tcp://10.0.0.{i}:5555" for i in range(2, 6)]
KEYS = [batch_key("train", e, 2, r, k) for e in range(3) for r in range(2) for k in range(2000)]


def owner(key: bytes, servers: list[str]) -> str:
    choice = preferred(key, [(s, s) for s in servers])
    assert choice is not None
    return choice


def test_the_choice_is_a_pure_function_of_key_and_servers() -> None:
    """The same in another process with another hash seed (no salted hash) and whatever order
    the servers come in. The child loads the module's file alone: it needs only the standard
    library, and `import batchwire.client` would import torch (1.4 s of CPU)."""
    mine = [owner(k, SERVERS) for k in KEYS[:200]]
    assert mine == [owner(k, SERVERS[::-1]) for k in KEYS[:200]]
    code = (
        "import importlib.util, sys\n"
        "spec = importlib.util.spec_from_file_location('rendezvous', sys.argv[1])\n"
        "r = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(r)\n"
        f"S = {SERVERS!r}\n"
        "print(','.join(r.preferred(r.batch_key('train', 0, 2, 0, k), [(s, s) for s in S]) "
        "for k in range(200)))"
    )
    seed = "1" if os.environ.get("PYTHONHASHSEED") == "2" else "2"
    out = subprocess.run(
        [sys.executable, "-c", code, rendezvous.__file__],
        capture_output=True, text=True, check=True, env={**os.environ, "PYTHONHASHSEED": seed},
    )  # fmt: skip
    assert out.stdout.strip().split(",") == [owner(k, SERVERS) for k in KEYS[:200]]
    assert preferred(KEYS[0], []) is None


def test_every_part_of_the_key_matters() -> None:
    base = ("train", 0, 2, 0, 7)
    variants = [("val", 0, 2, 0, 7), ("train", 1, 2, 0, 7), ("train", 0, 4, 0, 7)]
    variants += [("train", 0, 2, 1, 7), ("train", 0, 2, 0, 8)]
    keys = {batch_key(*base), batch_key(*base, start=96)} | {batch_key(*v) for v in variants}
    assert len(keys) == 7


def test_batches_are_balanced_over_the_servers() -> None:
    for n in (2, 3, 4):
        counts = Counter(owner(k, SERVERS[:n]) for k in KEYS)
        even = len(KEYS) / n
        assert all(abs(c - even) / even < 0.03 for c in counts.values()), (n, counts)


def test_a_server_joining_or_leaving_moves_only_its_share() -> None:
    three, four = SERVERS[:3], SERVERS
    before = [owner(k, three) for k in KEYS]
    after = [owner(k, four) for k in KEYS]
    moved = [(a, b) for a, b in zip(before, after, strict=True) if a != b]
    assert all(b == SERVERS[3] for _, b in moved), "a batch moved between two old servers"
    assert abs(len(moved) / len(KEYS) - 1 / 4) < 0.02
    # Leaving: only the leaver's batches move, spread over the others.
    gone = [owner(k, SERVERS[1:]) for k in KEYS]
    changed = [a for a, b in zip(after, gone, strict=True) if a != b]
    assert set(changed) == {SERVERS[0]}
    assert len(changed) == Counter(after)[SERVERS[0]]


def preferred_of(shell: Shell, k: int) -> int:
    p = shell.fleet.preferred(k, [(q.endpoint, q) for q in shell.fleet.peers if q.assignable()])
    assert p is not None
    return p.index


def test_two_jobs_ask_the_same_server_for_the_same_batch() -> None:
    """Jobs of a sweep (two loaders of the same split, epoch, rank, world size and servers)
    whose servers keep up: every batch goes to its preferred server, the same in both."""
    asked = []
    for _ in range(2):
        shell = streaming(3)
        handed = shell.run_epoch([0, 1, 2])
        assert handed == list(range(NUM_BATCHES))
        who = {k: a.server for a in shell.log if isinstance(a, SendCredit) for k in a.batches}
        asked.append(who)
        assert all(who[k] == preferred_of(shell, k) for k in who), who
    assert asked[0] == asked[1]
    assert len(set(asked[0].values())) == 3


def test_a_slow_preferred_server_passes_batches_to_the_others() -> None:
    """Server 0 sends one batch per round, server 1 all it owes: server 0 never holds more than
    1.5 times its even share, the batches that prefer it beyond that go to server 1, the epoch is
    whole and in order."""
    total = 60
    shell = Shell(2)
    shell.connect()
    shell.start()
    for i in (0, 1):
        shell.welcomed.add(shell.session(i))
        shell.reply(i, welcome_for(shell.session(i), num_batches=total))
    cap = -(-3 * shell.fleet.budget // 4)
    while shell.fleet.cursor < total:
        shell.serve(0, 1)
        shell.serve(1)
        while shell.fleet.cursor in shell.held:
            shell.take()
        assert len(shell.asked(0)) <= cap
    assert shell.handed == list(range(total))
    who = {k: a.server for a in shell.log if isinstance(a, SendCredit) for k in a.batches}
    moved = [k for k, i in who.items() if i == 1 and preferred_of(shell, k) == 0]
    assert moved, "nothing that preferred the slow server went to the other"
    kept = [k for k, i in who.items() if i == 0]
    assert kept and all(preferred_of(shell, k) == 0 for k in kept)
