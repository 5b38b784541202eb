"""batchwire.client: train from pipeline-servers with `RemoteLoader`.

from batchwire.client import RemoteLoader
loader = RemoteLoader("tcp://127.0.0.1:5555", split="train", device="cuda")
"""

from batchwire.client.errors import (
    LoaderError,
    ProtocolError,
    ServerError,
    ServerUnavailable,
    VersionMismatch,
)
from batchwire.client.labels import multi_hot
from batchwire.client.remote_loader import RemoteLoader

__all__ = [
    "LoaderError",
    "ProtocolError",
    "RemoteLoader",
    "ServerError",
    "ServerUnavailable",
    "VersionMismatch",
    "multi_hot",
]
