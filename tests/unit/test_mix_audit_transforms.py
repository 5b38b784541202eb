"""Audit of user transforms as a trainer's own code writes them, in `LocalLoader` (in-process):
a transform built on a torch module (a learned colour layer, whose output requires grad) must
still yield plain batches: a batch that carries the transform's autograd graph would send the
model's gradients into the transform's parameters and keep every batch's graph alive."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from batchwire.pipeline.local import LocalLoader
from batchwire.pipeline.transforms import RandomResizedCropFlip
from oddfiles import write_image_folder


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
