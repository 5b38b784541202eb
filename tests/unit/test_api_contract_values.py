"""Values a user's code may pass that the API took silently before (public API audit):
each must be refused at once, naming the argument, or do what it says."""

from __future__ import annotations

import math

import pytest
from batchwire.client import RemoteLoader
from batchwire.client.mixing import BatchMixer
from batchwire.pipeline.local import LocalLoader
from oddfiles import write_image_folder

NOWHERE = "tcp://127.0.0.1:9"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_image_folder(tmp_path_factory.mktemp("api") / "a", classes=2, good_per_class=8)


@pytest.mark.parametrize("name", ["timeout", "heartbeat"])
@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_remote_loader_refuses_non_finite_seconds_naming_them(name, value):
    # Before: accepted; the first len()/iter() raises "OverflowError: cannot convert float
    # infinity to integer" (or "ValueError: cannot convert float NaN to integer").
    with pytest.raises(ValueError, match=name):
        RemoteLoader(NOWHERE, **{name: value})


@pytest.mark.parametrize(
    "kwargs",
    [
        {"rank": True, "world_size": 2},
        {"rank": 0.5, "world_size": 2},
        {"rank": 0, "world_size": 2.0},
    ],
)
def test_remote_loader_refuses_a_rank_or_world_size_that_is_not_an_int(kwargs):
    # Before: accepted; rank=True is saved as "rank": True, rank=0.5 reaches the server, which
    # answers "malformed message: field 'rank' must be an integer".
    with pytest.raises((TypeError, ValueError), match=r"rank|world_size"):
        RemoteLoader(NOWHERE, **kwargs)


@pytest.mark.parametrize("value", [True, 2.5, "4", None])
def test_remote_loader_refuses_a_prefetch_that_is_not_an_int(value):
    # Before: True -> 1 and 2.5 -> 2 silently; "4" and None raise "'<=' not supported ...".
    with pytest.raises((TypeError, ValueError), match="prefetch"):
        RemoteLoader(NOWHERE, prefetch=value)


@pytest.mark.parametrize(
    "state",
    [
        {"next_batch": 10**6},
        {"next_batch": 3.5},
        {"epoch": True},
        {"world_size": 0},
        {"next_batch": None},
    ],
)
def test_load_state_dict_refuses_a_position_no_loader_saves(state):
    loader = RemoteLoader(NOWHERE, rank=0, world_size=1)
    saved = {
        "epoch": 0,
        "next_batch": 3,
        "split": "train",
        "rank": 0,
        "world_size": 1,
        "start_sample": 0,
        "epoch_world_size": 1,
        "epoch_shape": {"num_batches": 25, "batch_size": 16, "num_samples": 400},
    }
    # Before: 10**6 (past the saved 25-batch epoch) gives an empty pass, 3.5 and True are
    # truncated, world_size 0 restores; None raises "int() argument must be ... not 'NoneType'".
    with pytest.raises(ValueError, match="state"):
        loader.load_state_dict({**saved, **state})
    loader.close()


def test_local_loader_refuses_an_image_size_beyond_the_wire_limit(folder):
    # Before: OSError: [Errno 12] Cannot allocate memory (a 3 x 10^12-byte ring buffer).
    with pytest.raises(ValueError, match="image_size"):
        LocalLoader(folder, batch_size=4, image_size=10**6)


@pytest.mark.parametrize("data", ["", 123])
def test_local_loader_refuses_data_that_is_no_dataset(folder, data, monkeypatch):
    monkeypatch.chdir(folder)  # an ImageFolder happens to be the current directory
    # Before: "" opens the current directory as the dataset, silently; 123 raises
    # "TypeError: 'int' object is not subscriptable".
    with pytest.raises((TypeError, ValueError), match="data"):
        LocalLoader(data, batch_size=1, image_size=16)


@pytest.mark.parametrize("epoch", [-1, True, 1.5, "2", None])
def test_local_loader_set_epoch_refuses_what_remote_loader_refuses(folder, epoch):
    # Before: True -> 1, 1.5 -> 1, "2" -> 2 silently; -1 only fails at the next iter().
    loader = LocalLoader(folder, batch_size=4, image_size=16)
    with pytest.raises(ValueError, match="epoch"):
        loader.set_epoch(epoch)
    loader.close()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_classes": 4, "mixup_alpha": math.inf, "cutmix_alpha": 0.0},
        {"num_classes": 4, "mixup_alpha": math.nan},
        {"num_classes": 4, "cutmix_alpha": math.nan},
        {"num_classes": 4.5},
        {"num_classes": True},
    ],
)
def test_batch_mixer_refuses_non_finite_alphas_and_non_int_class_counts(kwargs):
    # Before: accepted; inf mixes every batch into NaN images and NaN targets, nan raises
    # numpy's "a <= 0" on some batches, 4.5 and True fail inside torch at the first call.
    with pytest.raises(ValueError):
        BatchMixer(**kwargs)


def test_spaces_around_a_later_parts_name_split_the_mix_as_around_the_first(folder):
    # Before: the second part is read as part of the first one's path:
    # "mix part 'a' (A , b = 1 @ A): dataset path does not exist".
    with LocalLoader(
        f"mix: a = 1 @ {folder} , b = 1 @ {folder}",
        batch_size=4,
        image_size=16,
        with_metadata=True,
    ) as loader:
        assert {m["part"] for *_, meta in loader for m in meta} == {"a", "b"}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"threads": 0},
        {"threads": -1},
        {"ring": None},
        {"ring": 1.5},
        {"seed": None},
        {"seed": -1},
        {"batch_size": None},
        {"batch_size": True},
        {"max_pixels": 0},
    ],
    ids=str,
)
def test_local_loader_refuses_an_integer_argument_that_is_not_one_naming_it(folder, kwargs):
    # Before: threads <= 0 fell back to the default unsaid; None gave a TypeError naming nothing.
    args = {"batch_size": 4, "image_size": 16, **kwargs}
    with pytest.raises((TypeError, ValueError), match=next(iter(kwargs))):
        LocalLoader(folder, **args)


def test_local_loader_refuses_one_checksum_folder_given_as_a_string(folder, tmp_path):
    # Before: the string was read as a list of one-character folder names.
    with pytest.raises(ValueError, match="checksum_dirs must be a list"):
        LocalLoader(folder, batch_size=4, image_size=16, checksum_dirs=str(tmp_path))


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"size": 0}, "size"),
        ({"size": (32,)}, "size"),
        ({"size": 32.5}, "size"),
        ({"size": 32, "scale": (2.0, 1.0)}, "scale"),
        ({"size": 32, "ratio": (0.0, 1.0)}, "ratio"),
        ({"size": 32, "flip_prob": 1.5}, "flip_prob"),
        ({"size": 32, "mean": (0.5, 0.5, 0.5)}, "mean and std"),
        ({"size": 32, "mean": (0.5, 0.5, 0.5), "std": (0.5, 0.0, 0.5)}, "std"),
    ],
    ids=str,
)
def test_random_resized_crop_flip_checks_its_arguments_when_built(kwargs, names):
    # Before: accepted; each sample then failed on the producer threads (std 0: inf values).
    from batchwire.pipeline.transforms import RandomResizedCropFlip

    with pytest.raises(ValueError, match=names):
        RandomResizedCropFlip(**kwargs)
