"""What goes wrong on the wire: one exception type either side raises for a bad frame."""

from __future__ import annotations

import reprlib

#: The protocol version both sides speak; a frame with another is refused, naming both.
PROTOCOL_VERSION = 2


class ProtocolError(ValueError):
    """A frame that is not a valid message; the text says what is wrong and where."""


class VersionMismatch(ProtocolError):
    """The peer speaks another protocol version."""

    def __init__(self, peer_version: object, own_version: int = PROTOCOL_VERSION) -> None:
        self.peer_version = peer_version
        self.own_version = own_version
        super().__init__(
            f"protocol version mismatch: peer speaks v{show(peer_version)}, "
            f"this side speaks v{own_version}"
        )


_SHOWN = reprlib.Repr()  # attributes, not keywords: Python 3.11 has no Repr(**limits)
_SHOWN.maxstring = _SHOWN.maxother = 60
_SHOWN.maxlist = _SHOWN.maxdict = 8
_SHOWN.maxlevel = 3
_SHOWN.maxlong = 40
# The whole quote: the limits above bound each part, but 8 x 8 x 8 parts of 60 characters
# (a nested map of strings) still came to some 32 KB in one error line.
_MAX_SHOWN = 200


def show(value: object) -> str:
    """A peer's value as an error message may quote it: short whatever the peer sent (a frame
    of 64 KiB must not come back as a reply several times larger, nor fill a log line)."""
    text = _SHOWN.repr(value)
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 3] + "..."
