"""DALI packaging (issue 25, defect 6): DALI >= 1.44 (`exec_dynamic`), probed before `auto`
picks it, as nvJPEG is; the probe runs the decoder's own code on DALI's CPU backend here."""

from __future__ import annotations

import logging

import pytest
import torch
from batchwire.pipeline.decode import dali, select


def test_the_version_floor() -> None:
    assert dali.dali_version_problem("1.44.0") is None
    assert dali.dali_version_problem("2.4.0") is None
    problem = dali.dali_version_problem("1.43.1")
    assert problem is not None and ">= 1.44" in problem and "dali-cuda13" in problem
    assert dali.dali_version_problem("garbage") is not None


def test_an_old_dali_is_refused_by_the_probe_and_the_decoder(monkeypatch) -> None:
    nvidia_dali = pytest.importorskip("nvidia.dali")
    monkeypatch.setattr(nvidia_dali, "__version__", "1.43.0")
    assert ">= 1.44" in dali.dali_decode_missing("cpu")
    with pytest.raises(RuntimeError, match=r">= 1\.44"):
        dali.DaliBatchDecoder("cpu", threads=1)


def test_the_probe_decodes_on_dalis_cpu_backend() -> None:
    pytest.importorskip("nvidia.dali")
    assert dali.probe_dali("cpu") is None


def test_a_dali_that_fails_its_probe_is_passed_over_by_auto(monkeypatch, caplog) -> None:
    """`auto` on CUDA, decided without a GPU: the probes are injected, the choice is real."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(select, "dali_available", lambda: True)
    monkeypatch.setattr(select, "dali_decode_missing", lambda dev: "DALI on cuda:0 failed")
    monkeypatch.setattr(select, "nvjpeg_decode_missing", lambda dev: None)
    with caplog.at_level(logging.WARNING, logger="batchwire.pipeline"):
        name, why = select._auto_choice(cuda)
    assert name == "nvjpeg" and "DALI on cuda:0 failed" in why
    assert any("passes over DALI" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(select, "dali_decode_missing", lambda dev: None)
    assert select._auto_choice(cuda)[0] == "dali"
    monkeypatch.setattr(select, "dali_decode_missing", lambda dev: "old")
    monkeypatch.setattr(select, "nvjpeg_decode_missing", lambda dev: "no torchvision")
    name, why = select._auto_choice(cuda)
    assert name == "cpu" and "old" in why and "no torchvision" in why


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_dali_passes_its_probe_on_this_gpu() -> None:
    """On a GPU host with DALI installed, the mixed backend must decode the probe image."""
    pytest.importorskip("nvidia.dali")
    assert dali.dali_decode_missing("cuda:0") is None
