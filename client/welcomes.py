"""A server's welcome against what the loader asked for and what its first server said.

All servers of one loader must serve the same batches (the same data and options), and each
must serve what the hello asked for: an older server ignores ``batch_size``/``image_size`` in
the hello and would stream batches the trainer did not ask for, silently. `check` raises
`ProtocolError` naming the server and each field that differs. Pure: no I/O.
"""

from __future__ import annotations

from batchwire import wire
from batchwire.client.errors import ProtocolError


def check(
    endpoint: str,
    w: wire.Welcome,
    first: wire.Welcome | None,
    *,
    batch_size: int | None,
    image_size: tuple[int, int] | None,
) -> None:
    """Refuse ``w`` (from ``endpoint``) unless it serves the ``batch_size`` and ``image_size``
    asked for (None: any) and, if a ``first`` welcome came before, batches like its."""
    asked = unlike_the_ask(w, batch_size, image_size)
    if asked:
        raise ProtocolError(
            f"pipeline-server at {endpoint} welcomed {asked}: an older server ignores "
            "batch_size/image_size in the hello; upgrade it, or leave them unset"
        )
    differs = "" if first is None else differences(w, first)
    if differs:
        raise ProtocolError(
            f"pipeline-server at {endpoint} serves batches unlike the first server "
            f"it talked to: {differs}; all servers of one loader must be "
            "started with the same data and options"
        )


def unlike_the_ask(
    w: wire.Welcome, batch_size: int | None, image_size: tuple[int, int] | None
) -> str:
    """How ``w`` differs from the batch size and image size the hello asked for ("" if it
    does not)."""
    if batch_size is not None and w.shape[0] != batch_size:
        return f"batches of {w.shape[0]} where {batch_size} were asked for"
    if image_size is not None and tuple(w.shape[2:]) != tuple(image_size):
        h, w_ = image_size
        return f"{w.shape[2]}x{w.shape[3]} px batches where {h}x{w_} were asked for"
    return ""


def _key(w: wire.Welcome) -> dict[str, object]:
    """What must match across a loader's servers, by welcome field: batches differing in any
    of it would mix (``mix_fingerprint``: two mixes of equal counts still draw differently)."""
    return {
        "num_batches": w.num_batches,
        "num_samples": w.num_samples,
        "shape": tuple(w.shape),
        "dtype": w.dtype,
        "layout": w.layout,
        "num_classes": w.num_classes,
        "classes": tuple(w.classes),
        "views": tuple(map(tuple, w.views)),
        "label_width": w.label_width,
        "mix_fingerprint": w.mix_fingerprint,
    }


def differences(theirs: wire.Welcome, mine: wire.Welcome) -> str:
    """The fields of `_key` in which ``theirs`` differs from ``mine``, each as
    "NAME X vs Y"; "" when none does."""
    a, b = _key(theirs), _key(mine)
    return ", ".join(
        f"{name} {_shown(name, a[name])} vs {_shown(name, b[name])}"
        for name in a
        if a[name] != b[name]
    )


def _shown(name: str, value: object) -> str:
    """A welcome field's value for a mismatch message (a class list, maybe long, by count)."""
    if name == "classes":
        return f"[{len(value)} names]"  # type: ignore[arg-type]
    if name == "mix_fingerprint":
        return str(value) or "(not a mix)"
    return str(value)
