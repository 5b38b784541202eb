"""What a train batch is fitted to: its targets (mixed or not) and the loss that takes them.

- One label per sample ([B]): cross-entropy with --label-smoothing; with --mixup/--cutmix, the
  batch goes through `BatchMixer` (client/mixing.py: torchvision v2 semantics) and the loss is
  cross-entropy against its soft targets (label smoothing applied inside them, once).
- Multi-label ([B, K] padded ids, the server's welcome has ``label_width``): BCE with logits
  against the multi-hot targets (`multi_hot`). Mixing is defined as for one label, on the
  multi-hot rows: ``lam * y + (1 - lam) * y_rolled``, the sample's own classes weighted by the
  share of it kept (mixup) or of its pixels kept (CutMix), the partner's by the rest; each class
  target stays in [0, 1], which is what BCE takes, and a class both samples have stays 1.
  --label-smoothing is refused with multi-label targets (it is defined for a softmax over
  classes, not for independent sigmoids).

Mixing is deterministic from (--seed, epoch, batch index in the epoch, rank): `BatchMixer`
draws from a generator keyed by them alone, so a resumed run mixes batch k exactly as the
uninterrupted one did.
"""

from __future__ import annotations

import torch
from batchwire.client import multi_hot
from batchwire.client.mixing import BatchMixer, MixParams
from batchwire.wire import PADDING_LABEL
from torch.nn import functional as F

from .config import ConfigError


def mix_targets(targets: torch.Tensor, params: MixParams) -> torch.Tensor:
    """[B, C] float targets mixed as the images of `params` are: each row ``lam`` of its own,
    ``1 - lam`` of the previous row's (``roll(1)``, the partner `BatchMixer` pairs it with)."""
    if params.kind == "none":
        return targets
    return targets.mul(params.lam).add_(targets.roll(1, 0), alpha=1.0 - params.lam)


class Objective:
    """Targets and loss of the train batches of one rank (see the module docstring)."""

    def __init__(
        self,
        num_classes: int,
        *,
        multi_label: bool,
        label_smoothing: float = 0.0,
        mixer: BatchMixer | None = None,
    ) -> None:
        if multi_label and label_smoothing:
            raise ConfigError(
                "--label-smoothing is for single-label cross-entropy; this server's split is "
                "multi-label (trained with binary cross-entropy): leave it at 0"
            )
        self.num_classes = num_classes
        self.multi_label = multi_label
        self.label_smoothing = label_smoothing
        self.mixer = mixer

    def __call__(
        self, images: torch.Tensor, labels: torch.Tensor, *, epoch: int, batch_index: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the images the model sees, the targets `loss` takes) of train batch `batch_index`."""
        if not self.multi_label:
            if self.mixer is None:
                return images, labels
            return self.mixer(images, labels, epoch=epoch, batch_index=batch_index)
        targets = multi_hot(labels, self.num_classes).to(images.device)
        if self.mixer is None:
            return images, targets
        # The pixels are mixed by BatchMixer itself; its one-hot targets do not apply to
        # multi-hot rows, so it gets placeholder labels (class 0, discarded; a padded row's
        # PADDING_LABEL, which it keeps out of the mix) and the real rows' targets are mixed
        # with its draws (`params` is a pure function of the same key: the same draws).
        padded = labels[:, 0] == PADDING_LABEL  # a padded slot's row is all PADDING_LABEL
        placeholders = torch.where(padded, PADDING_LABEL, 0)
        mixed, _ = self.mixer(images, placeholders, epoch=epoch, batch_index=batch_index)
        params = self.mixer.params(epoch, batch_index, images.shape[-2], images.shape[-1])
        if not bool(padded.any()):
            return mixed, mix_targets(targets, params)
        real = (~padded).nonzero().squeeze(1).to(targets.device)
        out = torch.zeros_like(targets)  # a padded row's target: all zero, as multi_hot made it
        out[real] = mix_targets(targets[real], params)
        return mixed, out

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The batch's mean loss (float32 whatever autocast computed the logits in)."""
        logits = logits.float()
        if self.multi_label:
            return F.binary_cross_entropy_with_logits(logits, targets)
        if targets.dim() == 2:  # soft targets of a mixed batch, smoothing already in them
            return F.cross_entropy(logits, targets)
        return F.cross_entropy(logits, targets, label_smoothing=self.label_smoothing)
