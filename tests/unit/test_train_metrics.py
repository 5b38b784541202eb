"""pipeline-train's pure parts of issue 29 item 3: multi-label mAP and F1 (against hand-computed
figures), the --resize-schedule spelling, and the train targets with and without Mixup/CutMix
(multi-label ones mixed as lam * y + (1 - lam) * y_rolled). No processes."""

from __future__ import annotations

import contextlib

import pytest
import torch
from batchwire.client import multi_hot
from batchwire.client.mixing import BatchMixer
from batchwire.train.config import ConfigError, TrainConfig
from batchwire.train.distributed import DistContext
from batchwire.train.evaluate import evaluate_multilabel, multilabel_scores
from batchwire.train.loop import EpochResult, _epoch_row, format_epoch
from batchwire.train.metrics import (
    MultiLabelScores,
    average_precision,
    f1_counts,
    f1_scores,
    mean_average_precision,
)
from batchwire.train.objective import PADDED_TARGET, Objective
from batchwire.train.resize import (
    ResizeStep,
    ScheduleError,
    largest,
    parse_resize_schedule,
    size_at,
)
from batchwire.wire import PADDING_LABEL
from torch import nn
from torch.nn import functional as F

# ---------------------------------------------------------------- average precision


def test_average_precision_of_one_class_by_hand() -> None:
    # Ranked: + - + - +: precision at the positives 1/1, 2/3, 3/5.
    scores = torch.tensor([[0.9], [0.8], [0.7], [0.6], [0.5]])
    targets = torch.tensor([[1], [0], [1], [0], [1]])
    want = (1 + 2 / 3 + 3 / 5) / 3
    assert average_precision(scores, targets).item() == pytest.approx(want, abs=1e-12)
    # The order of the rows does not matter, only the scores.
    perm = torch.tensor([3, 0, 4, 1, 2])
    assert average_precision(scores[perm], targets[perm]).item() == pytest.approx(want, abs=1e-12)


def test_mean_average_precision_ties_and_classes_without_positives() -> None:
    # class 0: 0.9(+) then a tie at 0.5 of one positive and one negative: the tied positive
    #   gets the precision of the whole group, 2/3 (sklearn's rule): AP = (1 + 2/3) / 2.
    # class 1: its one positive ranked last of 4: AP = 1/4.
    # class 2: no positive: no AP, left out of the mean.
    scores = torch.tensor([[0.9, 0.4, 0.3], [0.5, 0.3, 0.2], [0.5, 0.2, 0.9], [0.1, 0.1, 0.0]])
    targets = torch.tensor([[1, 0, 0], [1, 0, 0], [0, 0, 0], [0, 1, 0]], dtype=torch.bool)
    ap = average_precision(scores, targets)
    assert ap[0].item() == pytest.approx(5 / 6) and ap[1].item() == pytest.approx(0.25)
    assert ap[2].isnan()
    mean_ap, classes = mean_average_precision(scores, targets)
    assert classes == 2 and mean_ap == pytest.approx(100 * (5 / 6 + 1 / 4) / 2)


def test_mean_average_precision_without_any_positive_is_zero_over_zero_classes() -> None:
    assert mean_average_precision(torch.rand(4, 3), torch.zeros(4, 3)) == (0.0, 0)


def test_f1_micro_and_macro_at_threshold_one_half_by_hand() -> None:
    # Predicted where logit >= 0 (sigmoid >= 0.5; a logit of exactly 0 counts as predicted).
    logits = torch.tensor([[1.0, -1.0, -3.0], [2.0, 0.0, -1.0], [-1.0, -2.0, -0.5]])
    targets = torch.tensor([[1, 0, 0], [0, 1, 0], [1, 0, 0]]).float()
    counts = f1_counts(logits, targets)
    # class 0: tp 1 (row 0), fp 1 (row 1), fn 1 (row 2); class 1: tp 1; class 2: nothing.
    assert counts.tolist() == [[1, 1, 1], [1, 0, 0], [0, 0, 0]]
    micro, macro = f1_scores(counts)
    assert micro == pytest.approx(100 * 4 / 6)  # 2 x 2 / (2 x 2 + 1 + 1)
    assert macro == pytest.approx(100 * (0.5 + 1.0) / 2)  # class 2 (0/0) left out


