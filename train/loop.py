"""The training loop: DDP, AMP, accumulation, checkpoint/resume, per-epoch validation.

Resume contract. Data-parallel ranks move in lockstep (every optimizer step all-reduces), so when
rank 0 writes the checkpoint of step s, every rank has consumed exactly the same number k of its
own batches in the epoch. The checkpoint stores (epoch, k) and every rank's loader
`state_dict()` (gathered to rank 0, a few numbers each); on restart each rank loads its own loader
state, i.e. resumes its own shard at the same k. At another world size (an elastic restart under
torchrun, a resized Slurm job) every rank loads rank 0's state, and the loader serves the rest of
the epoch as one pass split over the new ranks (RemoteLoader's elastic resume: each remaining sample
once, the last round padded with rows that train nothing); that pass's batches are numbered from 0,
and the learning-rate curve resumes at the share of the epoch already trained.
Batches trained after the last checkpoint are trained again after a restart: their updates are
not in the checkpoint, so this repeats no update and skips no sample. SIGUSR1 (`preemption`)
writes the checkpoint of the step it arrives in and stops, so that a stop announced ahead (a Slurm
time limit) repeats nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from batchwire.client.mixing import BatchMixer
from batchwire.common.rates import RateMeter
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from .checkpoint import NoUsableCheckpoint, checkpoint_path, load_latest, save_checkpoint
from .config import ConfigError, TrainConfig
from .distributed import (
    DistContext,
    all_gather_objects,
    all_reduce_sum,
    barrier,
    broadcast_buffers,
)
from .evaluate import Accuracy, evaluate, evaluate_multilabel
from .logbook import MetricsLog
from .metrics import MultiLabelScores
from .models import build_model
from .objective import Objective
from .preemption import CheckpointedOnSignal, CheckpointRequest
from .progress import EpochBar, LossAverage, loader_totals, throughput_meter
from .record import IndexRecorder, truncate_records
from .resize import size_at
from .schedule import build_scheduler, resume_schedule, step_schedule

log = logging.getLogger(__name__)
CHECKPOINT_FORMAT = 1


class Pass:
    """One pass of the train loader, begun: its batches `start` to `n` (each with the seconds
    waited for it), the first already received. A loader that ends early is an error naming
    the batch, not a short epoch trained in silence."""

    def __init__(
        self,
        epoch: int,
        start: int,
        n: int,
        first: tuple[Any, float] | None,
        rest: Iterator[tuple[Any, float]],
    ) -> None:
        self.epoch, self.start, self.n = epoch, start, n
        self._first, self._rest = first, rest

    def __iter__(self) -> Iterator[tuple[Any, float]]:
        pending, self._first = self._first, None
        for k in range(self.start, self.n):
            item = pending if pending is not None else next(self._rest, None)
            pending = None
            if item is None:
                raise RuntimeError(
                    f"the train loader ended after batch {k - 1} of epoch {self.epoch}; "
                    f"expected {self.n} batches"
                )
            yield item


@dataclass(frozen=True)
class EpochResult:
    epoch: int
    accuracy: Accuracy | MultiLabelScores | None  # None with --no-val; scores: multi-label
    data_wait: float  # fraction of training wall time blocked on the next batch, all ranks
    images_per_s: float  # training images per second, all ranks together
    train_loss: float
    seconds: float
    # (batches shared, batches received) by the train loaders this epoch, all ranks: shared
    # production in a sweep (`BatchHeader.shared`); None: not said (the server shares nothing).
    shared: tuple[int, int] | None = None


def make_mixer(cfg: TrainConfig, num_classes: int, rank: int) -> BatchMixer | None:
    """--mixup/--cutmix as a `BatchMixer` of this rank (None when both are 0)."""
    if not (cfg.mixup or cfg.cutmix):
        return None
    return BatchMixer(
        num_classes=num_classes,
        mixup_alpha=cfg.mixup,
        cutmix_alpha=cfg.cutmix,
        prob=cfg.mix_prob,
        label_smoothing=cfg.label_smoothing,
        seed=cfg.seed,
        rank=rank,
    )


def make_optimizer(model: nn.Module, cfg: TrainConfig, global_batch: int) -> torch.optim.Optimizer:
    """SGD+Nesterov or AdamW; no weight decay on biases and norm scales (1-d parameters)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if cfg.optimizer == "sgd":
        lr = cfg.lr if cfg.lr is not None else 0.1 * global_batch / 256
        return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, nesterov=True)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr if cfg.lr is not None else 1e-3)
    raise ValueError(f"unknown optimizer {cfg.optimizer!r}")


