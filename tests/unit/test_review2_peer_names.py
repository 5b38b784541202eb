"""Review 2 (dc6472b): two peers are never shown under one name."""

from __future__ import annotations

from batchwire.server.peer_names import shown


def test_a_peer_cannot_choose_the_name_another_peer_is_shown_under() -> None:
    """libzmq's own names are shown as a keyed hash, a chosen one as its hex: any peer reading
    the stats can pick as its routing id the bytes of another's shown name (when its first
    byte is not 0) and be shown, in the stats rows, the log and world-size refusals, as that
    peer (pipeline-monitor's bottleneck view merges rows by this id)."""
    victims = [b"\x00" + k.to_bytes(4, "big") for k in range(0x6B8B4567, 0x6B8B4567 + 8)]
    for victim in victims:
        name = shown(victim)
        try:  # the bytes a peer would choose to be shown so: none, a shown name is no hex
            chosen = bytes.fromhex(name)
        except ValueError:
            continue
        assert shown(chosen) != name, f"{chosen!r} is shown as {victim!r}: {name}"
