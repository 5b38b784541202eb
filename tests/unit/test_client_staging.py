"""client/staging.py: a received batch's frames turned into the tensors the training loop gets.

`CpuStager` hands out the wire's bytes where ZeroMQ put them (no copy), in the wire's dtype and
layout, or normalised when handed out into a recycled output buffer that is reused only once
nobody refers to it. `CudaStager` (skipped without CUDA) copies through pinned slots to the
device. The frames are real `zmq.Frame`s; no socket.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import zmq
from batchwire import wire
from batchwire.client.normalize import IMAGENET_MEAN, IMAGENET_STD
from batchwire.client.staging import BatchFormat, CpuStager, CudaStager, Staged
from batchwire.wire import BatchSpec, ProtocolError

SPEC = BatchSpec(2, 4, 5, "uint8")
LABELS = [1, 2]


def fmt(
    spec: BatchSpec = SPEC, normalize: bool = False, out_dtype=torch.float32, **kw: int
) -> BatchFormat:
    """The welcome's format (``kw``: label_width, num_classes), ImageNet statistics."""
    return BatchFormat(spec, normalize, out_dtype, IMAGENET_MEAN, IMAGENET_STD, **kw)


def header(
    spec: BatchSpec = SPEC, batch_size: int | None = None, width: int = 0
) -> wire.BatchHeader:
    """Batch 0's header for ``spec``, of ``batch_size`` (default: the spec's) samples."""
    b = spec.batch_size if batch_size is None else batch_size
    this = BatchSpec(b, spec.height, spec.width, spec.dtype, spec.layout, spec.views)
    return wire.BatchHeader(
        1, "train", 0, 0, indices=list(range(b)), nbytes=this.nbytes, label_width=width,
        **this.wire_fields(),
    )  # fmt: skip


