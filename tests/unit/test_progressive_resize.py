"""Progressive resizing (issue 22), in-process: the hello's image_size, the core's spec per
session (welcome, headers, orders, sharing key, refusals), the config bound, the producer."""

from __future__ import annotations

import pytest
import torch
from batchwire import wire
from batchwire.pipeline.local import LocalLoader
from batchwire.server.config import ServerConfig, config_from_toml
from batchwire.server.core import SendBatch, Submit
from batchwire.wire import ErrorReply, Hello, ProtocolError, Welcome
from coresim import Server


def test_the_hello_carries_an_image_size_only_when_asked() -> None:
    plain = Hello("train", 0, 1, 0, (0,), 1)
    assert "image_size" not in plain.to_map()  # the map older servers know
    sized = Hello("train", 0, 1, 0, (0,), 1, image_size=(48, 64))
    assert sized.to_map()["image_size"] == [48, 64]
    assert wire.decode_client_message(sized.pack()) == sized
    for bad in ([0, 4], [4], [True, 4], "48", [4, 99999]):
        m = {**plain.to_map(), "image_size": bad}
        with pytest.raises(ProtocolError, match="image_size"):
            Hello.from_map(m)


def test_max_image_size_is_checked_and_sizes_the_buffers(tmp_path) -> None:
    path = tmp_path / "s.toml"
    path.write_text('train = "/d"\nimage-size = 32\nmax-image-size = [48, 40]\n')
    config = ServerConfig(**config_from_toml(path))
    assert config.max_image_hw == (48, 40)
    assert config.capacity_spec().shape == [64, 3, 48, 40]
    assert config.batch_spec().shape == [64, 3, 32, 32]
    assert ServerConfig(train="/d").capacity_spec() == ServerConfig(train="/d").batch_spec()
    with pytest.raises(ValueError, match="at least --image-size"):
        ServerConfig(train="/d", image_size=64, max_image_size=48)
    with pytest.raises(ValueError, match="does not go with --views"):
        ServerConfig(train="/d", views="2x32:0.4-1", max_image_size=64)


def _server(**config) -> Server:
    return Server(config={"max_image_size": 16, "share_window": 8, **config})


def test_a_session_at_another_size_gets_its_own_welcome_headers_and_productions() -> None:
    s = _server()
    w8 = s.hello(b"a", batches=(0,), session=1)
    w16 = s.hello(b"b", batches=(0,), session=2, image_size=(16, 12))
    assert isinstance(w16, Welcome) and w16.shape[2:] == [16, 12] and w8.shape[2:] == [8, 8]
    submits = [a for a in s.tick() if isinstance(a, Submit)]
    # The same batch at two sizes is two productions (the sharing key has the size).
    assert len(submits) == 2
    specs = {a.order.session_serial: a.order.spec for a in submits}
    assert sorted(str(v) for v in specs.values()) == sorted([str(None), str(w16.spec)])
    s.finish()
    sends = {a.identity: a for a in s.tick() if isinstance(a, SendBatch)}
    assert sends[b"b"].header.shape[2:] == [16, 12]
    assert sends[b"b"].header.nbytes == w16.spec.nbytes
    assert sends[b"a"].header.shape[2:] == [8, 8]
    assert sends[b"a"].slot is not sends[b"b"].slot
    # Asking for the server's own size is the server's stream: shared with the first.
    s.hello(b"c", batches=(0,), session=3, image_size=(8, 8))
    assert not [a for a in s.tick() if isinstance(a, Submit)]


def test_a_size_beyond_the_bound_or_with_views_is_refused_saying_why() -> None:
    s = _server()
    err = s.hello(b"a", session=1, image_size=(24, 8))
    assert isinstance(err, ErrorReply) and err.session == 1 and err.reason == "refused"
    assert "larger than this server's --max-image-size 16x16" in err.message
    v = Server(config={"views": "1x8:0.5-1,2x4:0.1-0.5"})
    err = v.hello(b"a", session=1, image_size=(8, 8))
    assert isinstance(err, ErrorReply) and "multi-view" in err.message


def test_the_producer_at_another_size_equals_a_producer_started_there() -> None:
    def first(size: int, **kw) -> torch.Tensor:
        with LocalLoader(None, batch_size=4, image_size=size, seed=2, output_dtype="uint8") as ll:
            if kw:
                plan = next(iter(ll.sampler.plans(0)))
                out = ll.producer.config_at(kw["at"]).batch_spec(4).empty()
                ll.producer.produce(plan, out, image_size=kw["at"])
                return out
            return next(iter(ll))[0]

    assert torch.equal(first(24, at=(40, 40)), first(40))
    with LocalLoader(None, batch_size=4, image_size=24, output_dtype="uint8") as ll:
        plan = next(iter(ll.sampler.plans(0)))
        with pytest.raises(ValueError, match="out must be"):
            ll.producer.produce(
                plan, torch.empty(4, 3, 24, 24, dtype=torch.uint8), image_size=(32, 32)
            )
