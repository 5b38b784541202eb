"""Damage below a crop that only the region path's tail check reads (issue 32).

The region path entropy-decodes the rows below a crop only to verify them (`roi.ROI_VERIFY_TAIL`)
and skips that for bytes known intact. `tail_damaged` makes a file whose damage lies in its
bottom rows, so a crop above them shows which of the two a request took.
"""

from __future__ import annotations

from oddfiles import scan_data_span


def tail_damaged(data: bytes) -> bytes:
    """`data` (baseline) with the last tenth of its entropy-coded data cut out, EOI kept: the
    strict full decode fails in the bottom rows ("premature end of data segment")."""
    start, end = scan_data_span(data)
    return data[: end - (end - start) // 10] + b"\xff\xd9"
