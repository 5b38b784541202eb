"""Review 2 (d1c9d06): the cap on a loader's servers is per name, the socket limit per loader."""

from __future__ import annotations

import zmq
from batchwire.client.discovery import Discovery
from batchwire.client.errors import ServerUnavailable

# A loader's connection is a DEALER and its monitor (2 sockets, plus the monitor's inproc PAIR
# libzmq makes): a context's 1023 sockets hold 341 of them.
CONNECTIONS_A_CONTEXT_HOLDS = zmq.Context.instance().get(zmq.MAX_SOCKETS) // 3


def two_hundred(name: str, port: int) -> list[str]:
    base = 1 if name == "a.example" else 2
    return [f"10.{base}.{i // 250}.{1 + i % 250}" for i in range(200)]


def test_two_names_of_200_servers_each_are_not_more_connections_than_a_loader_holds() -> None:
    """Each name is under MAX_SERVERS_PER_NAME (256), together they are 400: more than the
    341 connections a loader's context can open, so the loader's connect fails with the raw
    ZMQError ('Too many open files') the cap was meant to rule out."""
    discovery = Discovery(
        ["dns+tcp://a.example:5555", "dns+tcp://b.example:5555"], resolve=two_hundred
    )
    try:
        endpoints = discovery.initial()
    except ServerUnavailable:
        return
    assert len(endpoints) <= CONNECTIONS_A_CONTEXT_HOLDS, (
        f"{len(endpoints)} servers, a loader holds {CONNECTIONS_A_CONTEXT_HOLDS}"
    )
