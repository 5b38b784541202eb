"""Where a loader runs: rank, world size and device resolved late, from the process itself."""

from __future__ import annotations

import pytest
import torch
from batchwire.client import RemoteLoader
from batchwire.client.placement import resolve_rank
from batchwire.common.devices import env_int, parse_device


def test_rank_and_world_size_are_read_when_used_not_when_built(monkeypatch):
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    loader = RemoteLoader("tcp://127.0.0.1:9", device="cpu")  # built "before DDP starts"
    assert (loader.rank, loader.world_size) == (0, 1)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")  # the launcher's process group exists now
    assert (loader.rank, loader.world_size) == (1, 2)
    assert loader.state_dict()["world_size"] == 2
    loader.close()


def test_world_size_without_rank_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="WORLD_SIZE=4 is set but RANK is not"):
        resolve_rank(None, None)
    assert resolve_rank(2, None) == (2, 4)  # an explicit rank is enough
    monkeypatch.setenv("WORLD_SIZE", "four")
    with pytest.raises(ValueError, match="not an integer"):
        env_int("WORLD_SIZE", 1)


@pytest.mark.parametrize(
    ("spec", "index", "want"),
    [("cpu", None, "cpu"), ("cuda", None, "cuda"), ("cuda", 0, "cuda:0"), ("cuda:3", 0, "cuda:3")],
)
def test_device_strings(spec, index, want):
    assert parse_device(spec, default_index=index) == torch.device(want)


@pytest.mark.parametrize("spec", ["gpu", "cuda:x", "cpu:1", "meta", ""])
def test_other_device_strings_are_refused(spec):
    with pytest.raises(ValueError, match="cpu, cuda or cuda:N"):
        parse_device(spec)
