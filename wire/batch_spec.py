"""The output formats: one table of what a batch is, on the wire and in memory.

`BatchSpec` is the single source of truth for a batch's shape, dtype, layout and byte size
(multi-view batches included: `BatchSpec.views`). The
server derives it once from its config and uses it for its buffer pool, the producer's check and
every welcome and batch header; the client rebuilds it from the welcome and stages into it. To
add an output option, extend `DTYPES` or `LAYOUTS` here and the augment op; nothing else in the
wire has to change.

torch is imported lazily: the monitor and raw clients speak the wire without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from batchwire.wire.errors import ProtocolError

if TYPE_CHECKING:
    import torch

#: Largest batch size the protocol allows; keeps memory per client bounded.
MAX_BATCH_SIZE = 65536
#: Memory layouts: "nchw" is contiguous [B, 3, H, W]; "nhwc" is its channels_last view.
LAYOUTS = ("nchw", "nhwc")
#: Wire dtype names -> (numpy dtype name or None when numpy has none, bytes per element).
DTYPES: dict[str, tuple[str | None, int]] = {
    "uint8": ("uint8", 1),
    "float16": ("float16", 2),
    "bfloat16": (None, 2),
    "float32": ("float32", 4),
}
CHANNELS = 3
#: Most views (crops per sample) a multi-view batch may carry.
MAX_VIEWS = 64
#: A padded (validation) slot repeats a real sample; user-facing, its index is PADDING_INDEX (never
#: a dataset index) and its label PADDING_LABEL (cross-entropy's default ``ignore_index``).
PADDING_INDEX = -1
PADDING_LABEL = -100


def _dtype_entry(name: str) -> tuple[str | None, int]:
    if name not in DTYPES:
        raise ProtocolError(f"unknown dtype {name!r}; expected one of {list(DTYPES)}")
    return DTYPES[name]


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a wire dtype name."""
    import torch

    _dtype_entry(name)
    return getattr(torch, name)


def dtype_name(dtype: Any) -> str:
    """The wire name of a torch (or numpy) dtype."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ProtocolError(f"dtype {dtype} cannot travel on the wire; use one of {list(DTYPES)}")
    return name


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype for a wire dtype name (bfloat16 has none: use `torch_dtype`)."""
    np_name = _dtype_entry(name)[0]
    if np_name is None:
        raise ProtocolError(f"numpy has no {name}; view the bytes with torch_dtype({name!r})")
    return np.dtype(np_name)


def itemsize(name: str) -> int:
    """Bytes per element of a wire dtype."""
    return _dtype_entry(name)[1]


def images_nbytes(shape: list[int] | tuple[int, ...], dtype: str) -> int:
    """Size of the images frame for a batch of ``shape`` in ``dtype``."""
    n = 1
    for s in shape:
        n *= int(s)
    return n * itemsize(dtype)


