"""server/admission.py: a hello's spec, and who holds a split's world size (pure rules; the
core's scenes in test_server_core.py play them through events)."""

from __future__ import annotations

from batchwire.server.admission import (
    AGREEMENT_IDLE_S,
    holds_world_size,
    spec_for,
    spec_text,
    world_size_conflict,
    world_size_holder,
)
from batchwire.server.config import ServerConfig
from batchwire.wire import BatchSpec, Hello
from coresim import session

CONFIG = ServerConfig(batch_size=8, image_size=32, max_batch_size=16, max_image_size=64)
SPEC = CONFIG.batch_spec()


def _hello(**kw) -> Hello:
    return Hello(
        **{**dict(split="train", rank=0, world_size=1, epoch=0, batches=(), session=1), **kw}
    )


def test_the_servers_spec_unless_the_hello_asks_for_another_size() -> None:
    assert spec_for(_hello(), SPEC, CONFIG) is SPEC
    assert spec_for(_hello(batch_size=16), SPEC, CONFIG) == BatchSpec(
        16, 32, 32, SPEC.dtype, SPEC.layout
    )
    sized = spec_for(_hello(image_size=(48, 40)), SPEC, CONFIG)
    assert isinstance(sized, BatchSpec) and (sized.height, sized.width) == (48, 40)


def test_what_the_buffers_cannot_hold_is_refused_with_the_flag_to_change() -> None:
    too_big = spec_for(_hello(batch_size=17), SPEC, CONFIG)
    assert isinstance(too_big, str) and "--max-batch-size 16" in too_big
    too_large = spec_for(_hello(image_size=(65, 64)), SPEC, CONFIG)
    assert isinstance(too_large, str) and "--max-image-size 64x64" in too_large


def test_a_session_holds_its_world_size_only_with_progress() -> None:
    idle = session(b"a", now=0.0)  # asked for nothing
    assert not holds_world_size(idle, 0.0)
    busy = session(b"b", asked=(0,), now=0.0)
    assert holds_world_size(busy, 100.0)  # it owes a batch
    busy.send_pos = 1  # sent what it asked: holds it for AGREEMENT_IDLE_S after its progress
    assert holds_world_size(busy, AGREEMENT_IDLE_S - 0.1)
    assert not holds_world_size(busy, AGREEMENT_IDLE_S + 0.1)


def test_another_world_size_of_the_same_split_and_job_is_held_off() -> None:
    holder = session(b"a", asked=(0,), world_size=2)
    assert world_size_holder([holder], b"b", _hello(world_size=1), 1.0) is holder
    assert world_size_holder([holder], b"a", _hello(world_size=1), 1.0) is None  # its own
    assert world_size_holder([holder], b"b", _hello(world_size=2), 1.0) is None
    assert world_size_holder([holder], b"b", _hello(world_size=1, job="other"), 1.0) is None
    text = world_size_conflict(_hello(world_size=1), holder, 4.0, timeout=30.0)
    assert "world_size=2" in text and "in 26.0 s" in text


def test_spec_text() -> None:
    assert spec_text(SPEC, SPEC) == ""
    other = BatchSpec(16, 48, 48, SPEC.dtype, SPEC.layout)
    assert spec_text(other, SPEC) == " at 48x48 in batches of 16"
