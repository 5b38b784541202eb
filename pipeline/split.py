"""A split: its files, its sampler policy, how its samples are augmented, and its producer.

Built in one place for the server and for `LocalLoader`, so "LocalLoader yields RemoteLoader's
batches" holds by construction rather than by keeping two assemblies in step.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchwire.pipeline.augment_plan import AugmentConfig
from batchwire.pipeline.decode import DEFAULT_MAX_PIXELS, BatchDecoder
from batchwire.pipeline.image_dataset import ImageDataset
from batchwire.pipeline.producer import BatchProducer
from batchwire.pipeline.sampler import MixSampler, ShardSampler
from batchwire.pipeline.samples import SampleLoader
from batchwire.pipeline.sources.mix import MixDataset


@dataclass
class Split:
    """One servable split; ``augment.train`` decides the sampler policy and the augmentation."""

    name: str
    dataset: ImageDataset
    augment: AugmentConfig
    producer: BatchProducer

    @property
    def train(self) -> bool:
        return self.augment.train

    @property
    def samples(self) -> SampleLoader:
        """The split's sample loader, whose bad-file list feeds the server's `BadFileTally`."""
        return self.producer.samples

    def sampler(self, batch_size: int, seed: int, rank: int, world_size: int) -> ShardSampler:
        """Train: shuffled, the incomplete last round dropped (a mix: in its plan's order,
        `MixSampler`); val: in order, padded (a val mix too: each sample of every part once,
        validation ignores weights). The one place that decides, for the server and
        `LocalLoader` alike."""
        dataset = self.dataset
        if self.train and isinstance(dataset, MixDataset) and dataset.plan is not None:
            return MixSampler(dataset.plan, batch_size, seed=seed, rank=rank, world_size=world_size)
        return ShardSampler(
            len(self.dataset),
            batch_size,
            seed=seed,
            shuffle=self.train,
            drop_last=self.train,
            rank=rank,
            world_size=world_size,
        )


def build_split(
    name: str,
    dataset: ImageDataset,
    augment: AugmentConfig,
    seed: int,
    decoder: BatchDecoder,
    max_pixels: int | None = DEFAULT_MAX_PIXELS,
) -> Split:
    """The split's producer over ``dataset``; ValueError (e.g. `UnreadableDatasetError` from
    the producer's probe) when it cannot produce a single batch."""
    producer = BatchProducer(dataset, augment, seed, decoder, max_pixels=max_pixels)
    return Split(name, dataset, augment, producer)
