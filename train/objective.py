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

Padded slots (an elastic resume's last train round: label PADDING_LABEL, pixels repeating a real
sample's) train nothing, whatever the objective: the loss is the mean over the real rows, as
cross-entropy's ``ignore_index`` makes it for one unmixed label. A mixed one-label batch's
padded rows have all-zero soft targets (a real row's sum to 1); a multi-label padded row's
targets are -1 (`PADDED_TARGET`), since an all-zero row is a real photo with no class.

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

#: A multi-label padded row's targets (`Objective.__call__`), left out by `Objective.loss`.
PADDED_TARGET = -1.0


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
        padded = labels[:, 0] == PADDING_LABEL  # a padded slot's row is all PADDING_LABEL
        if self.mixer is None:
            targets[padded.to(targets.device)] = PADDED_TARGET
            return images, targets
        # The pixels are mixed by BatchMixer itself; its one-hot targets do not apply to
        # multi-hot rows, so it gets placeholder labels (class 0, discarded; a padded row's
        # PADDING_LABEL, which it keeps out of the mix) and the real rows' targets are mixed
        # with its draws (`params` is a pure function of the same key: the same draws).
        placeholders = torch.where(padded, PADDING_LABEL, 0)
        mixed, _ = self.mixer(images, placeholders, epoch=epoch, batch_index=batch_index)
        params = self.mixer.params(epoch, batch_index, images.shape[-2], images.shape[-1])
        if not bool(padded.any()):
            return mixed, mix_targets(targets, params)
        real = (~padded).nonzero().squeeze(1).to(targets.device)
        out = torch.full_like(targets, PADDED_TARGET)
        out[real] = mix_targets(targets[real], params)
        return mixed, out

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The batch's mean loss over its real rows (float32 whatever autocast computed the
        logits in); 0, still a function of the logits, when every row is padding (the rank
        steps with the others). Masked, not indexed: no host sync on a GPU."""
        logits = logits.float()
        if self.multi_label:
            real = (targets >= 0).all(1)  # a padded row's targets are PADDED_TARGET
            per_class = F.binary_cross_entropy_with_logits(
                logits, targets.clamp(min=0), reduction="none"
            )
            return _mean_over(real, per_class.mean(1))
        if targets.dim() == 2:  # soft targets of a mixed batch, smoothing already in them
            per_row = -(targets * F.log_softmax(logits, 1)).sum(1)  # cross_entropy's, per row
            return _mean_over(targets.sum(1) > 0, per_row)  # a padded row's are all zero
        per_row = F.cross_entropy(  # a padded row (PADDING_LABEL, the ignore_index) gives 0
            logits, targets, label_smoothing=self.label_smoothing, reduction="none"
        )
        return _mean_over(targets != PADDING_LABEL, per_row)


def _mean_over(real: torch.Tensor, per_row: torch.Tensor) -> torch.Tensor:
    """The mean of ``per_row`` over the rows ``real`` marks (0 when it marks none)."""
    weights = real.to(per_row.dtype)
    return (per_row * weights).sum() / weights.sum().clamp(min=1.0)
