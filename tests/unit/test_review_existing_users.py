"""Existing users' code (it ran on 9611bed) that this session's argument checks now refuse."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from batchwire.client import RemoteLoader
from batchwire.client.mixing import BatchMixer
from batchwire.pipeline.local import LocalLoader
from batchwire.pipeline.transforms import RandomResizedCropFlip
from oddfiles import jpeg_bytes, smooth_image, write_image_folder

NOWHERE = "tcp://127.0.0.1:9"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_image_folder(tmp_path_factory.mktemp("rev") / "a", classes=2, good_per_class=8)


def test_batch_mixer_takes_a_class_count_computed_with_numpy():
    labels = np.array([0, 3, 1, 2])
    mixer = BatchMixer(num_classes=labels.max() + 1, mixup_alpha=0.8)  # np.int64
    _, targets = mixer(torch.rand(4, 3, 8, 8), torch.from_numpy(labels), epoch=0, batch_index=0)
    assert targets.shape == (4, 4)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"batch_size": np.int64(4)},
        {"seed": np.random.SeedSequence(1).generate_state(1)[0]},  # np.uint32
        {"threads": np.int64(1)},
        {"ring": np.int64(2)},
        {"max_pixels": 1e8},
    ],
    ids=str,
)
def test_local_loader_takes_numpy_integers_and_its_epochs(folder, kwargs):
    with LocalLoader(folder, **{"batch_size": 4, "image_size": 16, **kwargs}) as loader:
        for epoch in np.arange(2):  # np.int64 epochs
            loader.set_epoch(epoch)
            assert sum(len(labels) for _, labels in loader) == 16


def test_remote_loader_takes_a_numpy_prefetch_and_heartbeat():
    loader = RemoteLoader(NOWHERE, prefetch=np.int64(4), heartbeat=np.float32(2.0))
    loader.close()


def test_random_resized_crop_flip_takes_a_numpy_size():
    out = RandomResizedCropFlip((np.int64(16), np.int64(16)))(
        torch.zeros(40, 50, 3, dtype=torch.uint8), torch.Generator().manual_seed(0)
    )
    assert tuple(out.shape) == (3, 16, 16)


def test_local_loader_takes_a_list_of_tar_shards(tmp_path: Path):
    shards = []
    for s in range(2):
        path = tmp_path / f"s{s}.tar"
        with tarfile.open(path, "w") as t:
            for i in range(4):
                for ext, data in (
                    ("jpg", jpeg_bytes(smooth_image(40, 48, 10 * s + i))),
                    ("cls", str(i % 2).encode()),
                ):
                    info = tarfile.TarInfo(f"s{s}_{i}.{ext}")
                    info.size = len(data)
                    t.addfile(info, io.BytesIO(data))
        shards.append(str(path))
    with LocalLoader(shards, batch_size=4, image_size=16) as loader:
        assert sum(len(labels) for _, labels in loader) == 8
