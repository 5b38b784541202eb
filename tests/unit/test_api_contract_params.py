"""The public Python API as a user's own code calls it: documented parameters and defaults,
clear errors for bad values, and what a checkpoint or a pickle does with a loader.

No server here (a loader that never connects, `LocalLoader` on a small generated folder); the
lifecycle against a real server is tests/e2e/test_api_contract_loader.py.
"""

from __future__ import annotations

import collections
import inspect
import io
import json
import pickle
import re
from pathlib import Path

import pytest
import torch
from batchwire.client import (
    LoaderError,
    ProtocolError,
    RemoteLoader,
    ServerError,
    ServerUnavailable,
    VersionMismatch,
)
from batchwire.client.mixing import BatchMixer
from batchwire.pipeline.decode import DEFAULT_MAX_PIXELS
from batchwire.pipeline.local import LocalLoader
from oddfiles import write_image_folder

NOWHERE = "tcp://127.0.0.1:9"  # never connected to: these loaders stay unconnected


def documented_args(cls: type) -> list[str]:
    """The names an ``Args:`` section of ``cls``'s docstring documents (``a, b:`` is two)."""
    section = (cls.__doc__ or "").split("Args:")[1].split("\n\n")[0]
    found = re.finditer(r"^ {8}(\w+(?:, \w+)*): ", section, re.M)
    return [name for m in found for name in m.group(1).split(", ")]


def test_every_documented_argument_of_remote_loader_exists_and_every_argument_is_documented():
    params = set(inspect.signature(RemoteLoader.__init__).parameters) - {"self"}
    assert set(documented_args(RemoteLoader)) == params


def test_remote_loader_defaults_are_the_documented_ones():
    p = inspect.signature(RemoteLoader.__init__).parameters
    documented = {
        "split": "train",  # "train" or "val"
        "prefetch": 4,
        "timeout": 60.0,  # "60 s by default"
        "heartbeat": 1.0,
        "device": None,  # picks CUDA when available
        "normalize_on_device": None,
        "dtype": torch.float32,
        "prefetch_next_epoch": True,
        "reuse_buffers": True,
        "hold": 2,  # "default 2" (module docstring)
        "image_size": None,
        "batch_size": None,
        "with_indices": False,
        "with_metadata": False,
    }
    assert {k: p[k].default for k in documented} == documented
    loader = RemoteLoader(NOWHERE, rank=0, world_size=1)
    assert (loader.split, loader.prefetch, loader.timeout, loader.hold) == ("train", 4, 60.0, 2)
    assert loader.epoch == 0 and loader.next_batch == 0 and loader.image_size is None
    loader.close()


def test_local_loader_defaults_are_the_documented_ones():
    p = inspect.signature(LocalLoader.__init__).parameters
    documented = {
        "split": "train",
        "seed": 0,
        "rank": 0,
        "world_size": 1,
        "decoder": "cpu",
        "copy": True,  # "by default (`copy=True`)"
        "with_indices": False,
        "with_metadata": False,
        "verify_checksums": "auto",
        "max_pixels": DEFAULT_MAX_PIXELS,
    }
    assert {k: p[k].default for k in documented} == documented
    # batch_size and image_size have no default: they are keyword-only and required.
    assert p["batch_size"].default is inspect.Parameter.empty
    assert p["image_size"].default is inspect.Parameter.empty


def test_errors_are_the_documented_types():
    assert issubclass(ServerUnavailable, ConnectionError)
    assert issubclass(ServerUnavailable, TimeoutError)
    assert issubclass(LoaderError, RuntimeError) and issubclass(ServerError, RuntimeError)
    assert issubclass(VersionMismatch, ProtocolError)
    err = ServerUnavailable("tcp://h:1", "no pipeline-server answered at tcp://h:1")
    assert str(err) == "no pipeline-server answered at tcp://h:1" and err.endpoint == "tcp://h:1"
    refused = ServerError("tcp://h:1", "unknown split 'x'")
    assert refused.server_message == "unknown split 'x'" and "tcp://h:1" in str(refused)


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"prefetch": 0}, "prefetch"),
        ({"prefetch": 257}, "prefetch"),
        ({"timeout": 0}, "timeout"),
        ({"timeout": -1.0}, "timeout"),
        ({"heartbeat": 0}, "heartbeat"),
        ({"hold": 0}, "hold"),
        ({"hold": True}, "hold"),
        ({"hold": 65}, "hold"),
        ({"image_size": 0}, "image_size"),
        ({"image_size": (224,)}, "image_size"),
        ({"image_size": 224.0}, "image_size"),
        ({"image_size": True}, "image_size"),
        ({"image_size": 10**6}, "image_size"),
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": True}, "batch_size"),
        ({"batch_size": 10**9}, "batch_size"),
        ({"dtype": torch.int64}, "dtype"),
        ({"dtype": "float32"}, "dtype"),
        ({"stream": 1}, "stream"),
        ({"rank": -1, "world_size": 2}, "rank"),
        ({"rank": 2, "world_size": 2}, "rank"),
        ({"rank": 0, "world_size": 0}, "world_size"),
    ],
)
def test_remote_loader_refuses_bad_values_naming_the_parameter(kwargs, names):
    with pytest.raises(ValueError, match=names):
        RemoteLoader(NOWHERE, **kwargs)


