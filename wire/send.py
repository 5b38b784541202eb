"""The batch send path, shared by the server and the transport benchmark.

A batch leaves as ``[identity?, header, images, labels]``. The images frame is the output
buffer itself (``copy=False``): ZeroMQ keeps a reference and the returned `MessageTracker`
says when it has let go; only then may the buffer be written again (reusing it earlier corrupts
batches still queued in ZeroMQ). `pyzmq`'s ``send_multipart(track=True)`` tracks only the last
frame, so the frames are sent one by one here.
"""

from __future__ import annotations

import numpy as np
import zmq
from batchwire.wire.frames import labels_to_frame
from batchwire.wire.messages import BatchHeader


def send_batch(
    sock: zmq.Socket,
    header: BatchHeader | bytes,
    images: np.ndarray | memoryview,
    labels: np.ndarray,
    identity: bytes | None = None,
) -> zmq.MessageTracker:
    """Send one batch without copying the images; returns the images frame's tracker.

    ``identity`` is the ROUTER routing frame (None on a DEALER/PUSH socket). Labels are sent as
    little-endian int64 (a copy only when they are not already that).
    """
    head = header if isinstance(header, bytes) else header.pack()
    if identity is not None:
        sock.send(identity, zmq.SNDMORE)
    sock.send(head, zmq.SNDMORE)
    frame = zmq.Frame(images, track=True, copy=False)
    sock.send(frame, zmq.SNDMORE, copy=False)
    sock.send(labels_to_frame(labels), 0, copy=True)
    return frame.tracker
