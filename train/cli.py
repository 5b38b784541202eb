"""`pipeline-train`: the reference data-parallel training loop, fed by pipeline-server.

One GPU per process under torchrun (rank, world size and local rank come from the environment):

    pipeline-server --train /data/imagenet/train --val /data/imagenet/val \\
        --output-dtype uint8 --layout nhwc &
    torchrun --nproc_per_node=8 --max-restarts=3 --no-python pipeline-train \\
        --server tcp://127.0.0.1:5555 --model resnet50 --epochs 90 --channels-last \\
        --checkpoint-dir ckpt --checkpoint-every 1000

On a CPU, as a single process or with gloo ranks (what `python -m batchwire.train.demo` runs):

    pipeline-server --image-size 32 --batch-size 32 --output-dtype uint8 --scale 0.35,1 &
    pipeline-train --server tcp://127.0.0.1:5555 --model small --epochs 5 --lr 0.2
    torchrun --nproc_per_node=2 --no-python pipeline-train --server tcp://127.0.0.1:5555 ...

The batch size, image size and augmentation are the server's: the trainer only consumes (a
uint8 wire is normalised on the device with the server's mean/std). With --checkpoint-dir the
run resumes from the newest checkpoint there, so a restarted torchrun (`--max-restarts`)
continues where the last checkpoint left off, at the same batch of every rank (see
`batchwire.train.loop` for why that is exact). With --checkpoint-dir, SIGUSR1 writes the
checkpoint of the current step and ends the run with exit code 3 (`preemption`): a job warned
before its time limit resumes with the same command and repeats no step. Each epoch ends with
one line: `epoch E: val top1=..% top5=..% data-wait=..% images/s=..` (a multi-label split:
`val mAP=..% F1 micro=..% macro=..%`). --mixup/--cutmix mix the train batches (`objective`),
--resize-schedule changes their size by epoch (`resize`).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING, Any

from batchwire.wire.cli import ArgumentParser
from batchwire.wire.endpoints import UnresolvableHost, check_resolvable
from batchwire.wire.version import add_version_argument, installed_version

from .config import AMP_MODES, MODEL_NAMES, OPTIMIZERS, SCHEDULES, ConfigError, TrainConfig
from .preemption import (
    CHECKPOINTED_EXIT,
    CheckpointedOnSignal,
    CheckpointRequest,
    checkpoint_on_usr1,
)
from .resize import largest

if TYPE_CHECKING:  # torch comes with these: imported in run(), after the arguments are parsed
    from .distributed import DistContext
    from .loop import EpochResult

log = logging.getLogger("batchwire.train")


def _triple(text: str) -> tuple[float, float, float]:
    parts = [float(x) for x in text.split(",")]
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"expected R,G,B (three numbers), got {text!r}")
    return (parts[0], parts[1], parts[2])


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows real defaults; options whose default is computed say so in their own help."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)


EXIT_CODES = (
    "Exit codes: 0 trained (or nothing left to train); 1 failed (no server, a refused hello, "
    "an error); 2 a configuration error; "
    f"{CHECKPOINTED_EXIT} checkpointed on request: with --checkpoint-dir, SIGUSR1 (to every rank, "
    "or to torchrun with --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1) writes the "
    "checkpoint of the current optimizer step and stops; resume with the same command; "
    "130 interrupted (Ctrl-C)."
)


def build_parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    p = ArgumentParser(
        prog="pipeline-train",
        description="Data-parallel training from pipeline-server (run it under torchrun for "
        "several ranks).",
        epilog=EXIT_CODES,
        formatter_class=_HelpFormatter,
    )
    add_version_argument(p)
    a = p.add_argument
    a(
        "--server",
        action="append",
        dest="servers",
        metavar="ENDPOINT",
        help="pipeline-server endpoint, repeatable (each server produces a share of every rank's "
        "batches) [default: tcp://127.0.0.1:5555]",
    )
    a("--model", choices=MODEL_NAMES, default=d.model, help="architecture")
    a("--num-classes", type=int, help="classifier width [default: from the server]")
    a("--epochs", type=int, default=d.epochs, help="epochs to train")
    a(
        "--lr",
        type=float,
        help="peak learning rate [default: 0.1 x global batch / 256 for SGD, 1e-3 for AdamW]",
    )
    a("--optimizer", choices=OPTIMIZERS, default=d.optimizer, help="sgd = SGD, Nesterov momentum")
    a("--momentum", type=float, default=d.momentum, help="SGD momentum")
    a("--weight-decay", type=float, default=d.weight_decay, help="not applied to biases and norms")
    a("--warmup-epochs", type=float, default=d.warmup_epochs, help="linear warm-up length")
    a("--schedule", choices=SCHEDULES, default=d.schedule, help="shape after the warm-up")
    a(
        "--label-smoothing",
        type=float,
        default=d.label_smoothing,
        help="of the cross-entropy (single-label; with --mixup/--cutmix inside the mixed targets)",
    )
    a(
        "--mixup",
        type=float,
        default=d.mixup,
        metavar="ALPHA",
        help="Mixup with lam ~ Beta(ALPHA, ALPHA) (0 = off; 0.2-0.8 is usual); soft targets",
    )
    a(
        "--cutmix",
        type=float,
        default=d.cutmix,
        metavar="ALPHA",
        help="CutMix with lam ~ Beta(ALPHA, ALPHA) (0 = off; 1.0 is usual); with --mixup too, "
        "each mixed batch gets one of the two, half the time each",
    )
    a(
        "--mix-prob",
        type=float,
        default=d.mix_prob,
        help="chance that a batch is mixed (deterministic from --seed, epoch, batch, rank)",
    )
    a(
        "--resize-schedule",
        metavar="SIZE:EPOCH,...",
        help="progressive resizing: train image size from each epoch on, e.g. "
        "128:0,160:10,224:30 (SIZE: PX or HxW; the servers' --max-image-size must cover the "
        "largest; validation stays at their --image-size) [default: the servers' size]",
    )
    a(
        "--accum-steps",
        type=int,
        default=d.accum_steps,
        help="micro-batches per optimizer step (gradient all-reduce only on the last)",
    )
    a("--clip-grad", type=float, help="clip the gradient norm to this value")
    a("--compile", action="store_true", help="torch.compile the model")
    a(
        "--amp",
        choices=AMP_MODES,
        default=d.amp,
        help="autocast dtype: auto = bf16 on CUDA, off on the CPU; fp16 uses a GradScaler",
    )
    a("--channels-last", action="store_true", help="NHWC memory format for model and inputs")
    a("--zero-init-residual", action="store_true", help="ResNets: zero the last BN of each block")
    a("--log-every", type=int, default=d.log_every, help="optimizer steps between log lines")
    a(
        "--log-dir",
        metavar="DIR",
        help="write DIR/steps.csv and DIR/epochs.csv, and TensorBoard events when the "
        "tensorboard package is installed (pip install tensorboard)",
    )
    a(
        "--checkpoint-dir",
        help="save here and resume from the newest checkpoint here; SIGUSR1 saves the current "
        f"step and exits {CHECKPOINTED_EXIT}",
    )
    a(
        "--checkpoint-every",
        type=int,
        default=d.checkpoint_every,
        help="optimizer steps between checkpoints (0 = at epoch ends only)",
    )
    a("--keep-checkpoints", type=int, default=d.keep_checkpoints, help="files kept (0 = all)")
    a("--seed", type=int, default=d.seed, help="model initialisation seed")
    a("--max-steps", type=int, help="stop after this many optimizer steps (validates first)")
    a("--device", default=d.device, help="auto, cpu, cuda or cuda:N (auto: cuda:LOCAL_RANK)")
    a("--prefetch", type=int, default=d.prefetch, help="batches in flight per rank")
    a("--timeout", type=float, default=d.timeout, help="seconds to wait for a server")
    a(
        "--keys",
        default=d.keys,
        help="keys folder of a server started with --keys [default: $BATCHWIRE_KEYS]",
    )
    a("--mean", type=_triple, help="normalisation of a uint8 wire, R,G,B [default: the server's]")
    a("--std", type=_triple, help="normalisation of a uint8 wire, R,G,B [default: the server's]")
    a("--no-val", action="store_true", help="skip validation (a server without a val split)")
    a(
        "--record-indices",
        metavar="DIR",
        help="append each trained batch's dataset indices to DIR/indices-rank{R}.jsonl (checks)",
    )
    a("--fail-at-step", type=int, help=argparse.SUPPRESS)  # test hook, see Trainer._maybe_fail
    return p


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    parser = build_parser()
    ns = vars(parser.parse_args(argv))
    if not ns["servers"]:
        ns["servers"] = TrainConfig().servers
    cfg = TrainConfig(**ns)
    try:
        cfg.validate()
        for endpoint in cfg.servers:  # a host name nothing resolves: now, naming DNS
            check_resolvable(endpoint)
    except (ConfigError, UnresolvableHost) as exc:
        parser.error(str(exc))
    return cfg


def check_keys(cfg: TrainConfig) -> None:
    """Load the keys folder (--keys, else $BATCHWIRE_KEYS) now: a missing or broken one is a
    one-line `ConfigError` naming the folder and the fix, before torch and any connection."""
    from batchwire.wire.keys import KEYS_ENV, KeysError, client_keys

    try:
        client_keys(cfg.keys)
    except KeysError as exc:
        named = f"--keys {cfg.keys}" if cfg.keys is not None else f"${KEYS_ENV}"
        raise ConfigError(f"{named}: {exc}") from None


def make_loader(
    cfg: TrainConfig,
    ctx: DistContext,
    split: str,
    image_size: tuple[int, int] | None = None,
) -> Any:
    """A RemoteLoader for `split` of this rank, yielding normalised floats whatever the wire
    (a uint8 wire is normalised on the device, a float one was by the server); `image_size`
    None: the servers' --image-size."""
    from batchwire.client import RemoteLoader

    return RemoteLoader(
        cfg.servers,
        split=split,
        device=ctx.device,
        rank=ctx.rank,
        world_size=ctx.world_size,
        prefetch=cfg.prefetch,
        timeout=cfg.timeout,
        keys=cfg.keys,
        with_indices=True,
        normalize_on_device=None,  # decided by the wire's dtype at the welcome
        mean=cfg.mean,
        std=cfg.std,
        image_size=image_size,
    )


