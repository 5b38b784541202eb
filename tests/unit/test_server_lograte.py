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
    assert len(shown(automatic)) == 10 and automatic.hex()[2:] not in shown(automatic)
    following = int(shown(b"\x00\x6b\x8b\x45\x68"), 16)
    assert abs(following - int(shown(automatic), 16)) > 1000  # the next one tells nothing
    assert shown(b"notebook") == b"notebook".hex()
