"""wire/batch_spec.py: `BatchSpec.wire_fields`, what a welcome and a batch header say of a spec,
read back by `BatchSpec.from_shape` (through the messages' `spec`) as the same spec."""

from __future__ import annotations

import pytest
from batchwire import wire
from batchwire.wire import BatchSpec
from batchwire.wire.frames import pack

SPECS = [
    BatchSpec(8, 32, 48, "uint8", "nchw"),
    BatchSpec(4, 24, 24, "float16", "nhwc"),
    BatchSpec(2, 64, 64, "uint8", "nchw", ((64, 64), (64, 64), (16, 24))),  # multi-view
]


@pytest.mark.parametrize("spec", SPECS, ids=["single", "nhwc", "views"])
def test_the_wire_fields_read_back_as_the_spec(spec: BatchSpec) -> None:
    assert BatchSpec.from_shape(**spec.wire_fields()) == spec


@pytest.mark.parametrize("spec", SPECS, ids=["single", "nhwc", "views"])
def test_a_welcome_and_a_header_made_from_them_carry_the_spec(spec: BatchSpec) -> None:
    welcome = wire.Welcome(
        session=1,
        num_batches=3,
        num_samples=3 * spec.batch_size,
        batch_size=spec.batch_size,
        **spec.wire_fields(),
        mean=[0.5] * 3,
        std=[0.25] * 3,
        num_classes=3,
    )
    header = wire.BatchHeader(
        session=1,
        split="train",
        epoch=0,
        batch_index=0,
        **spec.wire_fields(),
        indices=list(range(spec.batch_size)),
        replaced=0,
        nbytes=spec.nbytes,
    )
    for message in (welcome, header):
        received = wire.decode_server_message(pack(message.to_map()))
        assert received.spec == spec  # type: ignore[union-attr]