def test_multilabel_scores_loss_is_the_mean_bce() -> None:
    logits, targets = torch.randn(6, 4), torch.rand(6, 4) > 0.5
    got = multilabel_scores(logits, targets)
    assert got.total == 6
    assert got.loss == pytest.approx(
        F.binary_cross_entropy_with_logits(logits, targets.float()).item()
    )
    assert multilabel_scores(torch.zeros(0, 4), torch.zeros(0, 4, dtype=torch.bool)).total == 0


def test_evaluate_multilabel_leaves_padded_slots_out() -> None:
    """Two val batches as RemoteLoader yields them ([B, K] ids, -1 padded; a padded slot has
    index -1 and labels all -100); the 'model' hands the inputs through as logits."""
    ctx = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    logits = torch.tensor([[2.0, -1.0, 0.5], [-1.0, 1.0, -2.0], [0.3, 0.2, 0.1], [9.0, 9.0, 9.0]])
    labels = torch.tensor([[0, 2], [1, -1], [2, 0], [-100, -100]])
    batches = [
        (logits[:2], labels[:2], torch.tensor([5, 7])),
        (logits[2:], labels[2:], torch.tensor([1, -1])),
    ]
    got = evaluate_multilabel(nn.Identity(), batches, ctx, 3, autocast=contextlib.nullcontext)
    want = multilabel_scores(logits[:3], multi_hot(labels[:3], 3).bool())
    assert got == want and got.total == 3


# ---------------------------------------------------------------- --resize-schedule


def test_resize_schedule_is_read_and_gives_each_epoch_its_size() -> None:
    steps = parse_resize_schedule("128:0, 160:10,192x224:30")
    assert steps == (
        ResizeStep(0, (128, 128)),
        ResizeStep(10, (160, 160)),
        ResizeStep(30, (192, 224)),
    )
    assert [size_at(steps, e) for e in (0, 9, 10, 29, 30, 99)] == [
        (128, 128), (128, 128), (160, 160), (160, 160), (192, 224), (192, 224),
    ]  # fmt: skip
    assert largest((ResizeStep(0, (224, 160)), ResizeStep(3, (192, 192)))) == (224, 192)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("128:1,160:10", "starts at epoch 1, not 0"),
        ("128:0,160:10,192:10", "epoch 10 does not come after epoch 10"),
        ("128", "'128' is not SIZE:EPOCH"),
        ("big:0", "size 'big' is not PX or HxW"),
        ("0:0", "size '0' is not in 1..16384"),
        ("128:0,160:-1", "'160:-1' is not SIZE:EPOCH"),
    ],
)
def test_a_bad_resize_schedule_says_what_and_the_form(text: str, why: str) -> None:
    with pytest.raises(ScheduleError, match="expected SIZE:EPOCH") as err:
        parse_resize_schedule(text)
    assert why in str(err.value) and repr(text) in str(err.value)
    with pytest.raises(ConfigError, match="--resize-schedule"):
        TrainConfig(resize_schedule=text).validate()


@pytest.mark.parametrize(
    ("settings", "why"),
    [
        ({"mixup": -0.1}, "--mixup and --cutmix must be >= 0"),
        ({"cutmix": 1.0, "mix_prob": 1.5}, "--mix-prob must be in [0, 1]"),
        ({"mix_prob": 0.5}, "--mix-prob needs --mixup or --cutmix"),
    ],
)
def test_mixing_settings_are_checked(settings: dict, why: str) -> None:
    with pytest.raises(ConfigError, match=f"^{why}".replace("[", r"\[").replace("]", r"\]")):
        TrainConfig(**settings).validate()


# ---------------------------------------------------------------- train targets


