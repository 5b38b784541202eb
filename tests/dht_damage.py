"""A one-byte change in a Huffman table (DHT) that the restart path cannot see (issue 20).

The restart path decodes only the restart intervals under a crop. A changed DHT byte can leave
those intervals decodable, to other pixels, while the strict full decode of the file fails: a
fuzz run served one such file of 1,731 with wrong pixels. Hence the restart path is only for
bytes known intact (`DecodeRequest.intact`), and `dht_damaged` makes such a file to test it.
"""

from __future__ import annotations

import numpy as np
from batchwire.native.jpeg_transcode import transcode_restart
from batchwire.pipeline.decode import DecodeError, decode_for_crop, read_header
from corrupt_corpus import seed_jpeg, segments, strict_rejects

Box = tuple[float, float, float, float]
CORNER: Box = (0.0, 0.0, 24.0, 32.0)


def restart_marked(seed: int, size: tuple[int, int] = (96, 128)) -> bytes:
    """A noisy 4:2:0 JPEG with a restart marker after every MCU (as pipeline-prepare writes)."""
    return transcode_restart(seed_jpeg("base420", size[0], size[1], seed=seed), 1)


def dht_damaged(
    seed: int = 7, box: Box = CORNER, out_hw: tuple[int, int] = (24, 24)
) -> tuple[bytes, bytes]:
    """(intact, damaged): `restart_marked(seed)` and the first one-byte change of its DHT
    segments that the strict full decode rejects while the restart path decodes `box` from it
    to pixels other than the intact file's. AssertionError when there is none."""
    intact = restart_marked(seed)
    want = decode_for_crop(intact, read_header(intact), box, out_hw, intact=True)
    for marker, start, end in segments(intact)[0]:
        if marker != 0xC4:
            continue
        for at in range(start + 2, end):
            for new in (intact[at] ^ 1, intact[at] ^ 0x10):
                data = intact[:at] + bytes([new]) + intact[at + 1 :]
                if strict_rejects(data) is None:
                    continue
                try:
                    got = decode_for_crop(data, read_header(data), box, out_hw, intact=True)
                except (DecodeError, ValueError):
                    continue
                if not np.array_equal(got.pixels, want.pixels):
                    return intact, data
    raise AssertionError("no DHT byte change decodes wrongly through the restart path")
