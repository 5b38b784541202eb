"""Lightning support for ``DataLoader(loader, batch_size=None)`` (needs ``lightning``).

Returned directly from ``train_dataloader()``, a `RemoteLoader` needs nothing from here:
Lightning calls ``loader.sampler.set_epoch`` every epoch and saves ``loader.state_dict()`` in
its checkpoints. Wrapped in a torch ``DataLoader``, it is out of Lightning's sight: the sampler
Lightning finds is torch's, and a plain DataLoader has no state, so every epoch would repeat
epoch 0 and a mid-epoch resume would start the epoch over. This callback closes that gap:

    trainer = L.Trainer(..., callbacks=[RemoteLoaderCallback()])

It sets the epoch of every training RemoteLoader it finds (directly or as a DataLoader's
dataset), keeps their positions in the checkpoint and restores them before the resumed epoch's
first batch, and has them (and the validation RemoteLoaders) ask the servers for no epoch after
the fit's last one (of ``max_epochs``, or where ``max_steps`` ends it) ahead of time: its batches
would be made for nothing. It is harmless with the direct form too.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
from batchwire.client.remote_loader import RemoteLoader


def remote_loaders(obj: object) -> Iterator[RemoteLoader]:
    """Every RemoteLoader in what a Trainer holds as its dataloaders (nested or wrapped)."""
    if isinstance(obj, RemoteLoader):
        yield obj
    elif isinstance(getattr(obj, "dataset", None), RemoteLoader):
        yield obj.dataset  # type: ignore[union-attr]
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from remote_loaders(value)
    elif isinstance(obj, list | tuple):
        for value in obj:
            yield from remote_loaders(value)


def is_last_epoch(trainer: pl.Trainer) -> bool:
    """Does the fit end with the current epoch: the last of ``max_epochs``, or one whose
    optimizer steps reach ``max_steps`` (-1 or None: no such end)?"""
    end = trainer.max_epochs
    if end is not None and end >= 0 and trainer.current_epoch + 1 >= end:
        return True
    max_steps = trainer.max_steps
    batches = trainer.num_training_batches
    if max_steps is None or max_steps < 0 or not math.isfinite(batches):
        return False
    steps = math.ceil(batches / trainer.accumulate_grad_batches)
    return trainer.global_step + steps >= max_steps


class RemoteLoaderCallback(pl.Callback):
    """Epochs and exact mid-epoch resume for RemoteLoaders in any form (see the module)."""

    def __init__(self) -> None:
        self._to_restore: list[dict[str, Any]] = []
        self._switched_off: list[RemoteLoader] = []  # early asks turned off for a last epoch

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After the checkpoint is restored, before the first batch of the (resumed) epoch.
        states, self._to_restore = self._to_restore, []
        loaders = list(remote_loaders(trainer.train_dataloader))
        if states and len(states) != len(loaders):
            raise RuntimeError(
                f"the checkpoint holds the positions of {len(states)} RemoteLoader(s), this "
                f"trainer has {len(loaders)}: define the same train dataloaders as the saved run"
            )
        for loader, state in zip(loaders, states, strict=False):
            loader.load_state_dict(state)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        last = is_last_epoch(trainer)
        for loader in remote_loaders(trainer.train_dataloader):
            self._ask_ahead(loader, not last)
            loader.set_epoch(trainer.current_epoch)

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return  # a few batches: nothing is asked ahead
        last = is_last_epoch(trainer)
        for loader in remote_loaders(trainer.val_dataloaders):
            self._ask_ahead(loader, not last)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._give_back()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._give_back()

    def _give_back(self) -> None:
        """The loaders this callback turned off ask ahead again, as their owner set them, for
        whatever comes after this fit."""
        for loader in self._switched_off:
            loader.prefetch_next_epoch = True
        self._switched_off.clear()

    def _ask_ahead(self, loader: RemoteLoader, wanted: bool) -> None:
        """Turn ``loader``'s early ask of the next epoch off for a last epoch; on again only
        where this callback turned it off (the owner's own False stays)."""
        if not wanted and loader.prefetch_next_epoch:
            loader.prefetch_next_epoch = False
            self._switched_off.append(loader)
        elif wanted and any(loader is off for off in self._switched_off):
            loader.prefetch_next_epoch = True
            self._switched_off = [off for off in self._switched_off if off is not loader]

    def state_dict(self) -> dict[str, Any]:
        trainer = getattr(self, "_trainer", None)
        loaders = [] if trainer is None else list(remote_loaders(trainer.train_dataloader))
        return {"loaders": [loader.state_dict() for loader in loaders]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._to_restore = list(state_dict.get("loaders", []))

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer  # state_dict() is called without the trainer
