"""A split over a mixture (`pipeline.sources.mix.MixDataset`): its train epochs in the mix's
order (`pipeline.sampler.MixSampler`); a val mix is its parts back to back, each sample once,
in order (`Split`'s own sampler: validation ignores weights)."""

from __future__ import annotations

from batchwire.pipeline.sampler import MixSampler, ShardSampler
from batchwire.pipeline.sources.mix import MixDataset
from batchwire.pipeline.split import Split


class MixSplit(Split):
    """`Split` whose train sampler follows the mix's plan."""

    def sampler(self, batch_size: int, seed: int, rank: int, world_size: int) -> ShardSampler:
        dataset = self.dataset
        if not self.train or not isinstance(dataset, MixDataset) or dataset.plan is None:
            return super().sampler(batch_size, seed, rank, world_size)
        return MixSampler(dataset.plan, batch_size, seed=seed, rank=rank, world_size=world_size)


def as_mix_split(split: Split) -> Split:
    """``split`` itself, or as a `MixSplit` when its dataset is a mix."""
    if not isinstance(split.dataset, MixDataset):
        return split
    return MixSplit(split.name, split.dataset, split.augment, split.producer)
