"""The images a benchmark reads: `--data` (and `pipeline-bench --prepared`) resolved to files.

A path is an ImageFolder tree, a list file, or a flat folder of images (served as one class
through a list file written to the cache folder, since `pipeline-server --train` takes only
the first two). A prepared copy (`pipeline-prepare SRC DST`: the same JPEGs rewritten with
restart markers) is only comparable with its original if it holds the same images under the
same names in the same order, so `check_prepared` refuses anything else before a row runs.
"""

from __future__ import annotations

import argparse
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

#: The sample images beside this checkout (../shared/imagenet-sample): every bench's default data.
DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "imagenet-sample"

#: What `BenchData.kind` says, as a person would name it in an error.
KIND_NAMES = {"tree": "an ImageFolder tree", "list": "a list file", "flat": "a flat folder"}


@dataclass(frozen=True)
class BenchData:
    """The image files, their labels, and what to pass to `pipeline-server --train`.

    ``kind`` is "tree", "list" or "flat"; ``root`` is the folder the images' relative names
    start from (the tree or flat folder itself, a list file's folder), so that a prepared copy
    elsewhere can be matched name for name.
    """

    shown: str
    paths: list[str]
    labels: np.ndarray
    server_train: str
    kind: str
    root: str

    def relative_names(self) -> list[str]:
        """Each image's path below `root`, in dataset order."""
        return [os.path.relpath(p, self.root) for p in self.paths]


def server_bench_parser(
    module: str, doc: str | None, *, batch_size: int, image_size: int
) -> argparse.ArgumentParser:
    """The command line a bench that starts servers begins with (`python -m
    batchwire.bench.MODULE`, its doc's first paragraph): `--data` (the sample images where they
    are here, else required by `resolve_data`), `--batch-size` and `--image-size`."""
    p = argparse.ArgumentParser(
        prog=f"python -m batchwire.bench.{module}", description=(doc or "").split("\n\n")[0]
    )
    default = str(DEFAULT_DATA) if DEFAULT_DATA.is_dir() else None
    p.add_argument("--data", default=default, help="images (default: ../shared/imagenet-sample)")
    p.add_argument("--batch-size", type=int, default=batch_size)
    p.add_argument("--image-size", type=int, default=image_size)
    return p


def resolve_data(path: str | None, option: str = "--data") -> BenchData:
    """Open `path` as an ImageFolder or list file; a flat folder of images becomes one class.
    `option` names the path in errors."""
    from batchwire.pipeline.dataset import open_dataset
    from batchwire.pipeline.synthetic import default_dataset

    target = Path(path).expanduser().resolve() if path else default_dataset().train_root
    if not target.exists():
        raise SystemExit(f"pipeline-bench: {option} {target} does not exist")
    has_class_dirs = target.is_dir() and any(p.is_dir() for p in target.iterdir())
    if target.is_file() or has_class_dirs:
        ds = open_dataset(target)
        kind, root = ("list", target.parent) if target.is_file() else ("tree", target)
        return BenchData(
            str(target), list(ds.paths), np.asarray(ds.labels), str(target), kind, str(root)
        )
    list_file = _flat_list_file(target)
    ds = open_dataset(list_file, allow_outside_root=True)  # our own list, naming the images
    return BenchData(
        str(target), list(ds.paths), np.asarray(ds.labels), str(list_file), "flat", str(target)
    )


def _flat_list_file(folder: Path) -> Path:
    """A cached list file naming `folder`'s images (label 0), keyed by the names it holds."""
    from batchwire.pipeline.dataset import IMAGE_EXTENSIONS
    from batchwire.pipeline.paths import cache_dir

    files = sorted(
        str(p) for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS
    )
    if not files:
        raise SystemExit(f"pipeline-bench: no image files in {folder}")
    digest = hashlib.sha256("\n".join(files).encode()).hexdigest()[:16]
    list_file = cache_dir() / "bench" / f"flat-{digest}.txt"
    if not list_file.exists():
        list_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = list_file.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text("".join(f"{f} 0\n" for f in files))
        tmp.replace(list_file)
    return list_file


def check_prepared(original: BenchData, prepared: BenchData) -> None:
    """Refuse (SystemExit saying how they differ) a `--prepared` copy that is not `original`
    image for image: its rows would compare different work, not a different file layout."""
    why = _difference(original, prepared)
    if why is not None:
        raise SystemExit(
            f"pipeline-bench: --prepared {prepared.shown} is not a prepared copy of --data "
            f"{original.shown}: {why} (make one with: pipeline-prepare {original.shown} "
            f"{prepared.shown})"
        )


def _difference(original: BenchData, prepared: BenchData) -> str | None:
    """How `prepared` differs from `original` in kind, count, names, order or labels."""
    if original.kind != prepared.kind:
        return f"--data is {KIND_NAMES[original.kind]}, --prepared {KIND_NAMES[prepared.kind]}"
    if len(original.paths) != len(prepared.paths):
        return f"{len(prepared.paths)} images, --data has {len(original.paths)}"
    names, copies = original.relative_names(), prepared.relative_names()
    if names != copies:
        missing = sorted(set(names) - set(copies))
        if not missing:
            return "the same names in a different order"
        shown = ", ".join(repr(n) for n in missing[:3])
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        return f"it lacks {shown}{more}"
    if not np.array_equal(original.labels, prepared.labels):
        return "the same names with different labels"
    return None
