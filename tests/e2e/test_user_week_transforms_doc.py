"""docs/transforms.md's examples as a first-week user copies them: `my_transforms.py` (verbatim)
served by `--transform`, giving what the page says (the output size, uint8 on the wire, the
batches `LocalLoader(transform=...)` gives), and the `BatchMixer` loop over its batches."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from batchwire.client import RemoteLoader
from batchwire.pipeline.local import LocalLoader
from oddfiles import write_image_folder
from serverproc import running_server

PAGE = Path(__file__).resolve().parents[2] / "docs" / "transforms.md"
B = 4


def page_block(first_line: str) -> str:
    """The page's one ```python block that starts with ``first_line``."""
    (code,) = [
        b
        for b in re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)
        if b.startswith(first_line)
    ]
    return code


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("user-week")
    (tmp / "my_transforms.py").write_text(page_block("# my_transforms.py\n"))
    root = write_image_folder(tmp / "tree", classes=2, good_per_class=4)
    spec = f"{tmp}/my_transforms.py:solarize_crop"
    args = ("--train", str(root), "--transform", spec, "--image-size", "224")
    with running_server(*args, "--batch-size", str(B), "--workers", "1") as srv:
        yield srv, root, spec


def test_the_transform_example_serves_what_the_page_says(served) -> None:
    srv, root, spec = served
    loader = RemoteLoader(srv.endpoint, "train", device="cpu", normalize_on_device=False)
    loader.set_epoch(0)
    remote = [(x.clone(), y.clone()) for x, y in loader]
    loader.close()
    assert [tuple(x.shape) for x, _ in remote] == [(B, 3, 224, 224)] * 2  # 8 images, drop_last
    assert remote[0][0].dtype == torch.uint8  # the server's default output: cast, not normalised
    local = LocalLoader(
        root, split="train", batch_size=B, image_size=224, output_dtype="uint8", transform=spec
    )
    local.set_epoch(0)
    for (x, y), (lx, ly) in zip(remote, local, strict=True):
        assert torch.equal(x, lx) and torch.equal(y, ly)
    assert srv.stats()["counters"]["transform_errors_total"] == 0


def test_the_mixer_example_runs_as_written(served) -> None:
    srv, _, _ = served
    loader = RemoteLoader(srv.endpoint, "train", device="cpu")
    model = torch.nn.Sequential(
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(3, loader.num_classes)
    )
    namespace = {"loader": loader, "model": model, "epoch": 0, "rank": 0, "torch": torch}
    try:
        code = page_block("from batchwire.client.mixing import BatchMixer\n")
        exec(compile(code, str(PAGE), "exec"), namespace)
    finally:
        loader.close()
    targets = namespace["targets"]
    assert namespace["images"].dtype == torch.float32
    assert targets.shape == (B, loader.num_classes)
    assert torch.allclose(targets.sum(1), torch.ones(B))  # "soft targets, rows sum to 1"
