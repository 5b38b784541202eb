"""Exceptions a RemoteLoader user can catch, each naming what went wrong and where.

`ProtocolError` (and its `VersionMismatch`) come from `batchwire.wire`, so a bad frame
raises the same type on either side of the wire.
"""

from __future__ import annotations

from batchwire.wire import ProtocolError, VersionMismatch

__all__ = ["LoaderError", "ProtocolError", "ServerError", "ServerUnavailable", "VersionMismatch"]


class LoaderError(RuntimeError):
    """RemoteLoader was used in a way it cannot serve (e.g. inside DataLoader workers)."""


class ServerUnavailable(ConnectionError, TimeoutError):
    """No pipeline-server answered (or came back) at an endpoint within the loader's timeout.

    Both a `ConnectionError` and a `TimeoutError`, so either ``except`` a caller already has
    catches it.
    """

    def __init__(self, endpoint: str, message: str) -> None:
        self.endpoint = endpoint
        super().__init__(message)

    def __str__(self) -> str:  # OSError.__str__ would prepend errno formatting
        return str(self.args[0])


class ServerError(RuntimeError):
    """The server refused a request (its `error` reply); the text is the server's."""

    def __init__(self, endpoint: str, message: str) -> None:
        self.endpoint = endpoint
        self.server_message = message
        super().__init__(f"pipeline-server at {endpoint} refused: {message}")

    @classmethod
    def refused_by_all(cls, refusals: dict[str, str]) -> ServerError:
        """Every server of the loader refused it: one error naming each server's reason (one
        server alone reads as before: ``pipeline-server at X refused: ...``)."""
        (first, message), *others = refusals.items()
        if not others:
            return cls(first, message)
        err = cls(first, message)
        err.args = (
            "every pipeline-server refused this loader: "
            + "; ".join(f"{ep} refused: {why}" for ep, why in refusals.items()),
        )
        return err