def _batch(b: int = 6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    images = torch.randn(b, 3, 8, 8, generator=g)
    labels = torch.randint(0, 5, (b,), generator=g)
    multi = torch.tensor([[0, 2, -1], [1, -1, -1], [3, 4, 0], [2, -1, -1], [4, 1, -1], [0, -1, -1]])
    return images, labels, multi[:b]


def test_single_label_targets_plain_and_mixed() -> None:
    images, labels, _ = _batch()
    plain = Objective(5, multi_label=False, label_smoothing=0.1)
    x, y = plain(images, labels, epoch=0, batch_index=0)
    assert x is images and y is labels
    logits = torch.randn(6, 5)
    assert plain.loss(logits, y).item() == pytest.approx(
        F.cross_entropy(logits, labels, label_smoothing=0.1).item()
    )
    mixer = BatchMixer(5, mixup_alpha=0.4, cutmix_alpha=1.0, label_smoothing=0.1, seed=3, rank=1)
    mixed = Objective(5, multi_label=False, label_smoothing=0.1, mixer=mixer)
    x, y = mixed(images, labels, epoch=2, batch_index=7)
    want_x, want_y = mixer(images, labels, epoch=2, batch_index=7)
    assert torch.equal(x, want_x) and torch.equal(y, want_y)
    # soft targets: the smoothing is inside them, the loss does not add it again
    assert mixed.loss(logits, y).item() == pytest.approx(F.cross_entropy(logits, y).item())


def test_multi_label_targets_are_multi_hot_and_mix_as_lam_y_plus_rest_y_rolled() -> None:
    images, _, labels = _batch()
    y = multi_hot(labels, 5)
    plain = Objective(5, multi_label=True)
    x, targets = plain(images, labels, epoch=0, batch_index=0)
    assert x is images and torch.equal(targets, y)
    logits = torch.randn(6, 5)
    assert plain.loss(logits, targets).item() == pytest.approx(
        F.binary_cross_entropy_with_logits(logits, y).item()
    )
    kinds = set()
    for batch_index in range(12):
        mixer = BatchMixer(5, mixup_alpha=0.8, cutmix_alpha=1.0, seed=9, rank=0)
        objective = Objective(5, multi_label=True, mixer=mixer)
        x, targets = objective(images, labels, epoch=1, batch_index=batch_index)
        p = mixer.params(1, batch_index, 8, 8)
        kinds.add(p.kind)
        assert torch.allclose(targets, p.lam * y + (1 - p.lam) * y.roll(1, 0))
        assert targets.min() >= 0 and targets.max() <= 1
        want_x, _ = mixer(
            images, torch.zeros(6, dtype=torch.long), epoch=1, batch_index=batch_index
        )
        assert torch.equal(x, want_x)  # the pixels BatchMixer mixes, whatever the labels
        again = Objective(5, multi_label=True, mixer=mixer)(
            images, labels, epoch=1, batch_index=batch_index
        )
        assert torch.equal(again[0], x) and torch.equal(again[1], targets)  # a resumed run
    assert kinds == {"mixup", "cutmix"}


def test_multi_label_padding_rows_stay_out_of_the_mix() -> None:
    """An elastic resume pads a train batch (rows of PADDING_LABEL): as BatchMixer does for one
    label, the real rows mix among themselves (pixels and targets) and a padded row keeps its
    pixels and an all-zero target; its repeated pixels never enter a real row."""
    images, _, labels = _batch()
    labels = labels.clone()
    labels[-2:] = PADDING_LABEL
    real = labels[:-2]
    for batch_index in range(6):
        mixer = BatchMixer(5, mixup_alpha=0.8, cutmix_alpha=1.0, seed=9, rank=0)
        x, targets = Objective(5, multi_label=True, mixer=mixer)(
            images, labels, epoch=1, batch_index=batch_index
        )
        want_x, _ = mixer(
            images[:-2], torch.zeros(4, dtype=torch.long), epoch=1, batch_index=batch_index
        )
        p = mixer.params(1, batch_index, 8, 8)
        y = multi_hot(real, 5)
        assert torch.equal(x[:-2], want_x) and torch.equal(x[-2:], images[-2:])
        assert torch.allclose(targets[:-2], p.lam * y + (1 - p.lam) * y.roll(1, 0))
        assert (targets[-2:] == PADDED_TARGET).all()  # left out by the loss


def test_label_smoothing_is_refused_with_multi_label_targets() -> None:
    with pytest.raises(ConfigError, match="--label-smoothing is for single-label"):
        Objective(5, multi_label=True, label_smoothing=0.1)


# ---------------------------------------------------------------- the epoch line and row


def test_a_multi_label_epoch_line_and_csv_row() -> None:
    scores = MultiLabelScores(61.25, 55.5, 40.0, total=40, loss=0.3, ap_classes=5)
    r = EpochResult(0, scores, data_wait=0.1, images_per_s=50.0, train_loss=0.7, seconds=2.0)
    line = format_epoch(r)
    assert line.startswith(
        "epoch 0: val mAP=61.25% F1 micro=55.50% macro=40.00% (5 classes with positives) "
    ), line
    assert "val loss 0.3000" in line
    row = _epoch_row(r)
    assert (row["val_map"], row["val_f1_micro"], row["val_f1_macro"]) == (61.25, 55.5, 40.0)
    assert row["val_top1"] is None and row["val_top5"] is None
