"""server/lograte.py and server/peer_names.py, driven alone."""

from __future__ import annotations

import logging

from batchwire.server.lograte import LineBudget
from batchwire.server.peer_names import shown


def test_lines_past_the_budget_go_to_debug_and_are_summed_once_the_window_is_over() -> None:
    budget = LineBudget(per_window=3, window_s=10.0)
    levels = [budget.level(now=1.0 + k * 0.1) for k in range(5)]
    assert levels == [logging.INFO] * 3 + [logging.DEBUG] * 2
    assert budget.summary(now=5.0) is None  # the window is not over
    line = budget.summary(now=11.5)
    assert line is not None and line.startswith("2 more lines about clients")
    assert budget.summary(now=30.0) is None  # said once
    assert budget.level(now=30.0) == logging.INFO  # a new window


def test_libzmqs_own_names_are_shown_hashed_and_chosen_ones_as_they_are() -> None:
    automatic = b"\x00\x6b\x8b\x45\x67"
    assert shown(automatic) == shown(automatic) != automatic.hex()
    assert len(shown(automatic)) == 10 and shown(automatic).startswith("z")
    assert automatic.hex()[2:] not in shown(automatic)
    following = shown(b"\x00\x6b\x8b\x45\x68")
    assert following[1:4] != shown(automatic)[1:4]  # the next one tells nothing (1 in 4096)
    assert shown(b"notebook") == b"notebook".hex()
    assert shown(b"bw-j0") == b"bw-j0".hex()  # a chosen 5-byte name: as it is
