"""Setup of what the server serves: datasets, augmentation configs, decoder and producers."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from batchwire.pipeline.augment_plan import AugmentConfig
from batchwire.pipeline.dataset import ImageDataset, open_dataset
from batchwire.pipeline.decode import CpuBatchDecoder
from batchwire.pipeline.producer import BatchProducer
from batchwire.pipeline.sampler import ShardSampler
from batchwire.server.config import ServerConfig

log = logging.getLogger("batchwire.server")


class StartupError(RuntimeError):
    """The server cannot start as configured; the message says why and what to change."""


@dataclass
class Split:
    """One servable split: its files, how its samples are augmented, and who produces them."""

    name: str
    dataset: ImageDataset
    augment: AugmentConfig
    producer: BatchProducer | None = None

    @property
    def train(self) -> bool:
        return self.augment.train

    def sampler(self, batch_size: int, seed: int, rank: int, world_size: int) -> ShardSampler:
        """Train: shuffled, incomplete last round dropped; val: in order, padded."""
        return ShardSampler(
            len(self.dataset),
            batch_size,
            seed=seed,
            shuffle=self.train,
            drop_last=self.train,
            rank=rank,
            world_size=world_size,
        )


def augment_config(config: ServerConfig, train: bool) -> AugmentConfig:
    return AugmentConfig(
        image_size=(config.image_size, config.image_size),
        train=train,
        scale=tuple(config.scale),
        ratio=tuple(config.ratio),
        flip_prob=config.flip_prob,
        brightness=config.brightness,
        contrast=config.contrast,
        saturation=config.saturation,
        hue=config.hue,
        val_crop_fraction=config.val_crop_fraction,
        mean=tuple(config.mean),
        std=tuple(config.std),
        output_dtype=config.output_dtype,
        layout=config.layout,
    )


def data_roots(config: ServerConfig) -> dict[str, str]:
    """split -> path; the embedded dataset when no --train is given."""
    if config.train is None:
        if config.val is not None:
            raise StartupError(
                "--val needs --train (without --train the embedded dataset is served)"
            )
        from batchwire.pipeline.synthetic import default_dataset

        ds = default_dataset()
        log.info("no --train given: serving the embedded dataset in %s", ds.train_root.parent)
        return {"train": str(ds.train_root), "val": str(ds.val_root)}
    roots = {"train": config.train}
    if config.val is not None:
        roots["val"] = config.val
    return roots


def make_decoder(config: ServerConfig) -> Any:
    """The `--decoder` on `--device` (issue 7's selector when present, else the CPU decoder)."""
    try:
        from batchwire.pipeline.decoder_select import make_decoder as select
    except ImportError:
        select = None
    if select is None:
        if config.decoder not in ("auto", "cpu") or config.device != "cpu":
            raise StartupError(
                f"--decoder {config.decoder} --device {config.device} is not available in this "
                "build (only the CPU decoder is); use --decoder cpu --device cpu"
            )
        return CpuBatchDecoder(config.workers)
    try:
        return select(config.decoder, config.device, config.workers, max_batch=config.batch_size)
    except (RuntimeError, ValueError) as exc:
        raise StartupError(
            f"cannot use --decoder {config.decoder} on --device {config.device}: {exc}"
        ) from None


def open_splits(config: ServerConfig, decoder: Any) -> dict[str, Split]:
    """Open every split's dataset and build its producer; StartupError on unusable data."""
    splits: dict[str, Split] = {}
    for name, root in data_roots(config).items():
        try:
            dataset = open_dataset(root)
        except (OSError, ValueError) as exc:
            raise StartupError(f"--{name} {root}: {exc}") from None
        split = Split(name, dataset, augment_config(config, train=(name == "train")))
        try:
            split.producer = BatchProducer(
                dataset, split.augment, config.seed, decoder, max_pixels=config.max_pixels
            )
        except ValueError as exc:  # e.g. UnreadableDatasetError from the probe
            raise StartupError(f"--{name} {root}: {exc}") from None
        log.info("%s: %d images, %d classes from %s", name, len(dataset), dataset.num_classes, root)
        splits[name] = split
    return splits
