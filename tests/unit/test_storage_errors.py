"""Which store errors are transient (retried) and which are the sample's (counted, replaced):
the table of `pipeline.storage.errors`, walked over real obstore errors.

A transient error that never clears is retried for ever (the trainer ends with
ServerUnavailable), so every row here pins its class, errno and verdict. The HTTP answers come
from obstore itself, talking to a few lines of socket server in this process that answer one
status; the credential cases are obstore fetching credentials from an instance-metadata
endpoint that refuses, fails or is not there."""

from __future__ import annotations

import errno
import socket
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta

import obstore
import obstore.exceptions as oe
import pytest
from batchwire.pipeline.decode.files import is_transient
from batchwire.pipeline.storage.errors import CredentialsError, to_os_error


class _Responder:
    """A socket server answering every request with one status (or closing at once)."""

    def __init__(self, status: int | None) -> None:
        self.status = status
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                if self.status is not None:
                    body = b"<Error><Code>Nope</Code></Error>"
                    head = f"HTTP/1.1 {self.status} X\r\nContent-Length: {len(body)}\r\n\r\n"
                    conn.sendall(head.encode() + body)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def responders() -> Iterator[Callable[[int | None], int]]:
    made: dict[int | None, _Responder] = {}

    def port(status: int | None) -> int:
        if status not in made:
            made[status] = _Responder(status)
        return made[status].port

    yield port
    for r in made.values():
        r.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _store(endpoint: str, **kw: object):
    from obstore.store import S3Store

    return S3Store(
        "bkt",
        endpoint=endpoint,
        region="us-east-1",
        client_options={"allow_http": True, "timeout": "2s", "connect_timeout": "1s"},
        retry_config={"max_retries": 0, "retry_timeout": timedelta(seconds=2)},
        **kw,
    )


def _raised(call: Callable[[], object]) -> BaseException:
    try:
        call()
    except Exception as exc:  # what obstore really raises
        return exc
    raise AssertionError("no error")


def _status(port_of, status: int | None, ranged: bool = False) -> BaseException:
    """What obstore raises when the store answers `status` (None: closes the connection)."""
    store = _store(f"http://127.0.0.1:{port_of(status)}", access_key_id="a", secret_access_key="b")
    if ranged:
        return _raised(lambda: obstore.get_ranges(store, "k.jpg", starts=[0], ends=[9]))
    return _raised(lambda: obstore.get(store, "k.jpg").bytes())


def _credentials(port_of, status: int | None) -> BaseException:
    """What obstore raises when it has no keys and the metadata endpoint answers `status`
    (None: nothing listens there)."""
    port = _free_port() if status is None else port_of(status)
    store = _store("http://127.0.0.1:9", metadata_endpoint=f"http://127.0.0.1:{port}")
    return _raised(lambda: obstore.get(store, "k.jpg"))


OK, ENOENT, EACCES, EINVAL, EIO = None, errno.ENOENT, errno.EACCES, errno.EINVAL, errno.EIO