class Trainer:
    """Owns the model, optimizer, schedule and loaders of one rank; `fit()` runs the epochs."""

    def __init__(
        self,
        cfg: TrainConfig,
        ctx: DistContext,
        train_loader: Any,
        val_loader: Any,
        num_classes: int,
        batch_size: int,
        out: Callable[[str], None] = print,
        multi_label: bool = False,
        checkpoint_request: CheckpointRequest | None = None,
        sharing: bool = False,
    ) -> None:
        """`checkpoint_request`: set by SIGUSR1 (`preemption.checkpoint_on_usr1`); every rank
        passes one, or none does (the ranks vote on it after each optimizer step). `sharing`:
        the server shares production (--share-window): each epoch line says how many of the
        epoch's batches were shared with another job."""
        self.cfg, self.ctx = cfg, ctx
        self.sharing = sharing
        self.num_classes, self.multi_label = num_classes, multi_label
        self.train_loader, self.val_loader = train_loader, val_loader
        self.say = out if ctx.is_main else (lambda _msg: None)
        device = ctx.device
        torch.manual_seed(cfg.seed)
        if device.type == "cuda":
            torch.backends.cudnn.benchmark = True
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True

        self.memory_format = torch.channels_last if cfg.channels_last else torch.contiguous_format
        raw = build_model(cfg.model, num_classes, zero_init_residual=cfg.zero_init_residual)
        self.raw_model = raw.to(device=device, memory_format=self.memory_format)
        model: nn.Module = torch.compile(self.raw_model) if cfg.compile else self.raw_model
        self.eval_model = model
        if ctx.distributed:
            ids = [device.index] if device.type == "cuda" else None
            model = DDP(model, device_ids=ids)
        self.model = model

        self.num_batches = len(train_loader)
        self.steps_per_epoch = math.ceil(self.num_batches / cfg.accum_steps)
        global_batch = batch_size * ctx.world_size * cfg.accum_steps
        self.optimizer = make_optimizer(self.raw_model, cfg, global_batch)
        self.scheduler = build_scheduler(
            self.optimizer,
            cfg.schedule,
            total_steps=cfg.epochs * self.steps_per_epoch,
            warmup_steps=round(cfg.warmup_epochs * self.steps_per_epoch),
        )
        self.amp_dtype = cfg.amp_dtype(device)
        use_scaler = self.amp_dtype == torch.float16
        self.scaler = torch.amp.GradScaler(device.type) if use_scaler else None
        self.objective = Objective(
            num_classes,
            multi_label=multi_label,
            label_smoothing=cfg.label_smoothing,
            mixer=make_mixer(cfg, num_classes, ctx.rank),
        )
        self.resize_steps = cfg.resize_steps()
        self._image_size: tuple[int, int] | None = None  # the last size said (rank 0)

        self.epoch, self.batch, self.step = 0, 0, 0
        self.resumed = False
        self._loader_state: dict | None = None
        self.recorder = IndexRecorder(cfg.record_indices, ctx.rank) if cfg.record_indices else None
        self.metrics = MetricsLog(cfg.log_dir, enabled=ctx.is_main)
        self._bar: EpochBar | None = None  # this epoch's progress bar (rank 0, a terminal)
        self._logged_first_step = False
        self.checkpoint_request = checkpoint_request
        self._vote = torch.zeros(1, dtype=torch.int32, device=device)  # see _checkpoint_requested

    # ------------------------------------------------------------------ helpers

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.ctx.device.type, dtype=self.amp_dtype)

    def to_model_input(self, images: torch.Tensor) -> torch.Tensor:
        """A loader batch as the model takes it: float, in the model's memory format."""
        if images.dtype == torch.uint8:
            raise TypeError(
                "the loader yielded uint8 images; enable normalize_on_device (the trainer does) "
                "or serve a float dtype"
            )
        return images.contiguous(memory_format=self.memory_format)

    # ------------------------------------------------------------------ checkpoints

    def resume(self) -> None:
        """Load the latest checkpoint of --checkpoint-dir, if any (every rank reads it)."""
        cfg = self.cfg
        try:
            found = load_latest(cfg.checkpoint_dir) if cfg.checkpoint_dir else None
        except NoUsableCheckpoint as exc:
            raise ConfigError(str(exc)) from None
        if found is None:
            if self.recorder:
                self._cut_records(0, 0, 0)
            return
        path, state = found
        if state.get("format") != CHECKPOINT_FORMAT or state.get("model_name") != cfg.model:
            raise ConfigError(
                f"{path} was written for model {state.get('model_name')!r} (format "
                f"{state.get('format')}); this run trains {cfg.model!r}: use another "
                "--checkpoint-dir"
            )
        self.raw_model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        loader_state = self._saved_loader_state(path, state) if state["batch"] > 0 else None
        position = self._schedule_position(state, loader_state)
        if not resume_schedule(self.scheduler, state["scheduler"], position):
            self.say(
                f"the learning-rate curve differs from the checkpoint's ({self.steps_per_epoch} "
                f"optimizer steps per epoch now): following this run's curve from step {position}"
            )
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.epoch, self.batch, self.step = state["epoch"], state["batch"], state["step"]
        self._loader_state = loader_state
        if self.recorder:
            pass_start = int(loader_state.get("start_sample", 0)) if loader_state else 0
            self._cut_records(self.epoch, pass_start, self.batch)
        self.resumed = True
        self.say(f"resumed from {path}: epoch {self.epoch}, batch {self.batch}, step {self.step}")

    def _saved_loader_state(self, path: Any, state: dict[str, Any]) -> dict[str, Any]:
        """The loader state this rank resumes from: its own at the saved world size; rank 0's at
        another (any rank's holds for all: ranks step in lockstep), which the loader turns into
        the rest of the epoch split over this run's ranks."""
        states = state["loader"]
        same_world = state["world_size"] == self.ctx.world_size
        loader_state = states[self.ctx.rank] if same_world else states[0]
        position = (loader_state.get("epoch"), loader_state.get("next_batch"))
        if position != (state["epoch"], state["batch"]):
            rank = self.ctx.rank if same_world else 0
            raise RuntimeError(
                f"{path} is inconsistent: rank {rank}'s loader stood at (epoch, batch) "
                f"{position}, the model at {(state['epoch'], state['batch'])}"
            )
        if not same_world:
            self.say(
                f"{path} was written mid-epoch by {state['world_size']} ranks; this run has "
                f"{self.ctx.world_size}: the rest of epoch {state['epoch']} is split over them"
            )
        return loader_state

    def _schedule_position(self, state: dict[str, Any], loader_state: dict | None) -> int:
        """The optimizer steps a checkpoint stands at, in this run's steps per epoch: the
        epoch's own batches by count; a pass of another world size by the share of the epoch's
        samples trained before it (its batches count in another unit)."""
        epoch_steps = state["epoch"] * self.steps_per_epoch
        if loader_state is None:
            return epoch_steps
        world = int(loader_state["world_size"])
        same_pass = int(loader_state.get("start_sample", 0)) == 0 and world == self.ctx.world_size
        if same_pass:
            return epoch_steps + math.ceil(state["batch"] / self.cfg.accum_steps)
        shape = loader_state.get("epoch_shape") or loader_state.get("stream") or {}  # older name
        epoch_world = int(loader_state.get("epoch_world_size", world))  # older states: none
        round_size = int(shape.get("batch_size", 0)) * epoch_world
        trained = int(loader_state.get("start_sample", 0))
        trained += int(loader_state["next_batch"]) * world * int(shape.get("batch_size", 0))
        usable = (int(shape.get("num_samples", 0)) // round_size * round_size) if round_size else 0
        share = min(1.0, trained / usable) if usable else 0.0
        return epoch_steps + round(share * self.steps_per_epoch)

    def _cut_records(self, epoch: int, pass_start: int, batch: int) -> None:
        """Rank 0 cuts every rank's index record back to the resume point; all ranks wait for
        it before any appends (after another world size, no rank owns the old ranks' files)."""
        if self.ctx.is_main:
            truncate_records(self.cfg.record_indices, epoch, pass_start, batch)
        barrier(self.ctx)

    def save(self, epoch: int, batch: int, extra: dict[str, Any] | None = None) -> None:
        """Collective: gather loader states, rank 0 writes, everyone waits until it is on disk."""
        if not self.cfg.checkpoint_dir:
            return
        loader_state = self.train_loader.state_dict() if batch > 0 else None
        loader_states = all_gather_objects(loader_state, self.ctx)
        if self.ctx.is_main:
            state = {
                "format": CHECKPOINT_FORMAT,
                "model_name": self.cfg.model,
                "model": self.raw_model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict() if self.scaler else None,
                "epoch": epoch,
                "batch": batch,
                "step": self.step,
                "world_size": self.ctx.world_size,
                "loader": loader_states,
                **(extra or {}),
            }
            keep = self.cfg.keep_checkpoints
            save_checkpoint(self.cfg.checkpoint_dir, self.step, state, keep=keep)
        barrier(self.ctx)

    # ------------------------------------------------------------------ training

    def _start_pass(self, epoch: int, start: int) -> tuple[Pass, int]:
        """Begin this epoch's pass of the train loader: (its batches, the pass's first sample of
        the epoch order: 0 for the epoch's own batches).

        With --resize-schedule the loader is asked for the epoch's size first; a restored
        mid-epoch state then sets the size its epoch was started at (the loader state holds it).
        A restored state starts its pass where it was saved; at another world size that pass is
        the rest of the epoch, numbered from its own batch 0, and the loader's length, once the
        pass has begun, is that pass's.
        """
        if self.resize_steps:
            self.train_loader.set_image_size(size_at(self.resize_steps, epoch))
        self.train_loader.prefetch_next_epoch = self._asks_ahead(epoch, start)
        pass_start = 0
        if start > 0 and self._loader_state is not None:
            self.train_loader.load_state_dict(self._loader_state)
            self._loader_state = None
            position = self.train_loader.state_dict()
            start, pass_start = int(position["next_batch"]), int(position.get("start_sample", 0))
        else:
            self.train_loader.set_epoch(epoch)
        batches = self._batches(iter(self.train_loader))
        first = next(batches, None)  # begins the pass: the loader now knows its length
        n = len(self.train_loader) if first is not None else start
        return Pass(epoch, start, n, first, batches), pass_start

    def _asks_ahead(self, epoch: int, start: int) -> bool:
        """Whether the train loader may ask the servers for epoch ``epoch + 1`` as the pass of
        ``epoch`` from batch ``start`` ends (`RemoteLoader.prefetch_next_epoch`): not when the
        run ends with this pass (--epochs, or --max-steps within its steps), nor when the next
        epoch trains at another size (--resize-schedule): what was asked would be dropped.

        The pass's steps are counted in the epoch's own batches: a resumed pass at another
        world size asks nothing ahead anyway (the loader's rule)."""
        if epoch + 1 >= self.cfg.epochs:
            return False
        accum = self.cfg.accum_steps
        steps_left = self.steps_per_epoch - start // accum
        if self.cfg.max_steps is not None and self.step + steps_left >= self.cfg.max_steps:
            return False
        if self.resize_steps:
            return size_at(self.resize_steps, epoch + 1) == size_at(self.resize_steps, epoch)
        return True

    @staticmethod
    def _batches(it: Iterator[Any]) -> Iterator[tuple[Any, float]]:
        """Each batch of `it` with the seconds spent waiting for it."""
        while True:
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                return
            yield batch, time.perf_counter() - t0

    def _optimizer_step(self) -> None:
        opt, scaler, clip = self.optimizer, self.scaler, self.cfg.clip_grad
        if scaler is not None:
            if clip:
                scaler.unscale_(opt)
                nn.utils.clip_grad_norm_(self.raw_model.parameters(), clip)
            scaler.step(opt)
            scaler.update()
        else:
            if clip:
                nn.utils.clip_grad_norm_(self.raw_model.parameters(), clip)
            opt.step()
        opt.zero_grad(set_to_none=True)
        step_schedule(self.scheduler)
        self.step += 1

    def train_epoch(self, epoch: int, start: int) -> tuple[bool, RateMeter, float]:
        """Train from batch `start`; returns (stopped by --max-steps, epoch meter, mean loss).

        The meters count images (column 0) and the time blocked on each batch (intervals).
        """
        batches, pass_start = self._start_pass(epoch, start)
        self.model.train()
        epoch_meter, line_meter = throughput_meter(), throughput_meter()
        epoch_loss, line_loss = LossAverage(self.ctx.device), LossAverage(self.ctx.device)
        self._bar = EpochBar(
            self.ctx.is_main, batches.n, initial=batches.start, desc=f"epoch {epoch}"
        )
        meters = (epoch_meter, line_meter, epoch_loss, line_loss)
        try:
            return self._train_batches(batches, pass_start, *meters)
        finally:
            self._bar.close()
            self._bar = None

    def _train_batches(
        self,
        batches: Pass,
        pass_start: int,
        epoch_meter: RateMeter,
        line_meter: RateMeter,
        epoch_loss: LossAverage,
        line_loss: LossAverage,
    ) -> tuple[bool, RateMeter, float]:
        """Train the pass's batches (`_start_pass`); ``pass_start``: its first sample."""
        epoch, start, n = batches.epoch, batches.start, batches.n
        cfg, accum = self.cfg, self.cfg.accum_steps
        assert self._bar is not None
        k = start
        for (images, labels, indices), wait_s in batches:
            if self.recorder:
                self.recorder.append(epoch, k, torch.as_tensor(indices).tolist(), pass_start)
            # Groups are aligned to batch 0 so a resumed epoch keeps them; a resume with another
            # --accum-steps gets one short first group, averaged over what it really has.
            group_start = max((k // accum) * accum, start)
            group_end = min((k // accum + 1) * accum, n)
            last_micro = k + 1 == group_end
            sync = last_micro or not isinstance(self.model, DDP)
            inputs, targets = self.objective(images, labels, epoch=epoch, batch_index=k)
            self._say_size(epoch, inputs)
            with contextlib.nullcontext() if sync else self.model.no_sync():
                with self.autocast():
                    loss = self.objective.loss(self.model(self.to_model_input(inputs)), targets)
                scaled = loss / (group_end - group_start)
                (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            k += 1
            for meter in (epoch_meter, line_meter):
                meter.add(images.shape[0])
                meter.add_interval(wait_s)
            epoch_loss.add(loss)
            line_loss.add(loss)
            self._bar.update(1)
            if not last_micro:
                continue
            self._optimizer_step()
            self._maybe_fail()
            # The first step of the run is logged too: a log file shows within one step that
            # batches flow, not after --log-every steps (minutes at 224 px on a CPU).
            if self.step % cfg.log_every == 0 or not self._logged_first_step:
                self._logged_first_step = True
                self._log_line(epoch, k, n, line_meter, line_loss)
            if k < n and self._checkpoint_requested():
                self._stop_on_signal(epoch, k)
            if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0 and k < n:
                self.save(epoch, k)
            if cfg.max_steps is not None and self.step >= cfg.max_steps:
                self.batch = k if k < n else 0
                return True, epoch_meter, epoch_loss.mean_and_reset()
        self.batch = 0
        return False, epoch_meter, epoch_loss.mean_and_reset()

    def _checkpoint_requested(self) -> bool:
        """Did any rank get SIGUSR1? A collective when distributed: every rank calls it at the
        same points (after each optimizer step but an epoch's last, and after each epoch).

        The ranks add their 0/1 flags (a sum above 0 is the maximum above 0) every step rather
        than every N: the signal is acted on within a step whatever a step costs (every N steps of
        a slow model could outlast Slurm's warning), and a one-int all-reduce is small next to a
        step: 0.17-0.28 ms mean on 2 gloo ranks of a loaded 2-core host, 0.4-0.6% of a step of
        the smallest model here (`bench_signal_vote`, bench/RESULTS.md). On CUDA, reading the sum
        also waits for the step's kernels: one host sync per step, after the optimizer step
        (unmeasured: no GPU here); the loader has the next batch prefetched meanwhile.
        """
        request = self.checkpoint_request
        if request is None:
            return False
        if not self.ctx.distributed:
            return request.requested
        self._vote.fill_(int(request.requested))
        return bool(all_reduce_sum(self._vote, self.ctx).item())

    def _stop_on_signal(self, epoch: int, batch: int, saved: bool = False) -> None:
        """Write this step's checkpoint (unless `saved`), say so, close the logs and raise
        `CheckpointedOnSignal`: the same command resumes at exactly this step."""
        if not saved:
            self.save(epoch, batch)
        assert self.cfg.checkpoint_dir  # a request exists only with a checkpoint folder
        path = checkpoint_path(self.cfg.checkpoint_dir, self.step)
        self.say(
            f"checkpointed at step {self.step} on SIGUSR1 ({path}): resume with the same command"
        )
        self._close_logs()
        raise CheckpointedOnSignal(self.step)

    def _close_logs(self) -> None:
        if self.recorder:
            self.recorder.close()
        self.metrics.close()

    def _say_size(self, epoch: int, images: torch.Tensor) -> None:
        """With --resize-schedule: say the size of the first batch at each new size (rank 0)."""
        size = (int(images.shape[-2]), int(images.shape[-1]))
        if not (self.resize_steps and self.ctx.is_main) or size == self._image_size:
            return
        self._image_size = size
        line = f"epoch {epoch}: training at {size[0]}x{size[1]} px (--resize-schedule)"
        if self._bar is not None:
            self._bar.write(line)
        else:
            self.say(line)

    def _maybe_fail(self) -> None:
        """Test hook: the last rank SIGKILLs itself after step --fail-at-step of a fresh run."""
        last_rank = self.ctx.rank == self.ctx.world_size - 1
        if self.cfg.fail_at_step == self.step and not self.resumed and last_rank:
            log.warning("--fail-at-step %d: rank %d kills itself", self.step, self.ctx.rank)
            os.kill(os.getpid(), signal.SIGKILL)

    def _log_line(self, epoch: int, k: int, n: int, meter: RateMeter, loss: LossAverage) -> None:
        lr = self.optimizer.param_groups[0]["lr"]
        figures = meter.read()
        row = {
            "step": self.step,
            "epoch": epoch,
            "batch": k,
            "loss": loss.mean_and_reset(),
            "lr": lr,
            "images_per_s": figures.rate() * self.ctx.world_size,
            "data_wait": figures.interval_fraction(),
        }
        line = (
            f"step {self.step} (epoch {epoch} batch {k}/{n}): "
            f"loss {row['loss']:.4f} lr {lr:.4g} images/s {row['images_per_s']:.0f} "
            f"data-wait {100 * row['data_wait']:.1f}%"
        )
        if self.ctx.is_main:
            if self._bar is not None:
                self._bar.write(line)
            else:
                self.say(line)
        self.metrics.step(row)
        meter.reset()

    # ------------------------------------------------------------------ epochs

    def validate(self, epoch: int, last: bool) -> Accuracy | MultiLabelScores | None:
        """Score ``epoch``'s model on the val split; ``last``: no validation follows (the val
        loader then asks the servers for no next epoch ahead)."""
        if self.val_loader is None:
            return None
        # Every rank evaluates rank 0's model, the one the checkpoint holds: BatchNorm statistics
        # drift apart by each rank's last training batch.
        broadcast_buffers(self.raw_model, self.ctx)
        self.val_loader.prefetch_next_epoch = not last
        self.val_loader.set_epoch(epoch)
        if self.multi_label:
            return evaluate_multilabel(
                self.eval_model,
                self.val_loader,
                self.ctx,
                self.num_classes,
                autocast=self.autocast,
                to_model_input=self.to_model_input,
            )
        return evaluate(
            self.eval_model,
            self.val_loader,
            self.ctx,
            autocast=self.autocast,
            to_model_input=self.to_model_input,
        )

    def fit(self) -> list[EpochResult]:
        self.resume()
        results = []
        max_steps = self.cfg.max_steps
        if self.epoch >= self.cfg.epochs:
            self.say(f"nothing to do: the checkpoint has finished {self.epoch} epochs")
        elif max_steps is not None and self.step >= max_steps:
            self.say(f"nothing to do: the checkpoint is at --max-steps ({self.step})")
            return results
        while self.epoch < self.cfg.epochs:
            epoch, t0 = self.epoch, time.perf_counter()
            received0, shared0 = loader_totals(self.train_loader)
            stopped, meter, train_loss = self.train_epoch(epoch, self.batch)
            received1, shared1 = loader_totals(self.train_loader)
            figures = meter.read()
            totals = torch.tensor(
                [
                    figures.totals[0],
                    figures.interval_s,
                    max(figures.span_s, 1e-9),
                    received1 - received0,
                    shared1 - shared0,
                ],
                dtype=torch.float64,
                device=self.ctx.device,
            )
            images, wait_s, wall_s, received, shared = all_reduce_sum(totals, self.ctx).tolist()
            acc = self.validate(epoch, last=stopped or epoch + 1 >= self.cfg.epochs)
            result = EpochResult(
                epoch=epoch,
                accuracy=acc,
                data_wait=wait_s / max(wall_s, 1e-9),
                images_per_s=images / max(wall_s / self.ctx.world_size, 1e-9),
                train_loss=train_loss,
                seconds=time.perf_counter() - t0,
                shared=(round(shared), round(received)) if self.sharing or shared else None,
            )
            results.append(result)
            self.say(format_epoch(result, partial=stopped))
            self.metrics.epoch(_epoch_row(result))
            val = {"val": dataclasses.asdict(acc)} if acc else {}
            if self.batch == 0:  # the epoch is complete (also when --max-steps ended it)
                self.epoch += 1
            self.save(self.epoch, self.batch, val)
            if stopped:
                break
            if self.epoch < self.cfg.epochs and self._checkpoint_requested():
                self._stop_on_signal(self.epoch, self.batch, saved=True)
        self._close_logs()
        return results


def _epoch_row(r: EpochResult) -> dict[str, float | int | None]:
    """An epoch's figures for `MetricsLog.epoch` (None for what was not measured: val figures
    without validation, top-1/top-5 of a multi-label split, mAP/F1 of a single-label one)."""
    acc = r.accuracy
    top = acc if isinstance(acc, Accuracy) else None
    multi = acc if isinstance(acc, MultiLabelScores) else None
    return {
        "epoch": r.epoch,
        "train_loss": r.train_loss,
        "val_top1": None if top is None else top.top1,
        "val_top5": None if top is None else top.top5,
        "val_loss": None if acc is None else acc.loss,
        "val_map": None if multi is None else multi.mean_ap,
        "val_f1_micro": None if multi is None else multi.f1_micro,
        "val_f1_macro": None if multi is None else multi.f1_macro,
        "data_wait": r.data_wait,
        "images_per_s": r.images_per_s,
        "seconds": r.seconds,
    }


def format_epoch(r: EpochResult, partial: bool = False) -> str:
    note = " (stopped at --max-steps)" if partial else ""
    acc = r.accuracy
    if isinstance(acc, MultiLabelScores):
        val = (
            f"val mAP={acc.mean_ap:.2f}% F1 micro={acc.f1_micro:.2f}% macro={acc.f1_macro:.2f}% "
            f"({acc.ap_classes} classes with positives)"
        )
    else:
        val = f"val top1={acc.top1:.2f}% top5={acc.top5:.2f}%" if acc else "val skipped"
    val_loss = f", val loss {acc.loss:.4f}" if acc else ""
    shared = "" if r.shared is None else f"shared {r.shared[0]}/{r.shared[1]} batches "
    return (
        f"epoch {r.epoch}: {val} "
        f"data-wait={100 * r.data_wait:.1f}% images/s={r.images_per_s:.0f} {shared}"
        f"(train loss {r.train_loss:.4f}{val_loss}, {r.seconds:.1f} s){note}"
    )