def _refused_split(exc: Exception) -> bool:
    """Is `exc` a server's refusal of a hello for a split it does not serve?"""
    return "unknown split" in str(getattr(exc, "server_message", ""))


def open_loaders(cfg: TrainConfig, ctx: DistContext) -> tuple[Any, Any | None, Any]:
    """(train loader, val loader or None, the server's welcome), checked before any step.

    The train loader's first connection is the probe, and it is kept: the loaders normalise a
    uint8 wire on the device and pass a float one through, as each welcome says (a probe closed
    and opened again had the server make the batches it asked for in between for nothing; a
    resume, or --resize-schedule's first size, still starts the pass afresh). A server without
    a train split is an error here; one without a val split is said once (rank 0) and
    validation is skipped, instead of an epoch trained and then an error. The val loader asks
    for its welcome and leaves again (it reconnects when the first validation starts), so it
    holds no batches while the epoch trains. With --resize-schedule the probe asks for the
    schedule's largest size, so a server whose --max-image-size is too small refuses now, not
    at the epoch that needs it; multi-view batches (--views), which this loop does not train,
    are an error here too.
    """
    from batchwire.client import ServerError

    steps = cfg.resize_steps()
    probe_size = largest(steps) if steps else None
    train = make_loader(cfg, ctx, "train", image_size=probe_size)
    try:
        welcome = train.server_info()
    except ServerError as exc:
        train.close()
        if _refused_split(exc):
            raise ConfigError(
                f"pipeline-server at {exc.endpoint} serves no train split ({exc.server_message}); "
                "start it with --train"
            ) from None
        if probe_size is not None and "image_size" in exc.server_message:
            raise ConfigError(_refused_size(exc, probe_size)) from None
        raise
    try:
        if welcome.views:
            raise ConfigError(
                f"pipeline-server at {', '.join(cfg.servers)} serves multi-view batches (--views: "
                f"{len(welcome.views)} views per sample); pipeline-train trains one view per "
                "sample: train on them with your own loop over RemoteLoader (docs/transforms.md, "
                '"Multi-view and progressive resizing"), or serve without --views'
            )
        val = None
        if not cfg.no_val:
            val = make_loader(cfg, ctx, "val")
            try:
                val.server_info()
            except ServerError as exc:
                val.close()
                if not _refused_split(exc):
                    raise
                val = None
                if ctx.is_main:
                    log.warning(
                        "pipeline-server at %s serves no val split (%s): training without "
                        "validation (pass --no-val to skip this check)",
                        exc.endpoint,
                        exc.server_message,
                    )
            else:
                val.close()
    except BaseException:
        train.close()
        raise
    return train, val, welcome