#: (case, how to get the error, class, errno, transient)
TABLE: list[tuple[str, Callable, type, int, bool]] = [
    ("400", lambda p: _status(p, 400), OSError, EINVAL, False),
    ("401", lambda p: _status(p, 401), PermissionError, EACCES, False),
    ("401 ranged", lambda p: _status(p, 401, ranged=True), PermissionError, EACCES, False),
    ("403", lambda p: _status(p, 403), PermissionError, EACCES, False),
    ("404", lambda p: _status(p, 404), FileNotFoundError, ENOENT, False),
    ("408", lambda p: _status(p, 408), OSError, EIO, True),
    ("416", lambda p: _status(p, 416), OSError, EINVAL, False),
    ("429", lambda p: _status(p, 429), OSError, EIO, True),
    ("500", lambda p: _status(p, 500), OSError, EIO, True),
    ("503", lambda p: _status(p, 503), OSError, EIO, True),
    ("connection closed", lambda p: _status(p, None), OSError, EIO, True),
    ("credentials: endpoint down", lambda p: _credentials(p, None), CredentialsError, EIO, True),
    ("credentials: endpoint 500", lambda p: _credentials(p, 500), CredentialsError, EIO, True),
    ("credentials: endpoint 403", lambda p: _credentials(p, 403), CredentialsError, EACCES, False),
    ("credentials: endpoint 404", lambda p: _credentials(p, 404), CredentialsError, EACCES, False),
    ("missing (MemoryStore)",
     lambda p: _raised(lambda: obstore.get(obstore.store.MemoryStore(), "k")),
     FileNotFoundError, ENOENT, False),
    ("empty range (ValueError)",
     lambda p: _raised(lambda: obstore.get_ranges(_store("http://127.0.0.1:9"), "k",
                                                  starts=[3], ends=[3])),
     OSError, EINVAL, False),
    ("body cut short", lambda p: oe.GenericError(
        "Generic S3 error: HTTP error: request or response body error"), OSError, EIO, True),
    ("join error", lambda p: oe.JoinError("task cancelled"), OSError, EIO, True),
    ("invalid path", lambda p: oe.InvalidPathError("bad path"), OSError, EINVAL, False),
    ("not supported", lambda p: oe.NotSupportedError("no"), OSError, EINVAL, False),
    ("unauthenticated, no status", lambda p: oe.UnauthenticatedError(
        "The operation lacked valid authentication credentials for path k"),
     PermissionError, EACCES, False),
    ("permission denied, no status", lambda p: oe.PermissionDeniedError("denied"),
     PermissionError, EACCES, False),
    ("builtin FileNotFoundError", lambda p: FileNotFoundError("x"), FileNotFoundError, ENOENT,
     False),
    ("builtin PermissionError", lambda p: PermissionError("x"), PermissionError, EACCES, False),
    ("builtin ConnectionResetError", lambda p: ConnectionResetError(errno.ECONNRESET, "reset"),
     OSError, EIO, True),
    ("builtin TimeoutError", lambda p: TimeoutError("slow"), OSError, EIO, True),
    ("builtin OSError(EMFILE)", lambda p: OSError(errno.EMFILE, "fds"), OSError, errno.EMFILE,
     True),
    ("builtin OSError(ENOSPC)", lambda p: OSError(errno.ENOSPC, "full"), OSError, errno.ENOSPC,
     False),
    ("anything else", lambda p: RuntimeError("what"), OSError, EINVAL, False),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "make", "kind", "code", "transient"), TABLE, ids=[t[0] for t in TABLE]
)
def test_store_error_table(responders, case, make, kind, code, transient):
    err = to_os_error(make(responders), "s3://b/k.jpg")
    assert type(err) is kind or (kind is OSError and type(err) is OSError), (case, type(err))
    assert err.errno == code, (case, err)
    assert is_transient(err) is transient, (case, err)
    assert "s3://b/k.jpg" in str(err)


def test_401_and_403_surface_as_eacces_for_the_readiness_check(responders):
    """The sample loader's watch on denied reads (pipeline.access, /readyz) counts reads failing
    with PermissionError: a store's refusal must stay exactly that, whatever words its answer
    holds ("credentials" among them), and so must a credential endpoint's refusal."""
    for status in (401, 403):
        err = to_os_error(_status(responders, status), "s3://b/k.jpg")
        assert isinstance(err, PermissionError) and not isinstance(err, CredentialsError)
        assert err.errno == errno.EACCES and "access denied (HTTP" in str(err)
    refused = to_os_error(_credentials(responders, 403), "s3://b/k.jpg")
    assert isinstance(refused, PermissionError) and refused.errno == errno.EACCES
    down = to_os_error(_credentials(responders, None), "s3://b/k.jpg")
    assert isinstance(down, CredentialsError) and is_transient(down)


@pytest.mark.parametrize(
    "exc",
    [
        MemoryError(),
        OSError(errno.EIO, "io"),
        OSError(errno.EAGAIN, "again"),
        OSError(errno.EINTR, "intr"),
        OSError(errno.ENFILE, "nfile"),
        OSError(errno.ENOMEM, "nomem"),
    ],
)
def test_the_transient_list_is_short_and_explicit(exc):
    assert is_transient(exc)


@pytest.mark.parametrize(
    "exc",
    [
        FileNotFoundError(errno.ENOENT, "x"),
        PermissionError(errno.EACCES, "x"),
        OSError(errno.EINVAL, "x"),
        OSError(errno.ENOSPC, "x"),
        OSError("no errno"),
        CredentialsError(errno.EACCES, "refused"),
        ValueError("x"),
    ],
)
def test_everything_else_is_the_samples(exc):
    assert not is_transient(exc)