def wire_bytes(nbytes: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(
        0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


def labels_frame(labels: list[int]) -> zmq.Frame:
    return zmq.Frame(np.array(labels, dtype="<i8").tobytes())


def stage(
    stager: CpuStager | CudaStager,
    h: wire.BatchHeader,
    raw: torch.Tensor,
    labels: list[int] = LABELS,
) -> Staged:
    return stager.stage_frames(h, zmq.Frame(raw.numpy().tobytes()), labels_frame(labels))


def normalised(raw: torch.Tensor) -> torch.Tensor:
    """What normalisation should give of uint8 ``[B, 3, H, W]``, computed the plain way."""
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    return (raw.float() / 255 - mean) / std


def test_a_uint8_batch_is_handed_out_over_its_frames_memory() -> None:
    stager = CpuStager(fmt(), 2)
    raw = wire_bytes(SPEC.nbytes)
    images = zmq.Frame(bytearray(raw.numpy().tobytes()))
    staged = stager.stage_frames(header(), images, labels_frame(LABELS))
    got = staged.images
    stager.hand_out(staged)
    assert staged.images is got and not staged.normalize_pending
    assert (got.shape, got.dtype, got.is_contiguous()) == ((2, 3, 4, 5), torch.uint8, True)
    assert torch.equal(got.reshape(-1), raw)
    images.buffer[0] = (int(raw[0]) + 1) % 256  # no copy: the tensor is the frame's bytes
    assert int(got.reshape(-1)[0]) == (int(raw[0]) + 1) % 256
    assert (staged.labels.dtype, staged.labels.tolist()) == (torch.int64, LABELS)


def test_nhwc_bytes_are_handed_out_channels_last_in_the_logical_shape() -> None:
    spec = BatchSpec(2, 4, 5, "uint8", "nhwc")
    raw = wire_bytes(spec.nbytes)
    got = stage(CpuStager(fmt(spec), 2), header(spec), raw).images
    assert got.shape == (2, 3, 4, 5)
    assert got.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(got.permute(0, 2, 3, 1).reshape(-1), raw)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_a_float_wire_is_handed_out_in_its_own_dtype(dtype: str) -> None:
    spec = BatchSpec(2, 4, 5, dtype)
    values = torch.randn(spec.shape, generator=torch.Generator().manual_seed(1)).to(
        spec.torch_dtype
    )
    raw = values.reshape(-1).view(torch.uint8)
    got = stage(CpuStager(fmt(spec), 2), header(spec), raw).images
    assert got.dtype == spec.torch_dtype and torch.equal(got, values)


def test_a_frame_not_aligned_for_its_dtype_is_copied_to_aligned_memory() -> None:
    spec = BatchSpec(2, 4, 5, "float32")
    values = torch.randn(spec.shape, generator=torch.Generator().manual_seed(2))
    block = bytearray(1 + spec.nbytes)
    block[1:] = values.numpy().tobytes()
    odd = SimpleNamespace(buffer=memoryview(block)[1:])  # a small frame within ZeroMQ's buffer
    staged = CpuStager(fmt(spec), 2).stage_frames(header(spec), odd, labels_frame(LABELS))
    assert staged.images.data_ptr() % 4 == 0 and torch.equal(staged.images, values)


def test_a_multi_view_batch_is_one_tensor_per_view_over_consecutive_bytes() -> None:
    spec = BatchSpec(2, 8, 8, "uint8", views=((8, 8), (4, 4)))
    raw = wire_bytes(spec.nbytes)
    got = stage(CpuStager(fmt(spec), 2), header(spec), raw).images
    assert [tuple(v.shape) for v in got] == [(2, 3, 8, 8), (2, 3, 4, 4)]
    assert torch.equal(torch.cat([v.reshape(-1) for v in got]), raw)


def test_normalisation_waits_for_the_hand_out_and_runs_once() -> None:
    stager = CpuStager(fmt(normalize=True), 2)
    raw = wire_bytes(SPEC.nbytes)
    staged = stage(stager, header(), raw)
    assert staged.normalize_pending and staged.images.dtype == torch.uint8
    stager.hand_out(staged)
    want = normalised(raw.view(2, 3, 4, 5))
    torch.testing.assert_close(staged.images, want)
    stager.hand_out(staged)  # handed out again: nothing more to do
    torch.testing.assert_close(staged.images, want)


@pytest.mark.parametrize(
    ("out_dtype", "layout", "tol"),
    [(torch.float32, "nhwc", 1e-5), (torch.float16, "nchw", 1e-2), (torch.bfloat16, "nhwc", 2e-2)],
)
def test_a_normalised_batch_has_the_asked_dtype_in_the_wire_layout(
    out_dtype: torch.dtype, layout: str, tol: float
) -> None:
    spec = BatchSpec(2, 4, 5, "uint8", layout)
    stager = CpuStager(fmt(spec, normalize=True, out_dtype=out_dtype), 2)
    raw = wire_bytes(spec.nbytes)
    staged = stage(stager, header(spec), raw)
    stager.hand_out(staged)
    got = staged.images
    assert got.dtype == out_dtype and got.shape == (2, 3, 4, 5)
    assert got.is_contiguous(memory_format=spec.memory_format)
    want = normalised(spec.view_bytes(raw))
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=0)


def test_a_short_last_batch_is_handed_out_at_its_own_size() -> None:
    stager = CpuStager(fmt(normalize=True), 2)
    short = header(batch_size=1)
    raw = wire_bytes(short.nbytes)
    staged = stage(stager, short, raw, labels=[2])
    stager.hand_out(staged)
    assert staged.images.shape == (1, 3, 4, 5) and staged.labels.tolist() == [2]
    torch.testing.assert_close(staged.images, normalised(raw.view(1, 3, 4, 5)))


def test_an_output_is_reused_only_once_nobody_refers_to_it() -> None:
    stager = CpuStager(fmt(normalize=True), 2)
    first = stage(stager, header(), wire_bytes(SPEC.nbytes, seed=1))
    stager.hand_out(first)
    kept = first.images.clone()
    stager.release(first)  # the loader is done with it; the user still holds the tensor
    second = stage(stager, header(), wire_bytes(SPEC.nbytes, seed=2))
    stager.hand_out(second)
    assert second.images.data_ptr() != first.images.data_ptr()
    assert torch.equal(first.images, kept)  # not overwritten by the next batch
    stager.release(second)
    freed = second.images.data_ptr()
    del second  # nothing refers to its output any more: the next batch reuses it
    third = stage(stager, header(), wire_bytes(SPEC.nbytes, seed=3))
    stager.hand_out(third)
    assert third.images.data_ptr() == freed
    assert torch.equal(first.images, kept)


@pytest.mark.parametrize("labels", [[1], [1, 2, 0]])
def test_a_labels_frame_of_the_wrong_size_is_refused(labels: list[int]) -> None:
    with pytest.raises(ProtocolError, match="labels frame has"):
        stage(CpuStager(fmt(), 2), header(), wire_bytes(SPEC.nbytes), labels=labels)


def test_a_label_the_welcome_rules_out_is_refused_and_padding_is_not() -> None:
    stager = CpuStager(fmt(num_classes=3), 2)
    raw = wire_bytes(SPEC.nbytes)
    assert stage(stager, header(), raw, labels=[2, wire.PADDING_LABEL]).labels.tolist() == [
        2,
        wire.PADDING_LABEL,
    ]
    with pytest.raises(ProtocolError):
        stage(stager, header(), raw, labels=[3, 0])


def test_multi_label_rows_are_handed_out_as_b_by_k() -> None:
    rows = [[0, 2, -1], [wire.PADDING_LABEL] * 3]
    stager = CpuStager(fmt(label_width=3), 2)
    staged = stage(
        stager, header(width=3), wire_bytes(SPEC.nbytes), labels=[x for row in rows for x in row]
    )
    assert staged.labels.shape == (2, 3) and staged.labels.tolist() == rows


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("normalize", [False, True])
def test_the_cuda_stager_hands_out_batches_on_the_device(normalize: bool) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    stager = CudaStager(fmt(normalize=normalize), device, 2)
    assert stager.ring.pinned
    try:
        for n in range(5):  # more batches than slots: each slot is reused
            raw = wire_bytes(SPEC.nbytes, seed=n)
            staged = stage(stager, header(), raw, labels=[n % 3, 2])
            stager.hand_out(staged)
            images, labels = staged.images, staged.labels
            assert images.device == device and labels.device == device  # no CPU fallback
            want = raw.view(2, 3, 4, 5)
            want = normalised(want) if normalize else want
            assert images.dtype == want.dtype
            torch.testing.assert_close(images.cpu(), want)
            assert labels.tolist() == [n % 3, 2]
            stager.release(staged)
    finally:
        stager.close()