def _refused_size(exc: Any, size: tuple[int, int]) -> str:
    """The error of a server that refuses --resize-schedule's largest size: the fix first."""
    h, w = size
    if "--max-image-size" in exc.server_message:
        return (
            f"pipeline-server at {exc.endpoint} cannot serve --resize-schedule's largest size "
            f"{h}x{w}: start it with --max-image-size {h},{w} or more (it said: "
            f"{exc.server_message})"
        )
    return (
        f"pipeline-server at {exc.endpoint} refuses --resize-schedule's largest size {h}x{w}: "
        f"{exc.server_message}"
    )


def _describe_batches(cfg: TrainConfig, welcome: Any) -> str:
    """The banner's batch size, image size(s) and labels."""
    steps = cfg.resize_steps()
    if steps:
        sizes = ", ".join(f"{s.size[0]}x{s.size[1]} from epoch {s.epoch}" for s in steps)
        size = f"{sizes} (--resize-schedule)"
    else:
        size = f"{welcome.shape[2]}x{welcome.shape[3]} px"
    labels = (
        f", multi-label (up to {welcome.label_width} per sample: binary cross-entropy, val mAP/F1)"
        if welcome.label_width
        else ""
    )
    return f"batch {welcome.batch_size} x {size} {welcome.dtype} per rank{labels}"


