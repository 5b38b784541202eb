"""wire/errors.py: the protocol's errors and `show`, which quotes a peer's value in an error
message short whatever the peer sent (a 64 KiB frame must not come back as a longer reply).
The decoders raising these are tests/unit/test_protocol.py's."""

from __future__ import annotations

import msgpack
import pytest
from batchwire.wire.errors import PROTOCOL_VERSION, ProtocolError, VersionMismatch, show

LIMIT = 200  # the longest quote of one value


def test_a_protocol_error_is_a_value_error() -> None:
    assert issubclass(ProtocolError, ValueError) and issubclass(VersionMismatch, ProtocolError)


def test_a_version_mismatch_names_both_sides() -> None:
    err = VersionMismatch(3)
    assert (err.peer_version, err.own_version) == (3, PROTOCOL_VERSION)
    assert (
        str(err)
        == f"protocol version mismatch: peer speaks v3, this side speaks v{PROTOCOL_VERSION}"
    )
    assert str(VersionMismatch(1, own_version=7)).endswith("peer speaks v1, this side speaks v7")


@pytest.mark.parametrize(
    "peer_version", ["2" * 70_000, b"\xff" * 65_536, list(range(10_000)), {"v": [[[[2]]]]}]
)
def test_a_version_mismatch_quotes_a_hostile_version_briefly(peer_version: object) -> None:
    err = VersionMismatch(peer_version)
    assert err.peer_version is peer_version  # kept whole for the code, shortened for people
    assert len(str(err)) <= 60 + LIMIT


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (2, "2"),
        ("hello", "'hello'"),
        (None, "None"),
        ([1, 2], "[1, 2]"),
        ({"type": "hello"}, "{'type': 'hello'}"),
        (b"\x00\x01", "b'\\x00\\x01'"),
    ],
)
def test_small_values_are_shown_as_their_repr(value: object, shown: str) -> None:
    assert show(value) == shown


@pytest.mark.parametrize(
    "value",
    [
        "x" * 65_536,
        b"\x00" * 65_536,
        bytearray(65_536),
        list(range(65_536)),
        tuple(range(100)),
        {str(i): i for i in range(10_000)},
        {i for i in range(1000)},
        [[[[[[[["deep"]]]]]]]],
        [["y" * 1000] * 100] * 100,
        2**64 + 1,
        10**4000,  # as many digits as Python converts (msgpack's integers have at most 20)
        float("nan"),
        memoryview(b"z" * 65_536),
    ],
)
def test_a_large_or_deep_value_is_shown_short(value: object) -> None:
    text = show(value)
    assert 0 < len(text) <= LIMIT, text


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("s" * 65_536, "'" + "s" * 27 + "..." + "s" * 28 + "'"),
        (b"b" * 65_536, "b'" + "b" * 26 + "..." + "b" * 28 + "'"),
        (list(range(65_536)), "[0, 1, 2, 3, 4, 5, 6, 7, ...]"),
        ({i: i for i in range(100)}, "{0: 0, 1: 1, 2: 2, 3: 3, 4: 4, 5: 5, 6: 6, 7: 7, ...}"),
        ([[[[1]]]], "[[[[...]]]]"),
        (10**50, "100000000000000000...0000000000000000000"),
    ],
)
def test_each_part_is_cut_where_it_grows(value: object, shown: str) -> None:
    assert show(value) == shown


def test_a_frame_as_big_as_a_peer_may_send_is_shown_short() -> None:
    frame = msgpack.unpackb(msgpack.packb({"k" * 60_000: ["v" * 60_000] * 8, "n": list(range(9))}))
    text = show(frame)
    assert len(text) == LIMIT and text.startswith("{'kkkk") and text.endswith("...")
