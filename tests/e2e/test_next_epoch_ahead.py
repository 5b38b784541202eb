"""The next epoch asked ahead, and only when it will be trained: `prefetch_next_epoch` set at any
time, pipeline-train (--epochs, --max-steps, --resize-schedule) and `RemoteLoaderCallback`
(max_epochs, max_steps, validation loaders, a later fit), and a saved position's output size.

One real pipeline-server (128 photos of the embedded val folder served as both splits, batches
of 16 at 32 px, 8 per epoch, logging each hello at INFO) is shared by the loader tests; what it was
asked for is read from its log (``hellos``), as tests/e2e/test_remote_loader_epochs.py does.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from batchwire.client import RemoteLoader
from batchwire.pipeline.synthetic import default_dataset
from serverproc import running_server, small_server_args

TRAIN_BIN = Path(sys.executable).parent / "pipeline-train"
CLASSES, PER_CLASS = 4, 32  # of the embedded val folder's 10 classes of 40 photos
BATCHES = CLASSES * PER_CLASS // 16  # 8 per epoch and split: more than a loader asks at once


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    root = tmp_path_factory.mktemp("photos")
    for folder in sorted(default_dataset().val_root.iterdir())[:CLASSES]:
        (root / folder.name).mkdir()
        for photo in sorted(folder.iterdir())[:PER_CLASS]:
            shutil.copyfile(photo, root / folder.name / photo.name)
    args = (*small_server_args(seed=9, root=str(root), val=True), "--max-image-size", "48")
    with running_server(*args) as server:
        yield server


def hellos(server, split: str, epoch: int) -> list[int | None]:
    """The first batch each hello the server logged for (split, epoch) asked for (None: an
    empty hello, as at an epoch's start; a number: an early hello's first batch)."""
    pattern = (
        rf": {split} epoch {epoch} rank \d+/\d+(?: at \S+)?, asks for (?:batch (\d+)|nothing yet)"
    )
    return [int(m) if m else None for m in re.findall(pattern, server.log())]


def new_hellos(server, split: str, epoch: int, before: int) -> list[int | None]:
    time.sleep(0.3)  # an early hello goes out as the last batch arrives: long before this
    return hellos(server, split, epoch)[before:]


def loader_for(endpoint: str, split: str = "train", **kw) -> RemoteLoader:
    return RemoteLoader(
        endpoint, split, rank=0, world_size=1, device="cpu", with_indices=True, timeout=60.0, **kw
    )


def batches(it) -> list[tuple[torch.Tensor, ...]]:
    return [tuple(t.clone() for t in batch) for batch in it]


def assert_same(got, want) -> None:
    """Bit-identical batches, in order."""
    assert len(got) == len(want), f"{len(got)} batches, {len(want)} expected"
    for k, (p, q) in enumerate(zip(got, want, strict=True)):
        for x, y in zip(p, q, strict=True):
            assert x.shape == y.shape, f"batch {k}: {tuple(x.shape)}, {tuple(y.shape)} expected"
            assert torch.equal(x, y), f"batch {k} differs"


def train(endpoint: str, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [str(TRAIN_BIN), "--server", endpoint, "--model", "small", "--device", "cpu", *extra]
    return subprocess.run(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=90
    )


@pytest.mark.timeout(120)
def test_pipeline_train_stopped_by_max_steps_asks_no_epoch_after_its_last(srv):
    """--max-steps ends the run at the end of epoch 0 of --epochs 2: epoch 0 is the last one
    trained and validated, so neither loader asks for epoch 1 ahead."""
    train_before, val_before = len(hellos(srv, "train", 1)), len(hellos(srv, "val", 1))
    done = train(srv.endpoint, "--epochs", "2", "--max-steps", str(BATCHES))
    assert done.returncode == 0, done.stdout
    assert "(stopped at --max-steps)" in done.stdout, done.stdout
    asked = {
        "train": new_hellos(srv, "train", 1, train_before),
        "val": new_hellos(srv, "val", 1, val_before),
    }
    assert asked == {"train": [], "val": []}, f"epoch 1 asked ahead for nothing: {asked}"


@pytest.mark.timeout(120)
def test_pipeline_train_asks_no_epoch_ahead_at_a_size_that_epoch_will_not_have(srv):
    """--resize-schedule 32:0,48:1: epoch 1 is not asked ahead at epoch 0's 32 px (it starts
    afresh at 48 px, and what was asked would be made for nothing)."""
    before = len(hellos(srv, "train", 1))
    done = train(
        srv.endpoint, "--epochs", "2", "--max-steps", str(BATCHES + 1), "--no-val",
        "--resize-schedule", "32:0,48:1",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout
    assert "epoch 1: training at 48x48 px" in done.stdout, done.stdout
    asked = new_hellos(srv, "train", 1, before)
    assert asked == [None], f"epoch 1 asked ahead at epoch 0's size: {asked}"


@pytest.mark.timeout(60)
def test_a_state_saved_with_a_next_size_pending_resumes_its_pass_at_the_pass_size(srv):
    """set_image_size applies from the next pass on: a state saved afterwards records the size
    of the pass its position is in, so the resumed pass goes on at that size (it went on at the
    pending size: silently different batches)."""
    with loader_for(srv.endpoint, image_size=40) as loader:
        it = iter(loader)
        batches(next(it) for _ in range(5))
        loader.set_image_size(48)  # for the next pass; this one keeps 40 px
        state = loader.state_dict()
        rest = batches(it)
    assert rest[0][0].shape[-1] == 40
    with loader_for(srv.endpoint) as resumed:
        resumed.load_state_dict(state)
        assert_same(batches(resumed), rest)


def _lightning_module():
    L = pytest.importorskip("lightning")

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(()))

        def training_step(self, batch, i):
            return self.w * 0.0

        def validation_step(self, batch, i):
            pass

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    return L, Module


def _trainer(L, max_epochs: int, max_steps: int = -1):
    from batchwire.client.lightning import RemoteLoaderCallback

    return L.Trainer(
        max_epochs=max_epochs, max_steps=max_steps, accelerator="cpu", devices=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, callbacks=[RemoteLoaderCallback()],
    )  # fmt: skip


@pytest.mark.timeout(120)
def test_lightning_callback_the_last_epochs_val_loader_asks_no_next_one(srv):
    """With RemoteLoaderCallback the last of max_epochs has the servers make no next epoch's
    batches for nothing: the val loader (returned from val_dataloader, as docs/frameworks.md
    says) of that epoch asks for no val epoch 1 either."""
    L, Module = _lightning_module()
    before = len(hellos(srv, "val", 1))
    with loader_for(srv.endpoint) as tl, loader_for(srv.endpoint, "val") as vl:
        _trainer(L, 1).fit(Module(), tl, vl)
        asked = new_hellos(srv, "val", 1, before)
    assert asked == [], f"val epoch 1 asked ahead after the last epoch: {asked}"


@pytest.mark.timeout(120)
def test_lightning_callback_where_max_steps_ends_the_fit_asks_no_next_epoch(srv):
    """max_steps reached at the end of epoch 0 of max_epochs 3: epoch 0 is the last one."""
    L, Module = _lightning_module()
    before = len(hellos(srv, "train", 1))
    with loader_for(srv.endpoint) as tl:
        _trainer(L, 3, max_steps=BATCHES).fit(Module(), tl)
        asked = new_hellos(srv, "train", 1, before)
    assert asked == [], f"epoch 1 asked ahead after max_steps: {asked}"


@pytest.mark.timeout(120)
def test_lightning_callback_leaves_a_later_fit_asking_ahead(srv):
    """The callback turns prefetch_next_epoch off for a fit's last epoch only: the same loader
    in a later, longer fit (stages of one training) asks its next epoch ahead again."""
    L, Module = _lightning_module()
    with loader_for(srv.endpoint) as tl:
        _trainer(L, 1).fit(Module(), tl)
        before = len(hellos(srv, "train", 1))
        _trainer(L, 2).fit(Module(), tl)
        asked = new_hellos(srv, "train", 1, before)
    assert asked == [0], f"epoch 1 of the second fit was not asked ahead: {asked}"


@pytest.mark.timeout(60)
def test_lightning_callback_gives_the_early_ask_back_when_the_fit_fails(srv):
    L, Module = _lightning_module()

    class Failing(Module):
        def training_step(self, batch, i):
            if i == 2:
                raise RuntimeError("a user's bug")
            return super().training_step(batch, i)

    with loader_for(srv.endpoint) as tl:
        with pytest.raises(RuntimeError, match="a user's bug"):
            _trainer(L, 1).fit(Failing(), tl)
        assert tl.prefetch_next_epoch, "the failed fit's last epoch left the early ask off"


@pytest.mark.timeout(120)
def test_prefetch_next_epoch_turned_off_and_on_mid_epoch_stays_exact(srv):
    """Off mid-epoch 0: nothing of epoch 1 asked ahead; on again mid-epoch 1: epoch 2 asked
    ahead once and used. Every epoch equals a fresh loader's."""
    fresh = {}
    for epoch in range(3):
        with loader_for(srv.endpoint, prefetch_next_epoch=False) as loader:
            loader.set_epoch(epoch)
            fresh[epoch] = batches(loader)
    ahead_1, ahead_2 = len(hellos(srv, "train", 1)), len(hellos(srv, "train", 2))
    with loader_for(srv.endpoint) as loader:
        it = iter(loader)
        got = batches(next(it) for _ in range(3))
        loader.prefetch_next_epoch = False
        assert_same(got + batches(it), fresh[0])
        assert new_hellos(srv, "train", 1, ahead_1) == []
        loader.set_epoch(1)
        it = iter(loader)
        got = batches(next(it) for _ in range(3))
        loader.prefetch_next_epoch = True
        assert_same(got + batches(it), fresh[1])
        assert new_hellos(srv, "train", 2, ahead_2) == [0], "epoch 2 not asked ahead"
        loader.set_epoch(2)
        assert_same(batches(loader), fresh[2])
    assert hellos(srv, "train", 2)[ahead_2:] == [0], "epoch 2 was asked for again"
