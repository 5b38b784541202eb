"""Per-message decode cost of the control frames: today's msgpack + field-by-field validation
(`wire.messages`) against msgspec Structs carrying the same checks.

    python -m batchwire.bench.bench_wire_decode [--repeat 5] [--number 20000]

Issue 22 asked whether msgspec (typed structs, validated while decoding, in C) should replace
the hand-written checks of wire/messages.py. This decodes the three messages on the hot path,
each as it travels: `Hello` (4 batches), `Credit` (4 batches and a loader report) and
`BatchHeader` (256 indices), through both, and prints microseconds per message (best of
``--repeat`` runs of ``--number`` decodes). The msgspec side checks what today's code checks
(ranges, lengths, distinct batches, rank < world size, nbytes against the shape), some of it in
``__post_init__``, and is verified to accept the same frames. Needs ``pip install msgspec``.
"""

from __future__ import annotations

import argparse
import timeit
from typing import Annotated, Any

import msgspec
from batchwire import wire
from batchwire.wire.batch_spec import DTYPES, LAYOUTS, MAX_BATCH_SIZE, images_nbytes
from batchwire.wire.messages import MAX_JOB_LEN, MAX_PREFETCH
from msgspec import Meta

NonNeg = Annotated[int, Meta(ge=0)]
Batches = Annotated[list[NonNeg], Meta(max_length=MAX_PREFETCH)]
Name = Annotated[str, Meta(min_length=1)]


def _distinct(batches: list[int]) -> None:
    if len(set(batches)) != len(batches):
        raise ValueError("field 'batches' lists a batch twice")


class Hello(msgspec.Struct, tag_field="type", tag="hello", forbid_unknown_fields=False):
    v: Annotated[int, Meta(ge=2, le=2)]
    split: Name
    session: int
    rank: NonNeg = 0
    world_size: Annotated[int, Meta(ge=1)] = 1
    epoch: NonNeg = 0
    batches: Batches = []
    job: Annotated[str, Meta(max_length=MAX_JOB_LEN)] = ""

    def __post_init__(self) -> None:
        if self.rank >= self.world_size:
            raise ValueError(f"field 'rank' ({self.rank}) must be < world_size")
        _distinct(self.batches)


class Credit(msgspec.Struct, tag_field="type", tag="credit"):
    v: Annotated[int, Meta(ge=2, le=2)]
    batches: Batches = []
    stats: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        _distinct(self.batches)


class BatchHeader(msgspec.Struct, tag_field="type", tag="batch"):
    v: Annotated[int, Meta(ge=2, le=2)]
    session: int
    split: Name
    epoch: NonNeg
    batch_index: NonNeg
    shape: Annotated[list[int], Meta(min_length=4, max_length=4)]
    dtype: str
    layout: str
    indices: list[int] = []
    replaced: NonNeg = 0
    nbytes: NonNeg = 0

    def __post_init__(self) -> None:
        b, c, h, w = self.shape
        if not (1 <= b <= MAX_BATCH_SIZE and c == 3 and h >= 1 and w >= 1):
            raise ValueError(f"field 'shape' must be [B, 3, H, W], got {self.shape}")
        if self.dtype not in DTYPES or self.layout not in LAYOUTS:
            raise ValueError("unknown dtype or layout")
        if len(self.indices) != b:
            raise ValueError(f"field 'indices' must have {b} items")
        if self.nbytes != images_nbytes(self.shape, self.dtype):
            raise ValueError("field 'nbytes' does not match the shape")


CLIENT = msgspec.msgpack.Decoder(Hello | Credit)
SERVER = msgspec.msgpack.Decoder(BatchHeader)


def frames() -> dict[str, tuple[bytes, Any, Any]]:
    """name -> (frame as it travels, today's decode, msgspec's decode)."""
    hello = wire.Hello(
        split="train", rank=1, world_size=8, epoch=3, batches=(8, 9, 10, 11), session=7, job="j"
    )
    report = {"prefetch_depth": 4, "wait_s_per_batch": 0.01, "data_wait_fraction": 0.02,
              "images_per_s": 2900.0}  # fmt: skip
    credit = wire.Credit(batches=(12, 13, 14, 15), stats=report)
    shape = [256, 3, 224, 224]
    header = wire.BatchHeader(
        session=7, split="train", epoch=3, batch_index=12, shape=shape, dtype="uint8",
        layout="nchw", indices=list(range(1000, 1256)), replaced=0,
        nbytes=images_nbytes(shape, "uint8"),
    )  # fmt: skip
    return {
        "Hello (4 batches)": (hello.pack(), wire.decode_client_message, CLIENT.decode),
        "Credit (4 batches + report)": (credit.pack(), wire.decode_client_message, CLIENT.decode),
        "BatchHeader (256 indices)": (header.pack(), wire.decode_server_message, SERVER.decode),
    }


def per_message_us(decode: Any, frame: bytes, number: int, repeat: int) -> float:
    runs = timeit.repeat(lambda: decode(frame), number=number, repeat=repeat)
    return 1e6 * min(runs) / number


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m batchwire.bench.bench_wire_decode")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--number", type=int, default=20000)
    args = p.parse_args(argv)
    print(f"msgspec {msgspec.__version__}; microseconds per decode, best of {args.repeat}")
    print("| message | bytes | today (msgpack + checks) | msgspec Struct | ratio |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, (frame, today, fast) in frames().items():
        ours, theirs = today(frame), fast(frame)
        assert type(ours).__name__ == type(theirs).__name__  # same message, both accept it
        a = per_message_us(today, frame, args.number, args.repeat)
        b = per_message_us(fast, frame, args.number, args.repeat)
        print(f"| {name} | {len(frame)} | {a:.2f} | {b:.2f} | {a / b:.1f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