@dataclass(frozen=True)
class BatchSpec:
    """One full batch: ``[batch_size, 3, height, width]`` of ``dtype`` in ``layout``.

    Multi-view (several crops per sample, e.g. DINO's 2 global + 6 local views): ``views`` lists
    every view's ``(height, width)`` in order, the first being ``(height, width)``; the batch is
    then one list of ``[batch_size, 3, Hk, Wk]`` tensors, travelling as one images frame that
    holds the views back to back (view k at the sum of the earlier views' bytes), so one buffer,
    one tracked send and one header describe it, as for one view. ``nbytes`` counts all views
    (the server's memory budget and the client's slots size from it). ``views == ()``: the
    usual single-image batch (``view_bytes`` a tensor, not a list).

    Raises `ProtocolError` (a ValueError) for a dtype, layout or size the wire cannot carry.
    """

    batch_size: int
    height: int
    width: int
    dtype: str
    layout: str = "nchw"
    views: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        _dtype_entry(self.dtype)
        if self.layout not in LAYOUTS:
            raise ProtocolError(f"unknown layout {self.layout!r}; expected one of {list(LAYOUTS)}")
        for name in ("batch_size", "height", "width"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ProtocolError(f"batch {name} must be an integer >= 1, got {value!r}")
        if self.batch_size > MAX_BATCH_SIZE:
            raise ProtocolError(f"batch_size {self.batch_size} exceeds {MAX_BATCH_SIZE}")
        if self.views:
            views = tuple(tuple(v) for v in self.views)
            if len(views) > MAX_VIEWS or any(
                len(v) != 2
                or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in v)
                for v in views
            ):
                raise ProtocolError(
                    f"views must be 1 to {MAX_VIEWS} (height, width) pairs of integers >= 1, "
                    f"got {list(self.views)!r}"
                )
            if views[0] != (self.height, self.width):
                raise ProtocolError(
                    f"the first view {views[0]} must be the batch's {(self.height, self.width)}"
                )
            object.__setattr__(self, "views", views)

    @classmethod
    def from_shape(
        cls,
        shape: list[int] | tuple[int, ...],
        dtype: str,
        layout: str,
        views: list[list[int]] | tuple[tuple[int, int], ...] = (),
    ) -> BatchSpec:
        """The spec of a logical ``[B, 3, H, W]`` shape (as headers and welcomes carry it);
        ``views``: every view's ``[H, W]`` for a multi-view batch (the first is ``shape``'s)."""
        b, c, h, w = (int(s) for s in shape)
        if c != CHANNELS:
            raise ProtocolError(f"batches have {CHANNELS} channels, got shape {list(shape)}")
        return cls(b, h, w, dtype, layout, tuple(tuple(v) for v in views))  # type: ignore[misc]

    def wire_fields(self) -> dict[str, Any]:
        """What a `Welcome` or a `BatchHeader` says of this spec: the logical shape, dtype,
        layout and every view's size (`from_shape` reads them back)."""
        views = [list(v) for v in self.views]
        return {"shape": self.shape, "dtype": self.dtype, "layout": self.layout, "views": views}

    @property
    def shape(self) -> list[int]:
        """The logical shape, ``[B, 3, H, W]`` whatever the layout (the first view's)."""
        return [self.batch_size, CHANNELS, self.height, self.width]

    @property
    def multi_view(self) -> bool:
        return bool(self.views)

    @property
    def view_specs(self) -> list[BatchSpec]:
        """One single-view spec per view (``[self]`` for a single-view batch)."""
        if not self.views:
            return [self]
        return [BatchSpec(self.batch_size, h, w, self.dtype, self.layout) for h, w in self.views]

    @property
    def view_shapes(self) -> list[list[int]]:
        """Every view's logical shape, in order."""
        return [v.shape for v in self.view_specs]

    @property
    def nbytes(self) -> int:
        """Bytes of the images frame (all views)."""
        return sum(images_nbytes(s, self.dtype) for s in self.view_shapes)

    @property
    def labels_nbytes(self) -> int:
        return self.batch_size * 8

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def memory_format(self) -> torch.memory_format:
        import torch

        return torch.channels_last if self.layout == "nhwc" else torch.contiguous_format

    def empty(
        self, *, dtype: torch.dtype | None = None, device: Any = "cpu", pin: bool = False
    ) -> Any:
        """A tensor of this shape in this layout (``dtype`` overrides the wire's, e.g. float);
        a list of them, one per view, for a multi-view spec."""
        import torch

        if self.views:
            return [v.empty(dtype=dtype, device=device, pin=pin) for v in self.view_specs]

        return torch.empty(
            self.shape,
            dtype=dtype or self.torch_dtype,
            device=device,
            memory_format=self.memory_format,
            pin_memory=pin,
        )

    def check(self, t: Any) -> None:
        """Raise ValueError unless ``t`` is a batch of this spec (any batch size up to ours);
        a multi-view spec checks a list of one tensor per view."""
        if self.views:
            if not isinstance(t, (list, tuple)) or len(t) != len(self.views):
                raise ValueError(
                    f"a {len(self.views)}-view batch must be a list of as many tensors"
                )
            for view, spec in zip(t, self.view_specs, strict=True):
                spec.check(view)
            return
        if t.dim() != 4 or list(t.shape[1:]) != self.shape[1:] or t.shape[0] > self.batch_size:
            raise ValueError(f"batch of shape {list(t.shape)} does not fit {self.shape}")
        if t.dtype != self.torch_dtype:
            raise ValueError(f"batch of dtype {t.dtype} is not {self.dtype}")
        if not t.is_contiguous(memory_format=self.memory_format):
            raise ValueError(f"batch with strides {t.stride()} is not dense {self.layout}")

    def view_bytes(self, flat: torch.Tensor, batch_size: int | None = None) -> Any:
        """View the first bytes of ``flat`` (uint8) as a logical ``[B, 3, H, W]`` batch.

        ``layout="nhwc"`` bytes become a channels_last tensor (same logical shape, NHWC
        strides), so consumers never see the wire layout except through the strides. A
        multi-view spec gives a list of tensors, one per view, over consecutive bytes.
        """
        b = self.batch_size if batch_size is None else batch_size
        if self.views:
            out, offset = [], 0
            for v in self.view_specs:
                n = images_nbytes((b, CHANNELS, v.height, v.width), self.dtype)
                out.append(v.view_bytes(flat[offset : offset + n], b))
                offset += n
            return out
        c, h, w = CHANNELS, self.height, self.width
        typed = flat[: images_nbytes((b, c, h, w), self.dtype)].view(self.torch_dtype)
        if self.layout == "nhwc":
            return typed.view(b, h, w, c).permute(0, 3, 1, 2)
        return typed.view(b, c, h, w)


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """A host batch's memory as a flat uint8 array, in its layout (no copy).

    NCHW-contiguous tensors are their own bytes; channels_last tensors are NHWC in memory, which
    is what the wire carries for ``layout="nhwc"``. Anything else is a bug upstream.
    """
    import torch

    if t.is_contiguous():
        dense = t
    elif t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last):
        dense = t.permute(0, 2, 3, 1)
    else:
        raise ValueError(f"batch tensor with strides {t.stride()} is neither NCHW nor NHWC dense")
    if dense.device.type != "cpu":
        raise ValueError(f"batch tensor must be in host memory to send, got {dense.device}")
    return dense.reshape(-1).view(torch.uint8).numpy()
