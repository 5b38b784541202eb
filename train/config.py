"""`TrainConfig`: every setting of `pipeline-train` in one dataclass (the CLI fills it).

Torch-free at import, like the names of the choices below (the one list of each: the CLI's
argparse `choices`, `models.build_model` and `schedule.build_scheduler` read them here), so
`pipeline-train --help` and a mistyped flag answer before torch is imported (~2 s).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .resize import ResizeStep, ScheduleError, parse_resize_schedule

if TYPE_CHECKING:
    import torch

AMP_MODES = ("auto", "bf16", "fp16", "off")
OPTIMIZERS = ("sgd", "adamw")
MODEL_NAMES = ("small", "resnet18", "resnet50")
SCHEDULES = ("cosine", "onecycle")


class ConfigError(ValueError):
    """A setting that cannot work (told to the user as one line, without a traceback)."""


@dataclass
class TrainConfig:
    servers: list[str] = field(default_factory=lambda: ["tcp://127.0.0.1:5555"])
    model: str = "resnet50"
    num_classes: int | None = None  # None: from the server's welcome
    epochs: int = 90
    lr: float | None = None  # None: 0.1 x global batch / 256 for SGD, 1e-3 for AdamW
    optimizer: str = "sgd"
    momentum: float = 0.9
    weight_decay: float = 5e-5
    warmup_epochs: float = 1.0
    schedule: str = "cosine"
    label_smoothing: float = 0.0
    mixup: float = 0.0  # Beta alpha of Mixup; 0: off
    cutmix: float = 0.0  # Beta alpha of CutMix; 0: off (both on: one or the other per batch)
    mix_prob: float = 1.0  # the chance a batch is mixed at all
    resize_schedule: str | None = None  # "128:0,160:10,224:30": image size from epoch (resize.py)
    accum_steps: int = 1
    clip_grad: float | None = None
    compile: bool = False
    amp: str = "auto"
    channels_last: bool = False
    zero_init_residual: bool = False
    log_every: int = 50
    log_dir: str | None = None  # CSV files (and TensorBoard events when installed), rank 0
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0  # optimizer steps; 0 = only at epoch ends
    keep_checkpoints: int = 2
    seed: int = 0
    max_steps: int | None = None
    device: str = "auto"
    prefetch: int = 4
    keys: str | None = None  # a `pipeline-keys` folder; None: $BATCHWIRE_KEYS, else plain
    timeout: float = 60.0
    mean: tuple[float, float, float] | None = None  # None: the server's
    std: tuple[float, float, float] | None = None
    no_val: bool = False
    record_indices: str | None = None
    fail_at_step: int | None = None  # test hook: SIGKILL the last rank after this step, once

    def validate(self) -> None:
        problems = []
        if not self.servers:
            problems.append("--server needs at least one endpoint")
        for name in ("epochs", "accum_steps", "log_every", "prefetch"):
            if getattr(self, name) < 1:
                problems.append(f"--{name.replace('_', '-')} must be >= 1")
        if self.checkpoint_every < 0:
            problems.append("--checkpoint-every must be >= 0")
        if self.max_steps is not None and self.max_steps < 1:
            problems.append("--max-steps must be >= 1")
        if self.num_classes is not None and self.num_classes < 1:
            problems.append("--num-classes must be >= 1")
        if self.lr is not None and not self.lr > 0:
            problems.append("--lr must be > 0")
        if not 0.0 <= self.label_smoothing < 1.0:
            problems.append("--label-smoothing must be in [0, 1)")
        if self.mixup < 0 or self.cutmix < 0:
            problems.append("--mixup and --cutmix must be >= 0 (0 turns one off)")
        if not 0.0 <= self.mix_prob <= 1.0:
            problems.append("--mix-prob must be in [0, 1]")
        elif self.mix_prob != 1.0 and not (self.mixup or self.cutmix):
            problems.append("--mix-prob needs --mixup or --cutmix")
        if self.resize_schedule is not None:
            try:
                self.resize_steps()
            except ScheduleError as exc:
                problems.append(str(exc))
        if self.warmup_epochs < 0:
            problems.append("--warmup-epochs must be >= 0")
        if self.clip_grad is not None and not self.clip_grad > 0:
            problems.append("--clip-grad must be > 0")
        if self.fail_at_step is not None and self.checkpoint_dir is None:
            problems.append("--fail-at-step needs --checkpoint-dir (it tests resuming)")
        if problems:
            raise ConfigError("; ".join(problems))

    def resize_steps(self) -> tuple[ResizeStep, ...] | None:
        """--resize-schedule parsed (None without one); `ScheduleError` on a bad spelling."""
        if self.resize_schedule is None:
            return None
        return parse_resize_schedule(self.resize_schedule)

    def amp_dtype(self, device: torch.device) -> torch.dtype | None:
        """The autocast dtype: bf16 on GPUs under `auto`, nothing on the CPU unless asked."""
        import torch

        if self.amp == "auto":
            return torch.bfloat16 if device.type == "cuda" else None
        if self.amp == "fp16" and device.type != "cuda":
            raise ConfigError("--amp fp16 needs a CUDA device (use bf16 or off on the CPU)")
        return {"bf16": torch.bfloat16, "fp16": torch.float16, "off": None}[self.amp]
