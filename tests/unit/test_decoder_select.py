"""make_decoder: picks, logs why, and fails clearly for what cannot run on this machine."""

from __future__ import annotations

import logging

import pytest
import torch
from batchwire.pipeline.decode import BatchDecoder, CpuBatchDecoder, DecodeRequest, read_header
from batchwire.pipeline.decode.dali import dali_available
from batchwire.pipeline.decode.select import make_decoder
from oddfiles import odd_file_bytes

CUDA = torch.cuda.is_available()


def decode_one(decoder: BatchDecoder) -> torch.Tensor:
    data = odd_file_bytes("rgb")
    h = read_header(data)
    req = DecodeRequest(
        0, data, h, (0.0, 0.0, float(h.height), float(h.width)), (h.height, h.width)
    )
    (res,) = decoder.decode_batch([req])
    assert res.error is None
    return res.image


def chosen(caplog) -> str:
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("decoder: ")]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("name", ["cpu", "auto"])
def test_cpu_and_auto_on_cpu_pick_the_cpu_decoder(name, caplog):
    with caplog.at_level(logging.INFO, logger="batchwire.pipeline"):
        dec = make_decoder(name, "cpu", 2)
    assert isinstance(dec, CpuBatchDecoder) and isinstance(dec, BatchDecoder)
    assert dec.threads == 2
    line = chosen(caplog)
    assert line.startswith("decoder: cpu on cpu, 2 threads")
    assert ("auto on CPU" in line) if name == "auto" else ("asked for by name" in line)
    assert decode_one(dec).shape == (96, 128, 3)
    dec.close()


@pytest.mark.skipif(not dali_available(), reason="NVIDIA DALI is not installed")
def test_dali_on_cpu_is_the_dali_cpu_backend(caplog):
    from batchwire.pipeline.decode.dali import DaliBatchDecoder

    with caplog.at_level(logging.INFO, logger="batchwire.pipeline"):
        dec = make_decoder("dali", "cpu", 1)
    assert isinstance(dec, DaliBatchDecoder) and isinstance(dec, BatchDecoder)
    assert dec.device == torch.device("cpu")
    assert chosen(caplog).startswith("decoder: dali on cpu, 1 threads")
    assert decode_one(dec).shape == (96, 128, 3)
    assert dec.fallbacks == 0
    dec.close()


def test_nvjpeg_on_cpu_is_a_clear_error():
    with pytest.raises(RuntimeError, match="decodes on a GPU"):
        make_decoder("nvjpeg", "cpu", 1)


@pytest.mark.skipif(CUDA, reason="checks the errors without CUDA")
@pytest.mark.parametrize("name", ["nvjpeg", "dali", "auto", "cpu"])
def test_cuda_device_without_cuda_is_a_clear_error(name):
    with pytest.raises(RuntimeError, match="needs CUDA, and torch sees no CUDA device"):
        make_decoder(name, "cuda", 1)


@pytest.mark.parametrize(("name", "device"), [("turbo", "cpu"), ("cpu", "tpu")])
def test_unknown_names_are_value_errors(name, device):
    with pytest.raises(ValueError, match=r"unknown decoder 'turbo'|device must be cpu, cuda"):
        make_decoder(name, device, 1)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_auto_on_cuda_prefers_dali_then_nvjpeg(caplog):
    from batchwire.pipeline.decode.nvjpeg import nvjpeg_decode_missing

    with caplog.at_level(logging.INFO, logger="batchwire.pipeline"):
        dec = make_decoder("auto", "cuda", 2)
    if dali_available():
        expected = "dali"
    elif nvjpeg_decode_missing("cuda:0") is None:  # imports *and* decoded the probe image
        expected = "nvjpeg"
    else:
        expected = "cpu"
    assert dec.name == expected
    assert chosen(caplog).startswith(f"decoder: {expected} on cuda")
    image = decode_one(dec)
    assert image.shape == (96, 128, 3)
    assert getattr(dec, "fallbacks", 0) == 0  # the chosen GPU decoder really decodes here


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_nvjpeg_by_name_is_refused_when_the_probe_fails():
    from batchwire.pipeline.decode.nvjpeg import nvjpeg_decode_missing

    missing = nvjpeg_decode_missing("cuda:0")
    if missing is None:  # nothing to refuse: asked for by name, it is built
        dec = make_decoder("nvjpeg", "cuda", 1)
        assert dec.name == "nvjpeg"
        dec.close()
        return
    with pytest.raises(RuntimeError, match="--decoder nvjpeg needs CUDA and torchvision"):
        make_decoder("nvjpeg", "cuda", 1)
