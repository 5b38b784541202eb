"""The server's whole expected resident memory, said at start beside the buffers' bound.

The buffers' bound (`memory.host_memory_statement`, --max-buffers) is only part of what a
server holds: an operator sizing a pod or a Slurm job needs the whole figure. It is the sum of

- the process as it stands before any client: Python, torch, the fused op, the decoder, the
  datasets' paths and labels (measured: `VmRSS` of /proc/self/status at start, about 330 MiB
  for ImageNet-sized lists on CPU);
- the batch buffers at most (--max-buffers x a batch's bytes; the sample window's bytes are
  taken out of them, so they are inside);
- the producers' decoded images: each producer holds one batch of decoded images at a time (a
  crop never decodes more than its whole image: the median image's pixels x 3 bytes, the median
  of a few images sampled at start; datasets of larger images take more);
- for tar shards in a bucket, the read-ahead (pipeline/storage/readahead.py: members of the next
  batches held, at most a budget per split; `READ_AHEAD_RSS_FACTOR` x that budget);
- allocator slack (`SLACK_MIB`): freed decode buffers the C allocator keeps per thread for
  reuse rather than give back (measured below).

Caches are not here: the bucket cache is on disk (--cache-dir; its index is small), and the
page cache the kernel keeps of the dataset's files is not the process's resident memory.

Measured (2 cores, 1,000 ImageNet JPEGs, defaults: batch 64 at 224 px, 3 producers, 70 buffers):
at rest 331 MiB, peak (VmHWM) 626 MiB under 8 jobs of 12 batches each, against 332 + 643 + 103 +
64 = 1142 MiB stated (8 clients come nowhere near the buffers' bound); with --max-buffers 16, which
they fill, a 553 MiB peak against 646 MiB stated. tests/e2e/test_server_limits.py holds a loaded
server under its statement.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from batchwire.pipeline.decode import read_header
from batchwire.pipeline.image_dataset import ImageDataset

#: Freed decode buffers kept by the C allocator's per-thread arenas (measured, see the doc).
SLACK_MIB = 64
#: Resident memory per byte of a bucket tar split's read-ahead budget (`ImageDataset.
#: read_ahead_bytes`): its held members, the requests' buffers in flight and their copies. Measured:
#: peak RSS +157-183 MiB for a 64 MiB budget (bench/RESULTS.md, "Object storage: reading ahead").
READ_AHEAD_RSS_FACTOR = 3
_SAMPLED = 16  # images whose headers give the median image size


def resident_mib() -> float | None:
    """This process's resident memory now (VmRSS), MiB; None where /proc is not there."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def median_pixels(datasets: Sequence[ImageDataset], sample: int = _SAMPLED) -> int | None:
    """The median pixel count of up to `sample` images spread over each dataset (from their
    headers; unreadable ones skipped), or None when none could be read."""
    pixels: list[int] = []
    for dataset in datasets:
        n = len(dataset)
        count = min(n, sample)
        for i in (j * n // count for j in range(count)):  # evenly spaced, 0 first
            try:
                header = read_header(dataset.read_bytes(i), max_pixels=None)
            except Exception:  # an estimate: a sample that cannot be read is skipped
                continue
            pixels.append(header.height * header.width)
    return int(statistics.median(pixels)) if pixels else None


def expected_rss_statement(
    base_mib: float,
    buffers_mib: float,
    producers: int,
    batch: int,
    pixels: int | None,
    out_pixels: int,
    read_ahead_bytes: int = 0,
) -> str:
    """The start line: the whole expected resident memory and its parts (module doc).
    ``pixels``: the median image's (None: unknown, then the output size's x 4, a crop of
    twice the output's side); ``out_pixels``: one output image's; ``read_ahead_bytes``: the
    splits' read-ahead budgets (tar shards in a bucket), x `READ_AHEAD_RSS_FACTOR`."""
    each = pixels if pixels is not None else 4 * out_pixels
    decode_mib = producers * batch * each * 3 / 2**20
    ahead_mib = READ_AHEAD_RSS_FACTOR * read_ahead_bytes / 2**20
    total = base_mib + buffers_mib + decode_mib + ahead_mib + SLACK_MIB
    size = (
        f"the median sampled image's {each / 1e6:.2f} Mpx"
        if pixels is not None
        else f"{each / 1e6:.2f} Mpx (no image sampled)"
    )
    return (
        f"expected resident memory: up to about {total:.0f} MiB = {base_mib:.0f} MiB the "
        f"process now (Python, torch, the datasets) + {buffers_mib:.0f} MiB batch buffers at "
        f"most + {decode_mib:.0f} MiB decoded images ({producers} producers x {batch} images x "
        f"{size} x 3 bytes; larger images take more)"
        + (f" + {ahead_mib:.0f} MiB read-ahead (tar shards in a bucket)" if ahead_mib else "")
        + f" + {SLACK_MIB} MiB allocator slack"
    )
