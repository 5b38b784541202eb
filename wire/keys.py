"""CURVE keys for the wire: one folder, made by `pipeline-keys`, is all a user handles.

    DIR/server.key, DIR/server.key_secret   the server's certificate (pyzmq's format)
    DIR/client.key, DIR/client.key_secret   the trainers' certificate
    DIR/authorized/*.key                    optional: more clients' public certificates

The same folder is copied to the trainer hosts. A server started with it accepts only clients
holding ``client.key_secret`` or a secret whose public half is in ``authorized/``; everything on
the wire is encrypted (CurveZMQ: Curve25519 keys, XSalsa20-Poly1305). A client needs
``client.key_secret`` and ``server.key`` (the server's public key, so a man in the middle cannot
pose as the server); the server's secret never has to leave the server's host.

ZeroMQ's own machinery does the work: `zmq.auth` writes and reads the certificates and a ZAP
authenticator thread (`zmq.auth.thread.ThreadAuthenticator`) answers the handshakes.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

_Z85_KEY_LENGTH = 40  # a 32-byte Curve25519 key in Z85, as pyzmq writes certificates
_Z85_ALPHABET = frozenset(z85.Z85CHARS)

#: Set to a keys folder to give every RemoteLoader (and pipeline-monitor) keys without code.
KEYS_ENV = "BATCHWIRE_KEYS"
SERVER, CLIENT, AUTHORIZED = "server", "client", "authorized"


class KeysError(ValueError):
    """A keys folder that cannot be used; the message says which file and what to do."""


def create_keys(directory: str | os.PathLike[str], *, force: bool = False) -> Path:
    """Write a new keys folder (server and client certificates, an empty ``authorized/``).

    Secret files are owner-only (0600), the folder 0700. Refuses to overwrite existing keys
    unless ``force``: replacing them locks out every host that still holds the old ones.
    """
    root = Path(directory)
    if not force and any((root / f"{name}.key_secret").exists() for name in (SERVER, CLIENT)):
        raise KeysError(f"{root} already holds keys; pass --force to replace them")
    root.mkdir(parents=True, exist_ok=True)
    (root / AUTHORIZED).mkdir(exist_ok=True)
    os.chmod(root, 0o700)
    old = os.umask(0o077)  # the secret files are born owner-only
    try:
        for name in (SERVER, CLIENT):
            zmq.auth.create_certificates(root, name)
    finally:
        os.umask(old)
    for name in (SERVER, CLIENT):
        os.chmod(root / f"{name}.key_secret", 0o600)
    return root


def _load(path: Path, secret: bool) -> tuple[bytes, bytes | None]:
    if not path.is_file():
        raise KeysError(f"{path} is missing (make the folder with `pipeline-keys DIR`)")
    try:
        public, private = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise KeysError(f"{path} is not a ZeroMQ certificate: {exc}") from None
    if secret and not private:
        raise KeysError(f"{path} holds no secret key")
    _check_key(path, "public", public)
    if private:
        _check_key(path, "secret", private)
    return public, private


def _check_key(path: Path, which: str, key: bytes) -> None:
    """A CURVE key is 40 Z85 characters (32 bytes); `zmq.auth` reads any quoted text, and a
    hand-edited or truncated file would fail later, at a socket, without naming the file. The
    message never shows the key."""
    if len(key) != _Z85_KEY_LENGTH or not set(key) <= _Z85_ALPHABET:
        raise KeysError(
            f"{path}: its {which} key is not a CURVE key ({len(key)} characters, 40 Z85 "
            "expected): the file is damaged; make the folder again with `pipeline-keys DIR`"
        )


@dataclass(frozen=True)
class ClientKeys:
    """What a client needs: its own key pair and the server's public key."""

    public: bytes
    secret: bytes
    server_public: bytes

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> ClientKeys:
        root = Path(directory)
        public, secret = _load(root / f"{CLIENT}.key_secret", secret=True)
        server_public, _ = _load(root / f"{SERVER}.key", secret=False)
        assert secret is not None
        return cls(public, secret, server_public)

    def apply(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (before it connects) a CURVE client of the server."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_serverkey = self.server_public


def client_keys(keys: str | os.PathLike[str] | None) -> ClientKeys | None:
    """``keys``, else ``$BATCHWIRE_KEYS``, loaded; None when neither is set (plain sockets)."""
    directory = keys if keys is not None else os.environ.get(KEYS_ENV) or None
    return None if directory is None else ClientKeys.load(directory)


class ServerKeys:
    """The server's key pair and the clients it admits; `guard` secures a ROUTER socket."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        root = Path(directory)
        self.public, self.secret = _load(root / f"{SERVER}.key_secret", secret=True)
        self.allowed = {_load(root / f"{CLIENT}.key", secret=False)[0]}
        extra = root / AUTHORIZED
        if extra.is_dir():
            self.allowed |= set(zmq.auth.load_certificates(extra))
        self._auth: ThreadAuthenticator | None = None

    def callback(self, domain: str, key: bytes) -> bool:
        """The ZAP decision (called on the authenticator's thread): is ``key`` admitted?"""
        return key in self.allowed

    def guard(self, ctx: zmq.Context, sock: zmq.Socket) -> None:
        """Start the ZAP authenticator (once per context) and make ``sock`` a CURVE server.

        Call before ``bind``. Anonymous peers and unknown keys fail the handshake: they never
        get a single message through, not even a stats reply.
        """
        if self._auth is None:
            self._auth = ThreadAuthenticator(ctx)
            self._auth.start()
            self._auth.configure_curve_callback("*", credentials_provider=self)
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True

    def stop(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


def build_parser() -> argparse.ArgumentParser:
    """`pipeline-keys`' arguments (the docs' command lines are checked against it)."""
    from batchwire.wire.cli import ArgumentParser
    from batchwire.wire.version import add_version_argument

    p = ArgumentParser(
        prog="pipeline-keys",
        description="Write a keys folder (CURVE certificates in pyzmq's format) for "
        "`pipeline-server --keys DIR` and its trainers (`RemoteLoader(keys=DIR)`, "
        "BATCHWIRE_KEYS=DIR, `pipeline-train --keys DIR`). Copy the folder to the trainer "
        "hosts; server.key_secret may stay on the server's host.",
    )
    add_version_argument(p)
    p.add_argument("directory", help="folder to create (made owner-only)")
    p.add_argument("--force", action="store_true", help="replace keys already there")
    return p


def main(argv: list[str] | None = None) -> int:
    """`pipeline-keys DIR`: write a keys folder for pipeline-server --keys and RemoteLoader."""
    p = build_parser()
    args = p.parse_args(argv)
    try:
        root = create_keys(args.directory, force=args.force)
    except (KeysError, OSError) as exc:
        print(f"pipeline-keys: error: {exc}")
        return 2
    print(
        f"wrote {root}/server.key(_secret), {root}/client.key(_secret) and {root}/authorized/\n"
        f"  server:   pipeline-server --keys {root} --bind tcp://0.0.0.0:5555 ...\n"
        f"  trainers: copy {root} to each host; RemoteLoader(..., keys=DIR) or "
        f"BATCHWIRE_KEYS=DIR"
    )
    return 0
