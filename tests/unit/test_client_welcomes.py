"""A welcome against the ask and the first server's (client/welcomes.py), checked alone.

test_client_fleet.py meets the same errors through the fleet's events.
"""

from __future__ import annotations

import dataclasses

import pytest
import wirefakes
from batchwire.client import ProtocolError
from batchwire.client.welcomes import check, differences

EP = "tcp://server-1:5555"


def test_a_welcome_like_the_first_and_the_ask_passes() -> None:
    w = wirefakes.welcome(7, 12)
    check(EP, w, None, batch_size=None, image_size=None)
    check(EP, w, wirefakes.welcome(3, 12), batch_size=2, image_size=(4, 4))
    assert differences(w, wirefakes.welcome(3, 12)) == ""  # the session id is no difference


def test_a_welcome_unlike_the_ask_names_what_was_asked() -> None:
    w = wirefakes.welcome(7, 12)
    with pytest.raises(ProtocolError, match=rf"{EP} welcomed batches of 2 where 64 were asked"):
        check(EP, w, None, batch_size=64, image_size=None)
    with pytest.raises(ProtocolError, match="4x4 px batches where 96x96 were asked for"):
        check(EP, w, None, batch_size=None, image_size=(96, 96))


def test_a_welcome_unlike_the_first_names_each_field_that_differs() -> None:
    first = wirefakes.welcome(3, 12)
    other = dataclasses.replace(wirefakes.welcome(7, 5), classes=["a", "b", "c"])
    with pytest.raises(ProtocolError, match="unlike the first server") as raised:
        check(EP, other, first, batch_size=None, image_size=None)
    assert "num_batches 5 vs 12, num_samples 10 vs 24, classes [3 names] vs [0 names]" in str(
        raised.value
    )
    mixed = dataclasses.replace(first, mix_fingerprint="0123456789abcdef")
    assert differences(first, mixed) == "mix_fingerprint (not a mix) vs 0123456789abcdef"
