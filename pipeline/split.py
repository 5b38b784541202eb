"""A split: its files, its sampler policy, how its samples are augmented, and its producer.

Built in one place for the server and for `LocalLoader`, so "LocalLoader yields RemoteLoader's
batches" holds by construction rather than by keeping two assemblies in step.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchwire.pipeline.augment_plan import AugmentConfig
from batchwire.pipeline.decode import DEFAULT_MAX_PIXELS, BatchDecoder
from batchwire.pipeline.image_dataset import ImageDataset
from batchwire.pipeline.mix_order import MixPlan
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

    @property
    def samples_per_epoch(self) -> int:
        """Samples an epoch draws, all ranks together, before dropping or padding (the
        welcome's ``num_samples``): a train mix's epoch length (its index space also holds
        the extra copies of a part drawn more than its size), else the dataset's length."""
        plan = self._train_mix_plan
        return len(self.dataset) if plan is None else plan.epoch_length

    @property
    def mix_fingerprint(self) -> str:
        """`MixDataset.fingerprint` of a mix split (what a fleet's servers must agree on
        beyond the welcome's counts), "" for any other source."""
        return self.dataset.fingerprint if isinstance(self.dataset, MixDataset) else ""

    @property
    def _train_mix_plan(self) -> MixPlan | None:
        """The plan that orders a train mix's epochs; None: a permutation or the identity of
        the dataset's indices orders them (val mixes too: validation ignores weights)."""
        dataset = self.dataset
        if self.train and isinstance(dataset, MixDataset):
            return dataset.plan
        return None

    def sampler(self, batch_size: int, seed: int, rank: int, world_size: int) -> ShardSampler:
        """Train: shuffled, the incomplete last round dropped (a mix: in its plan's order,
        `MixSampler`); val: in order, padded (a val mix too: each sample of every part once,
        validation ignores weights). The one place that decides, for the server and
        `LocalLoader` alike."""
        plan = self._train_mix_plan
        if plan is not None:
            return MixSampler(plan, batch_size, seed=seed, rank=rank, world_size=world_size)
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
