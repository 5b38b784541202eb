"""Review of the "last epoch asks no next one ahead" change and the launcher's port retry.

One real pipeline-server (the embedded val folder served as both splits, batches of 16 at
32 px, 25 per epoch, logging each hello at INFO) is shared by the loader tests; what it was
asked for is read from its log (``hellos``), as tests/e2e/test_remote_loader_epochs.py does.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from batchwire.client import RemoteLoader
from batchwire.common.launcher import PipelineServer, ServerStartError
from serverproc import running_server, small_server_args

TRAIN_BIN = Path(sys.executable).parent / "pipeline-train"
BATCHES = 25  # 400 images in batches of 16, per epoch and split


@pytest.fixture(scope="module")
def srv():
    with running_server(*small_server_args(seed=9, val=True), "--max-image-size", "48") as server:
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


# ---------------------------------------------------------------- findings (fail today)


@pytest.mark.timeout(120)
def test_pipeline_train_stopped_by_max_steps_asks_no_epoch_after_its_last(srv):
    """--max-steps ends the run at the end of epoch 0 of --epochs 2: epoch 0 is the last one
    trained and validated, so neither loader may ask for epoch 1 ahead (`Trainer._has_next_epoch`
    only looks at --epochs)."""
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
    """Pre-existing, same waste: with --resize-schedule 32:0,48:1 the loader asks epoch 1
    ahead at 32 px during epoch 0, and epoch 1 then starts afresh at 48 px: those batches are
    made for nothing (`Trainer._start_pass` sets an epoch's size only as that epoch starts)."""
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
    """Pre-existing in `RemoteLoader.state_dict`, and a trap for a fix of the test above (ask
    the next epoch's size as soon as a pass starts): set_image_size applies "from the next pass
    on", but a state saved afterwards records that pending size as the saved pass's, so the
    resumed pass continues at the other size (silently different batches)."""
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


def _trainer(L, max_epochs: int):
    from batchwire.client.lightning import RemoteLoaderCallback

    return L.Trainer(
        max_epochs=max_epochs, accelerator="cpu", devices=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, callbacks=[RemoteLoaderCallback()],
    )  # fmt: skip


@pytest.mark.timeout(120)
def test_lightning_callback_the_last_epochs_val_loader_asks_no_next_one(srv):
    """README/docs: with RemoteLoaderCallback the last of max_epochs no longer has the servers
    make the next epoch's batches for nothing. The val loader of that epoch (returned from
    val_dataloader, as docs/frameworks.md says) still asks for val epoch 1 ahead."""
    L, Module = _lightning_module()
    before = len(hellos(srv, "val", 1))
    with loader_for(srv.endpoint) as tl, loader_for(srv.endpoint, "val") as vl:
        _trainer(L, 1).fit(Module(), tl, vl)
        asked = new_hellos(srv, "val", 1, before)
    assert asked == [], f"val epoch 1 asked ahead after the last epoch: {asked}"


@pytest.mark.timeout(120)
def test_lightning_callback_leaves_a_later_fit_asking_ahead(srv):
    """The callback turns prefetch_next_epoch off for a fit's last epoch and never back on:
    the same loader in a later, longer fit (stages of one training) no longer asks any epoch
    ahead, though its owner never turned that off (before the change it did)."""
    L, Module = _lightning_module()
    with loader_for(srv.endpoint) as tl:
        _trainer(L, 1).fit(Module(), tl)
        before = len(hellos(srv, "train", 1))
        _trainer(L, 2).fit(Module(), tl)
        asked = new_hellos(srv, "train", 1, before)
    assert asked == [0], f"epoch 1 of the second fit was not asked ahead: {asked}"


@pytest.mark.timeout(120)
def test_a_picked_port_taken_by_another_pipeline_server_is_not_taken_for_ours(tmp_path):
    """Pre-existing in `PipelineServer.wait_until_serving`, and it defeats the new retry: when
    the process that takes the picked port is itself a pipeline-server, it answers the stats
    request before ours has failed to bind, so start() returns "serving" while ours exits 2."""
    args = small_server_args(seed=9)
    ours = PipelineServer(args, log_path=tmp_path / "ours.log")
    taken = ours.endpoint
    with running_server(*args, endpoint=taken):
        try:
            ours.start()
        except ServerStartError:
            return  # a clear error is fine too
        try:
            assert ours.endpoint != taken, (
                f"start() returned on {taken}, which the other server holds; ours:\n"
                + ours.log(tail_chars=300)
            )
        finally:
            ours.stop()


# ---------------------------------------------------------------- coverage kept


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


@pytest.mark.timeout(60)
def test_an_explicit_endpoint_that_is_taken_does_not_move(tmp_path):
    """Only a port the launcher picked moves: an endpoint the caller chose is what clients
    were told, so a taken one is an error naming it, after one attempt."""
    with socket.create_server(("127.0.0.1", 0)) as holder:
        endpoint = f"tcp://127.0.0.1:{holder.getsockname()[1]}"
        server = PipelineServer(small_server_args(seed=9), endpoint, log_path=tmp_path / "s.log")
        with pytest.raises(ServerStartError, match="Address already in use"):
            server.start(timeout=50)
    assert server.endpoint == endpoint
    assert server.log().count("$ ") == 1, server.log()
