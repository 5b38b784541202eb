"""How the server names a peer in its stats, its error replies and its log: `shown`.

libzmq names a peer that sets no routing id (every `RemoteLoader`) 0x00 followed by a 32-bit
counter, one more for each such peer, and does not check that another peer has not claimed
that name for itself: the next anonymous peer given a claimed name aborts the whole server in
a libzmq assertion (router_socket.py seeds the counter's start, so it cannot be guessed
blind). Shown as it is, one anonymous peer's name would tell any peer that reads the stats
the name the next one gets. So such names are shown as a keyed hash (the key drawn once per
process: the same peer is the same name in the stats, the errors and the log; 10 hex digits,
as the name itself was), and a name a client chose itself, which tells nothing of anyone
else's, is shown as it is, in hex, unless it is 5 bytes long: such a name is hashed too, or a
peer could take another's shown name as its routing id and be shown as that peer.
"""

from __future__ import annotations

import hashlib
import os

#: libzmq's own names: a zero byte and a 32-bit counter.
_AUTOMATIC_LENGTH = 5
_KEY = os.urandom(16)


def shown(identity: bytes) -> str:
    """``identity`` as the server says it: hex, or a keyed hash of libzmq's own names."""
    if len(identity) == _AUTOMATIC_LENGTH:  # a chosen 5-byte name too: else a peer could
        # take another's shown name (10 hex digits) as its own and appear as that peer
        return hashlib.blake2b(identity, key=_KEY, digest_size=5).hexdigest()
    return identity.hex()