def _sharing_text(cfg: TrainConfig, welcome: Any) -> str:
    """The start line of a job whose server shares production (a sweep's jobs on one server):
    it cannot know yet whether another job will ask, so it says what the epoch lines count."""
    servers = ", ".join(cfg.servers)
    produce = "produces" if len(cfg.servers) == 1 else "produce"
    return (
        f"sharing on: {servers} {produce} each batch once for every job asking for it "
        f"(--share-window {welcome.share_window}); each epoch line says how many of this job's "
        "batches were shared"
    )


def run(cfg: TrainConfig) -> list[EpochResult]:
    """Join the process group, train, and always leave the process group again.

    With --checkpoint-dir, SIGUSR1 is caught from here on, before torch is imported: it makes
    `fit()` checkpoint and raise `CheckpointedOnSignal` (see `preemption`).
    """
    with checkpoint_on_usr1(bool(cfg.checkpoint_dir)) as request:
        return _run(cfg, request)


def _run(cfg: TrainConfig, request: CheckpointRequest | None) -> list[EpochResult]:
    from .distributed import init_distributed, shutdown_distributed
    from .loop import Trainer

    ctx = init_distributed(cfg.device)
    train_loader = val_loader = None
    try:
        if ctx.is_main:  # at once: the welcome may take a while (a server still starting)
            print(
                f"pipeline-train {installed_version()}: {cfg.model}, {ctx.world_size} rank(s) on "
                f"{ctx.device.type}; connecting to {', '.join(cfg.servers)} "
                f"(waiting up to {cfg.timeout:g} s)",
                flush=True,
            )
        train_loader, val_loader, welcome = open_loaders(cfg, ctx)
        num_classes, batch_size = cfg.num_classes or welcome.num_classes, welcome.batch_size
        if not num_classes:
            raise ConfigError("the server does not say how many classes it has: pass --num-classes")
        if ctx.is_main:
            print(
                f"pipeline-train: {cfg.model}, {num_classes} classes, {ctx.world_size} rank(s) on "
                f"{ctx.device.type}, {_describe_batches(cfg, welcome)}, {welcome.num_batches} "
                f"batches per epoch per rank, servers {', '.join(cfg.servers)}",
                flush=True,
            )
            if welcome.share_window:
                print(f"pipeline-train: {_sharing_text(cfg, welcome)}", flush=True)
        trainer = Trainer(
            cfg,
            ctx,
            train_loader,
            val_loader,
            num_classes,
            batch_size,
            out=lambda msg: print(msg, flush=True),
            multi_label=welcome.label_width > 0,
            checkpoint_request=request,
            sharing=welcome.share_window > 0,
        )
        return trainer.fit()
    finally:
        for loader in (train_loader, val_loader):
            if loader is not None:
                loader.close()
        shutdown_distributed()


def main(argv: list[str] | None = None) -> int:
    code = _train(argv)
    # A DDP rank: torch's gloo threads must not see the teardown. A run that never got as far
    # as importing the loop's distributed module had no process group (nor torch to import).
    distributed = sys.modules.get("batchwire.train.distributed")
    if distributed is not None:
        distributed.exit_after_distributed(code)
    return code


def _train(argv: list[str] | None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    cfg = parse_config(argv)
    try:
        check_keys(cfg)
    except ConfigError as exc:
        print(f"pipeline-train: error: {exc}", file=sys.stderr)
        return 2
    from batchwire.client import ServerError

    try:
        run(cfg)
    except CheckpointedOnSignal:  # rank 0 said where the checkpoint is
        return CHECKPOINTED_EXIT
    except KeyboardInterrupt:
        print("pipeline-train: interrupted", file=sys.stderr)
        return 130
    except (ConfigError, ConnectionError) as exc:  # ConnectionError: no server (ServerUnavailable)
        print(f"pipeline-train: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1
    except ServerError as exc:  # a refusal that cannot clear, e.g. a split the server lacks
        print(f"pipeline-train: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