@pytest.mark.parametrize("endpoints", ["localhost:5555", [], [NOWHERE, NOWHERE], b"tcp://h:1"])
def test_remote_loader_refuses_bad_endpoints(endpoints):
    with pytest.raises(ValueError, match="endpoints"):
        RemoteLoader(endpoints)


@pytest.mark.parametrize("epoch", [-1, True, 1.0, "1", None])
def test_set_epoch_refuses_anything_but_a_non_negative_int(epoch):
    loader = RemoteLoader(NOWHERE, rank=0, world_size=1)
    with pytest.raises(ValueError, match="epoch"):
        loader.set_epoch(epoch)
    loader.close()


def test_an_unconnected_state_survives_torch_load_weights_only_and_json():
    """A checkpoint's loader state is plain ints, strings and lists: the torch default
    ``weights_only=True`` loads it, and so does JSON."""
    loader = RemoteLoader(NOWHERE, rank=1, world_size=2, image_size=(24, 32), batch_size=8)
    loader.set_epoch(3)
    state = loader.state_dict()
    buf = io.BytesIO()
    torch.save({"loader": state}, buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=True)["loader"] == state
    assert json.loads(json.dumps(state)) == state
    other = RemoteLoader(NOWHERE, rank=0, world_size=2)
    other.load_state_dict(json.loads(json.dumps(state)))
    assert (other.epoch, other.next_batch, other.image_size) == (3, 0, (24, 32))
    assert other.state_dict()["batch_size"] == 8
    loader.close()
    other.close()


@pytest.mark.parametrize("state", [None, [], {"epoch": 1}])
def test_load_state_dict_of_a_non_state_is_an_error(state):
    loader = RemoteLoader(NOWHERE, rank=0, world_size=1)
    with pytest.raises((TypeError, ValueError)):
        loader.load_state_dict(state)
    loader.close()


def test_pickle_of_an_unconnected_loader_keeps_its_settings_and_position():
    loader = RemoteLoader(NOWHERE, "val", rank=0, world_size=1, prefetch=3, timeout=5.0)
    loader.set_epoch(2)
    copy = pickle.loads(pickle.dumps(loader))
    assert (copy.split, copy.prefetch, copy.timeout, copy.epoch) == ("val", 3, 5.0, 2)
    assert copy.state_dict() == loader.state_dict()
    loader.close()
    copy.close()
    copy.close()  # twice: harmless


def test_close_twice_and_context_manager_without_ever_connecting():
    with RemoteLoader(NOWHERE, rank=0, world_size=1) as loader:
        loader.close()
    loader.close()


# ---------------------------------------------------------------- BatchMixer


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_classes": 0},
        {"num_classes": 4, "mixup_alpha": -0.1},
        {"num_classes": 4, "cutmix_alpha": -1.0},
        {"num_classes": 4, "prob": 1.5},
        {"num_classes": 4, "prob": float("nan")},
        {"num_classes": 4, "switch_prob": -0.1},
        {"num_classes": 4, "label_smoothing": 1.0},
    ],
)
def test_batch_mixer_refuses_bad_values(kwargs):
    with pytest.raises(ValueError):
        BatchMixer(**kwargs)


def test_batch_mixer_is_deterministic_and_its_targets_sum_to_one():
    mixer = BatchMixer(num_classes=5, seed=3)
    images = torch.randn(6, 3, 8, 8)
    labels = torch.tensor([0, 1, 2, 3, 4, 0])
    a_images, a_targets = mixer(images, labels, epoch=2, batch_index=7)
    b_images, b_targets = mixer(images, labels, epoch=2, batch_index=7)
    assert torch.equal(a_images, b_images) and torch.equal(a_targets, b_targets)
    assert a_targets.shape == (6, 5)
    torch.testing.assert_close(a_targets.sum(1), torch.ones(6))
    with pytest.raises(TypeError, match="float"):
        mixer(images.to(torch.uint8), labels, epoch=0, batch_index=0)
    with pytest.raises(ValueError, match="labels"):
        mixer(images, torch.tensor([0, 1, 2, 3, 4, -1]), epoch=0, batch_index=0)
    # A padded slot (PADDING_LABEL, -100: an elastic resume's last train round) stays out of
    # the mix: its pixels as they are, an all-zero target row.
    padded, targets = mixer(images, torch.tensor([0, 1, 2, 3, 4, -100]), epoch=0, batch_index=0)
    assert torch.equal(padded[5], images[5]) and not targets[5].any()


