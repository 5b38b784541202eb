"""How the server names a peer in its stats, its error replies and its log: `shown`.

libzmq names a peer that sets no routing id (every `RemoteLoader`) 0x00 followed by a 32-bit
counter, one more for each such peer, and does not check that another peer has not claimed
that name for itself: the next anonymous peer given a claimed name aborts the whole server in
a libzmq assertion (router_socket.py seeds the counter's start, so it cannot be guessed
blind). Shown as it is, one anonymous peer's name would tell any peer that reads the stats
the name the next one gets. So such names are shown as a keyed hash (the key drawn once per
process: the same peer is the same name in the stats, the errors and the log). Such a name is
"z" and 9 hex digits, 10 characters as the name in hex was; a name a client chose itself, which
tells nothing of anyone else's, is shown as it is, in hex: never with a "z", so no peer can take
another's shown name as its routing id and be shown as that peer.
"""

from __future__ import annotations

import functools
import hashlib
import os

#: libzmq's own names: a zero byte and a 32-bit counter.
_AUTOMATIC_LENGTH = 5


@functools.cache
def _key() -> bytes:
    """This process's key, drawn at first use, not at import: a process forked from one that
    imported this module (a fork server) draws its own."""
    return os.urandom(16)


def shown(identity: bytes) -> str:
    """``identity`` as the server says it: hex, or a keyed hash of libzmq's own names."""
    if len(identity) == _AUTOMATIC_LENGTH and identity[0] == 0:
        # "z" is no hex digit: no routing id is shown so, so no peer can pose as this one.
        return "z" + hashlib.blake2b(identity, key=_key(), digest_size=5).hexdigest()[:9]
    return identity.hex()
