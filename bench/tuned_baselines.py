"""Two more reference rows of `pipeline-bench`, each the best a user gets from another tool.

- `dataloader_tuned`: the DataLoader row as a careful user tunes it: PIL decodes each JPEG at
  the smallest DCT scale that still covers the crop at the output size (`Image.draft`, the
  libjpeg scaling batchwire's decoder uses too) and the batch stays uint8 (the float
  normalize moves to the GPU), with the same worker processes.
- `spdl_pipeline`: Meta's SPDL (`spdl.io` on FFmpeg, `spdl.pipeline` threads without the GIL
  held while decoding): each image demuxed, decoded, cropped, scaled and flipped by one FFmpeg
  filter graph, batched uint8. SPDL needs FFmpeg's shared libraries (Debian: libavfilter8,
  libavformat59); where it cannot load, the row is skipped with the reason (`spdl_missing`).

Both draw torchvision's RandomResizedCrop parameters (`baselines.rrc_box`) and flip half the
images, at the same batch size and output size as every other row.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch
from batchwire.bench.baselines import (
    FileDataset,
    Measured,
    RowLoop,
    rrc_box,
    time_dataloader,
)


class PilDraftTransform:
    """RandomResizedCrop + flip to a uint8 CHW tensor, the JPEG decoded at a reduced DCT scale
    where the crop allows it (PIL's `draft`: the smallest of 1/1..1/8 keeping each side at
    least what the resize needs). Takes the image opened, not yet loaded."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, img) -> torch.Tensor:
        from PIL import Image

        width, height = img.size
        left, top, w, h = rrc_box(width, height)
        img.draft("RGB", (max(1, width * self.size // w), max(1, height * self.size // h)))
        sx, sy = img.size[0] / width, img.size[1] / height
        box = (left * sx, top * sy, (left + w) * sx, (top + h) * sy)
        img = img.convert("RGB").resize((self.size, self.size), Image.Resampling.BILINEAR, box=box)
        if torch.rand(1).item() < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1)


class DraftFileDataset(FileDataset):
    """`FileDataset` handing its transform the opened image (draft needs it unloaded)."""

    def __getitem__(self, i: int):
        from PIL import Image

        with Image.open(self.paths[i]) as img:
            return self.transform(img), self.labels[i]


def dataloader_tuned(
    paths: Sequence[str], labels: Sequence[int], loop: RowLoop, *, workers: int
) -> Measured:
    """A torch DataLoader with `workers` processes, PIL draft decoding, uint8 batches."""
    transform = PilDraftTransform(loop.image_size)
    return time_dataloader(DraftFileDataset(paths, labels, transform), loop, workers=workers)


def spdl_missing() -> str | None:
    """Why the SPDL row cannot run here, or None when it can."""
    try:
        import spdl.io

        spdl.io.get_video_filter_desc(scale_width=1, scale_height=1)  # loads its FFmpeg binding
    except ImportError:
        return "SPDL is not installed (pip install spdl==0.8.0)"
    except RuntimeError as exc:  # no FFmpeg libraries its binding can load
        return f"SPDL cannot load FFmpeg ({str(exc).splitlines()[0][:120]})"
    return None


def spdl_pipeline(paths: Sequence[str], loop: RowLoop, *, threads: int) -> Measured:
    """SPDL decoding, cropping, scaling and flipping on `threads` threads, batched uint8."""
    import spdl.io
    from spdl.pipeline import PipelineBuilder

    def load(index: int) -> np.ndarray:
        packets = spdl.io.demux_image(paths[index])
        left, top, w, h = rrc_box(packets.width, packets.height)
        flip = ",hflip" if torch.rand(1).item() < 0.5 else ""
        size = loop.image_size
        graph = (
            f"crop={w}:{h}:{left}:{top},scale={size}:{size}:flags=bilinear"
            f"{flip},format=pix_fmts=rgb24"
        )
        frames = spdl.io.decode_packets(packets, filter_desc=graph)
        return spdl.io.to_numpy(spdl.io.convert_frames(frames))

    def collate(images: list[np.ndarray]) -> torch.Tensor:
        return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2)

    order = np.random.default_rng(0).integers(0, len(paths), loop.images_needed).tolist()
    pipeline = (
        PipelineBuilder()
        .add_source(order)
        .pipe(load, concurrency=threads)
        .aggregate(loop.batch_size, drop_last=True)
        .pipe(collate)
        .add_sink(3)
        .build(num_threads=threads)
    )
    with pipeline.auto_stop():
        batches: Iterator[int] = (int(batch.shape[0]) for batch in pipeline)
        return loop.time(batches)
