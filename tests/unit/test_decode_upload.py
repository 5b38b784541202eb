"""The CPU fallback's upload to the GPU (issue 25, "Also"): through pinned staging, queued on
the current stream, so the decoding thread never waits for the consumer's queued GPU work."""

from __future__ import annotations

import pytest
import torch
from batchwire.pipeline.decode.fallback import has_end_of_image, upload


def test_on_the_cpu_it_is_the_image() -> None:
    image = torch.arange(2 * 3 * 3, dtype=torch.uint8).view(2, 3, 3)
    assert torch.equal(upload(image, torch.device("cpu")), image)


def test_end_of_image_check() -> None:
    assert has_end_of_image(b"\xff\xd8 data \xff\xd9")
    assert has_end_of_image(b"\xff\xd8 data \xff\xd9" + b"\0" * 64)  # zero padding
    assert not has_end_of_image(b"\xff\xd8 data cut here")
    assert not has_end_of_image(b"\xff\xd8 data \xff\xd9 trailing text")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_upload_does_not_wait_for_the_stream() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    image = torch.randint(0, 256, (480, 640, 3), dtype=torch.uint8)
    stream = torch.cuda.current_stream(device)
    torch.cuda._sleep(2_000_000_000)  # about a second of queued GPU work on this stream
    got = upload(image, device)
    assert not stream.query(), "the host waited for the stream's queued work"
    assert got.device == device and got.is_contiguous()
    assert torch.equal(got.cpu(), image)  # ordered after the queued work, right pixels
