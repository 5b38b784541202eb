"""Wire messages of a tiny stream, for tests that play a server by hand or drive the client core.

The stream: batches of 2 uint8 images of 3 x 4 x 4 (96 bytes), 3 classes, one split "train".
"""

from __future__ import annotations

from batchwire import wire

SHAPE = [2, 3, 4, 4]
NBYTES = 2 * 3 * 4 * 4


def welcome(session: int, num_batches: int = 2, shape: list[int] = SHAPE) -> wire.Welcome:
    """The welcome of a stream of `num_batches` full batches."""
    return wire.Welcome(
        session=session,
        num_batches=num_batches,
        num_samples=shape[0] * num_batches,
        batch_size=shape[0],
        shape=shape,
        dtype="uint8",
        layout="nchw",
        mean=[0.5] * 3,
        std=[0.25] * 3,
        num_classes=3,
    )


def header(session: int, k: int, epoch: int = 0, shape: list[int] = SHAPE) -> wire.BatchHeader:
    """Batch `k`'s header; its samples are 2k and 2k + 1."""
    return wire.BatchHeader(
        session=session,
        split="train",
        epoch=epoch,
        batch_index=k,
        shape=shape,
        dtype="uint8",
        layout="nchw",
        indices=[2 * k, 2 * k + 1],
        replaced=0,
        nbytes=shape[0] * shape[1] * shape[2] * shape[3],
    )
