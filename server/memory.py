"""What the server's batches can hold in memory, said in one line each at start.

The docs (docs/cli.md, --max-buffers) quote these formulas; the numbers come from the
configuration alone, so an operator sees the bound before any client connects.
"""

from __future__ import annotations


def host_memory_statement(
    max_buffers: int, batch_bytes: int, reserve: int, max_clients: int
) -> str:
    """What the batch buffers can hold at most, in host memory, said at start."""
    total = max_buffers * batch_bytes
    return (
        f"host memory bound for batches: {max_buffers} buffers (--max-buffers) x "
        f"{batch_bytes / 2**20:.1f} MiB a batch = {total / 2**20:.0f} MiB, shared by up to "
        f"{max_clients} clients (--max-clients; {reserve} kept for clients holding none); "
        "plus the process itself and the producers' decoded images"
    )


def gpu_memory_statement(
    producers: int, max_batch: int, max_image_pixels: int | None, batch_nbytes: int
) -> str:
    """The device memory the server's batches can hold at once, said at start.

    Each producer holds at most one batch's decode output (``max_batch`` images of at most
    ``max_image_pixels``: the decoder sends larger ones to the CPU) and its own output batch.
    """
    decode_mib = max_batch * (max_image_pixels or 0) * 3 / 2**20
    batch_mib = batch_nbytes / 2**20
    total = producers * (decode_mib + batch_mib)
    return (
        f"GPU memory bound: {producers} producers x (decode output {decode_mib:.0f} MiB + "
        f"batch {batch_mib:.0f} MiB) = {total:.0f} MiB; --producers and --batch-size scale it"
    )
