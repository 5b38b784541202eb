"""The augment op's launch probe (issue 25, defect 2): a device where the compiled op cannot
launch uses the reference, warned once. Run here with launchers that raise as a CUDA library
without this GPU's kernel image does; the probe's own code (tiny batch, wait, compare) is the
one a GPU runs."""

from __future__ import annotations

import logging

import pytest
import torch
from batchwire import native

NO_IMAGE = "CUDA error: no kernel image is available for execution on the device"


@pytest.fixture(autouse=True)
def _fresh_verdicts(monkeypatch):
    monkeypatch.setattr(native, "_checked", {})


def no_kernel_image(*args: object) -> torch.Tensor:
    """What a launch raises where the library has no kernel image for the GPU (torch >= 2.8
    raises CUDA errors as `torch.AcceleratorError`, a RuntimeError)."""
    raise torch.AcceleratorError(NO_IMAGE)


def test_a_launch_that_raises_is_reported() -> None:
    why = native.probe_launch(no_kernel_image, torch.device("cpu"))
    assert why is not None and "no kernel image" in why


def test_a_working_op_passes_and_a_wrong_one_does_not() -> None:
    cpu = torch.device("cpu")
    assert native.probe_launch(native.augment_batch_reference, cpu) is None
    if native.is_available():
        assert native.probe_launch(native.load().augment_batch, cpu) is None

    def garbage(images, boxes, flips, jitter, mean, std, out):
        return out.fill_(7.0)

    assert "differs from the reference" in native.probe_launch(garbage, cpu)


def test_failing_device_uses_the_reference_warned_once(caplog) -> None:
    calls = []

    def probe(fn, device):
        calls.append(str(device))
        return native.probe_launch(fn, device)

    cpu = torch.device("cpu")
    with caplog.at_level(logging.WARNING, logger="batchwire.native"):
        first = native.checked_on_device(no_kernel_image, cpu, probe)
        second = native.checked_on_device(no_kernel_image, cpu, probe)
    assert first is second is native.augment_batch_reference
    assert calls == ["cpu"]  # probed once per device
    warnings = [r for r in caplog.records if "launch probe" in r.getMessage()]
    assert len(warnings) == 1 and "no kernel image" in warnings[0].getMessage()
    assert "TORCH_CUDA_ARCH_LIST" in warnings[0].getMessage()


def test_a_passing_device_keeps_the_op() -> None:
    def op(images, boxes, flips, jitter, mean, std, out):
        return native.augment_batch_reference(images, boxes, flips, jitter, mean, std, out)

    assert native.checked_on_device(op, torch.device("cpu")) is op


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_compiled_op_passes_its_probe_on_this_gpu() -> None:
    """On a GPU host the CUDA build must launch: falling back to the reference fails here."""
    ops = native.load()
    assert ops.with_cuda, ops.build.plan.cuda_reason
    device = torch.device("cuda", torch.cuda.current_device())
    assert native.probe_launch(ops.augment_batch, device) is None
    assert native.augment_impl(device) is not native.augment_batch_reference
