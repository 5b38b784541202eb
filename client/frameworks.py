"""Wrappers of other frameworks that would silently lose or repeat a RemoteLoader's data.

RemoteLoader already gives each rank its own shard. HF Accelerate's ``prepare`` treats any
``IterableDataset`` as one stream to split between processes: its ``DataLoaderDispatcher``
reads rank 0's loader only and slices its batches between the ranks (half the epoch never seen,
no error), and its ``IterableDatasetShard`` keeps every n-th sample of each rank's own shard.
Neither can be made correct from inside the loader, so the loader stops with the fix instead.
"""

from __future__ import annotations

import sys

from batchwire.client.errors import LoaderError

# (module prefix, class name) of wrappers that re-shard an IterableDataset.
_RESHARDING_WRAPPERS = {
    ("accelerate", "DataLoaderDispatcher"),
    ("accelerate", "IterableDatasetShard"),
}
_FRAMES_TO_CHECK = 24  # the wrappers call us through torch's DataLoader iterator: ~8 frames


def refuse_resharding_wrappers() -> None:
    """Raise `LoaderError` if one of the callers is a wrapper that re-shards the loader."""
    frame = sys._getframe(1)
    for _ in range(_FRAMES_TO_CHECK):
        if frame is None:
            return
        owner = frame.f_locals.get("self")
        if owner is not None:
            cls = type(owner)
            top = cls.__module__.split(".", 1)[0]
            if (top, cls.__name__) in _RESHARDING_WRAPPERS:
                raise LoaderError(
                    f"RemoteLoader is wrapped by {top}'s {cls.__name__}, which re-shards it "
                    "between processes: data would be lost. RemoteLoader already gives each rank "
                    "its own shard, so do not pass it (or a DataLoader around it) to "
                    "accelerator.prepare(): build it with device=accelerator.device, iterate it "
                    "directly, and call accelerator.register_for_checkpointing(loader) to "
                    "save its position with save_state()"
                )
        frame = frame.f_back
