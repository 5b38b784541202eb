"""Who may reach the server: the bind policy and the ipc socket's permissions.

Secure by default: a tcp:// endpoint that other hosts can reach needs ``--keys`` (CURVE: only
holders of the keys folder are served, everything encrypted, `wire.keys`), or an explicit
``--insecure``, which is then logged at every start. Loopback tcp and ipc stay plain: on one
host, file permissions guard an ipc socket (it is created owner-only) and loopback cannot be
reached from elsewhere. An abstract ipc socket (``ipc://@name``, Linux) has no file and so no
permissions: like loopback tcp, any process on the host (in its network namespace) may connect.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
from collections.abc import Iterator

log = logging.getLogger("batchwire.server")


def is_loopback(endpoint: str) -> bool:
    """Is ``endpoint`` reachable from this host only? (ipc://, inproc://, tcp to loopback)"""
    scheme, _, rest = endpoint.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    host = rest.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "*", an interface name, a host name: reachable from elsewhere
        return False


def bind_policy(endpoints: list[str], keys: str | None, insecure: bool) -> str | None:
    """Why these binds are refused, or None; logs the risk when ``insecure`` allows them."""
    exposed = [e for e in endpoints if not is_loopback(e)]
    if not exposed or keys is not None:
        return None
    if insecure:
        log.warning(
            "--insecure: %s can be reached from other hosts without keys: anyone who reaches it "
            "can read the dataset and the trainers' stats",
            ", ".join(exposed),
        )
        return None
    return (
        f"{', '.join(exposed)} can be reached from other hosts, and without keys anyone who "
        "reaches it can read the whole dataset. Either make a keys folder with `pipeline-keys "
        "DIR`, start with --keys DIR and give the trainers the same folder (RemoteLoader(keys="
        "DIR) or BATCHWIRE_KEYS=DIR), or accept the risk with --insecure"
    )


@contextlib.contextmanager
def owner_only(endpoint: str) -> Iterator[None]:
    """Around binding ``endpoint``: an ipc socket file is born owner-only (umask 077: 0700 for
    a socket, no group or other access). An abstract one (``ipc://@name``) has no file to
    guard (module doc)."""
    if not endpoint.startswith("ipc://"):
        yield
        return
    old = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(old)
