"""Bounds on what a server's welcome or batch header may announce (wire/messages.py).

The loader sizes its buffers from the welcome (pinned slots on CUDA, scratch batches on the
CPU), so a hostile or broken server must not make it allocate terabytes: sides past
`MAX_IMAGE_SIDE` (the most a hello may ask for, and a server may serve) and images frames past
`MAX_BATCH_NBYTES` are a `ProtocolError` naming the field. The e2e side is
tests/e2e/test_hostile_server_audit.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import wirefakes
from batchwire import wire
from batchwire.wire.messages import MAX_BATCH_NBYTES, MAX_IMAGE_SIDE

SIDE = MAX_IMAGE_SIDE


def welcome_map(shape: list[int], views: list[list[int]] | None = None, dtype: str = "uint8"):
    m = wirefakes.welcome(1).to_map()
    m.update(shape=shape, batch_size=shape[0], dtype=dtype)
    if views:
        m["views"] = views
    return m


def header_map(shape: list[int], views: list[list[int]] | None = None, dtype: str = "uint8"):
    m = wirefakes.header(1, 0).to_map()
    m.update(shape=shape, dtype=dtype, indices=list(range(shape[0])))
    if views:
        m["views"] = views
    m["nbytes"] = wire.BatchSpec.from_shape(shape, dtype, "nchw", views or []).nbytes
    return m


CASES = {
    "height": ([1, 3, SIDE + 1, 8], None, "uint8", "'shape'"),
    "width": ([1, 3, 8, SIDE + 1], None, "uint8", "'shape'"),
    "sides of 2**40": ([1, 3, 1 << 40, 1 << 40], None, "uint8", "'shape'"),
    "a view's side": ([1, 3, 8, 8], [[8, 8], [8, SIDE + 1]], "uint8", "'views'"),
    "bytes": ([4096, 3, SIDE, SIDE], None, "uint8", "exceeds the protocol's"),
    "views' bytes": ([256, 3, 8, 8], [[8, 8]] + [[SIDE, SIDE]] * 63, "float32", "exceeds"),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kind", ["welcome", "header"])
def test_a_batch_past_the_bounds_is_refused_naming_the_field(case, kind):
    shape, views, dtype, words = CASES[case]
    if kind == "welcome":
        m, decode = welcome_map(shape, views, dtype), wire.Welcome.from_map
    else:
        m, decode = header_map(shape, views, dtype), wire.BatchHeader.from_map
    with pytest.raises(wire.ProtocolError, match=words):
        decode(m)


#: A full-side batch is 3 x 2**28 bytes an image (uint8): 21 fit in 16 GiB (63/64), 22 do not.
EDGES = {
    "21 images": ([21, 3, SIDE, SIDE], None, True),
    "22 images": ([22, 3, SIDE, SIDE], None, False),
    "7 images of 3 views": ([7, 3, SIDE, SIDE], [[SIDE, SIDE]] * 3, True),
    "7 images of 4 views": ([7, 3, SIDE, SIDE], [[SIDE, SIDE]] * 4, False),
}


@pytest.mark.parametrize("case", EDGES)
@pytest.mark.parametrize("kind", ["welcome", "header"])
def test_the_bound_is_on_the_whole_images_frame(case, kind):
    shape, views, fits = EDGES[case]
    assert (wire.BatchSpec.from_shape(shape, "uint8", "nchw", views or []).nbytes
            <= MAX_BATCH_NBYTES) is fits  # fmt: skip
    m = welcome_map(shape, views) if kind == "welcome" else header_map(shape, views)
    decode = wire.Welcome.from_map if kind == "welcome" else wire.BatchHeader.from_map
    if fits:
        assert decode(m).shape == shape
    else:
        with pytest.raises(wire.ProtocolError, match="exceeds the protocol's"):
            decode(m)


# --------------------------------------------------------------------------- labels


def labels_frame(values: list[int]) -> bytes:
    return wire.labels_to_frame(values).tobytes()


@pytest.mark.parametrize("values", [[0, 2, -100], [2, 2, 2]])
def test_class_ids_and_padding_pass_the_label_check(values):
    got = wire.labels_from_frame(labels_frame(values), 3, num_classes=3)
    assert got.tolist() == values


@pytest.mark.parametrize(
    "values", [[0, 3, 1], [10**12, 0, 0], [0, -5, 1], [-1, 0, 0], [-(2**63), 0, 0]]
)
def test_a_label_no_class_has_is_a_protocol_error(values):
    bad = next(v for v in values if not (0 <= v < 3 or v == -100))
    with pytest.raises(wire.ProtocolError, match=f"label {bad} is neither a class id"):
        wire.labels_from_frame(labels_frame(values), 3, num_classes=3)


def test_multi_label_rows_may_end_in_minus_one_and_nothing_else():
    rows = [[1, 2, -1], [-100, -100, -100]]
    got = wire.labels_from_frame(
        labels_frame([1, 2, -1, -100, -100, -100]), 2, width=3, num_classes=3
    )
    assert got.tolist() == rows
    with pytest.raises(wire.ProtocolError, match="label -7"):
        wire.labels_from_frame(labels_frame([1, -7, -1, 0, 0, 0]), 2, width=3, num_classes=3)


def test_the_check_also_guards_labels_received_in_place():
    """The CUDA path decodes into its pinned slot (``out``): the check runs there too."""
    out = np.zeros(2, dtype=np.int64)
    with pytest.raises(wire.ProtocolError, match="label 9"):
        wire.labels_from_frame(labels_frame([0, 9]), 2, out=out, num_classes=3)


def test_no_num_classes_checks_nothing():
    """A welcome without classes (0) and every older caller: labels as they come."""
    assert wire.labels_from_frame(labels_frame([10**12, -5]), 2).tolist() == [10**12, -5]