# ---------------------------------------------------------------- LocalLoader and mixtures


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("api")
    a = write_image_folder(tmp / "a", classes=2, good_per_class=8)
    b = write_image_folder(tmp / "b", classes=2, good_per_class=4, seed=5)
    return a, b


@pytest.mark.parametrize(
    ("kwargs", "error", "names"),
    [
        ({"batch_size": 0}, ValueError, "batch_size"),
        ({"batch_size": 2.5}, TypeError, "batch_size"),
        ({"batch_size": True}, TypeError, "batch_size"),
        ({"image_size": 0}, ValueError, "image_size"),
        ({"image_size": (32,)}, ValueError, "image_size"),
        ({"image_size": None}, ValueError, "image_size"),
        ({"rank": 1}, ValueError, "rank"),
        ({"rank": 0.5, "world_size": 2}, TypeError, "rank"),
        ({"world_size": 0}, ValueError, "world_size"),
        ({"seed": -1}, ValueError, "seed"),
        ({"ring": 0}, ValueError, "ring"),
        ({"split": "test"}, ValueError, "split"),
        ({"decoder": "bogus"}, ValueError, "decoder"),
        ({"device": "tpu"}, ValueError, "device"),
        ({"verify_checksums": "maybe"}, ValueError, "verify"),
        ({"flip_prob": 2.0}, ValueError, "flip_prob"),
        ({"output_dtype": "int64"}, ValueError, "output_dtype"),
        ({"no_such_option": 1}, TypeError, "no_such_option"),
        ({"mix_schedule": "1:a=1"}, ValueError, "mix_schedule"),
        ({"batch_size": 10**6}, ValueError, "batch size"),
    ],
)
def test_local_loader_refuses_bad_values_naming_the_parameter(folders, kwargs, error, names):
    args = {"batch_size": 4, "image_size": 16, **kwargs}
    with pytest.raises(error, match=names):
        LocalLoader(folders[0], **args)


def test_local_loader_lifecycle(folders):
    loader = LocalLoader(folders[0], batch_size=4, image_size=16)
    it = iter(loader)
    next(it)
    loader.close()
    with pytest.raises(RuntimeError, match="closed"):
        next(it)
    loader.close()  # twice: harmless
    with LocalLoader(folders[0], batch_size=4, image_size=16) as again:
        assert sum(1 for _ in again) == len(again) == 4


def parts_drawn(data: str, **kwargs) -> collections.Counter:
    """How many samples of each part one epoch of a train mix draws."""
    with LocalLoader(data, batch_size=4, image_size=16, with_metadata=True, **kwargs) as loader:
        return collections.Counter(m["part"] for *_, meta in loader for m in meta)


def test_mix_weights_need_not_sum_to_one_and_a_zero_weight_part_is_not_drawn(folders):
    a, b = folders
    assert parts_drawn(f"mix:a=0.75@{a},b=0.25@{b}") == parts_drawn(f"mix:a=3@{a},b=1@{b}")
    assert parts_drawn(f"mix:a=1@{a},b=0@{b}") == {"a": 24}  # the epoch keeps its length
    # A schedule gives the zero-weight part its weight from epoch 1 on.
    with LocalLoader(
        f"mix:a=1@{a},b=0@{b}", batch_size=4, image_size=16, with_metadata=True,
        mix_schedule="1:a=0,b=1",
    ) as loader:  # fmt: skip
        loader.set_epoch(1)
        assert {m["part"] for *_, meta in loader for m in meta} == {"b"}


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ("a=0@{a},b=0@{b}", "must not all be 0"),
        ("a=-1@{a},b=1@{b}", "finite and >= 0"),
        ("a=nan@{a},b=1@{b}", "finite and >= 0"),
        ("a=inf@{a},b=1@{b}", "finite and >= 0"),
        ("a=1@{a},b=repeat:2@{b}", "the same way"),
        ("a=1@{a},a=1@{b}", "must differ"),
        ("a=1{a}", "NAME=VALUE@SOURCE"),
        ("a=1@{a};labels=bogus", "labels"),
    ],
)
def test_bad_mixes_are_refused_at_construction(folders, weights, message):
    a, b = folders
    with pytest.raises(ValueError, match=message):
        LocalLoader("mix:" + weights.format(a=a, b=b), batch_size=4, image_size=16)


def test_a_missing_mix_part_is_named(folders, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"mix part 'b'"):
        LocalLoader(f"mix:a=1@{folders[0]},b=1@{tmp_path / 'nope'}", batch_size=4, image_size=16)
