"""Audit of user transforms as a trainer's own code writes them, in `LocalLoader` (in-process):
a transform built on a torch module (a learned colour layer, whose output requires grad) must
still yield plain batches: a batch that carries the transform's autograd graph would send the
model's gradients into the transform's parameters and keep every batch's graph alive. A result
that is not a dense tensor (sparse, quantized, nested) is a failed sample, counted and
replaced, not an error that fails the whole batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from batchwire.pipeline.local import LocalLoader
from batchwire.pipeline.transforms import RandomResizedCropFlip
from oddfiles import write_image_folder
from PIL import Image


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_image_folder(tmp_path_factory.mktemp("xf") / "tree", classes=2, good_per_class=6)


class ColourLayer(torch.nn.Module):
    """A user's learned 1x1 colour mix after the reference crop: its output requires grad."""

    def __init__(self) -> None:
        super().__init__()
        self.crop = RandomResizedCropFlip(32)
        self.mix = torch.nn.Conv2d(3, 3, 1)
        torch.nn.init.eye_(self.mix.weight.view(3, 3))
        torch.nn.init.zeros_(self.mix.bias)

    def forward(self, image: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return self.mix(self.crop(image, generator).unsqueeze(0))[0] / 255.0


def test_a_module_transform_yields_batches_without_its_autograd_graph(tree: Path) -> None:
    colour = ColourLayer()
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 2))
    loader = LocalLoader(
        str(tree), batch_size=4, image_size=32, seed=0, transform=colour, output_dtype="float32"
    )
    with loader:
        for images, labels in loader:
            assert not images.requires_grad and images.grad_fn is None
            loss = torch.nn.functional.cross_entropy(model(images), labels)
            loss.backward()
    assert model[1].weight.grad is not None
    assert colour.mix.weight.grad is None  # the model's loss never reached the transform


def _exotic(kind: str):
    """A transform that returns a dense result on even-height images and, on odd ones, a
    ``kind`` tensor: sparse (``to_sparse()``), quantized or nested."""
    crop = RandomResizedCropFlip(32)

    def transform(image: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        out = crop(image, generator)
        if image.shape[0] % 2 == 0:
            return out
        if kind == "sparse":
            return out.to_sparse()
        if kind == "quantized":
            return torch.quantize_per_tensor(out, 1.0, 0, torch.quint8)
        return torch.nested.nested_tensor(list(out))

    return transform


@pytest.mark.parametrize("kind", ["sparse", "quantized", "nested"])
def test_a_sparse_quantized_or_nested_result_is_a_counted_replaced_sample(
    tree: Path, kind: str
) -> None:
    """Not a dense tensor: replaced and counted like any result the server cannot send, not an
    error out of the value check that fails the whole batch."""
    heights = {_height(p) for p in tree.rglob("*.jpg")}
    assert {h % 2 for h in heights} == {0, 1}, heights  # both kinds of image in the tree
    with LocalLoader(
        str(tree), batch_size=4, image_size=32, seed=0, transform=_exotic(kind)
    ) as loader:
        batches = [images.clone() for images, _ in loader]
        assert loader.counts()["transform_errors_total"] > 0
    assert len(batches) == 3


def _height(path: Path) -> int:
    with Image.open(path) as im:
        return im.height
