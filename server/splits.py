"""Setup of what the server serves: datasets, augmentation configs, decoder and producers."""

from __future__ import annotations

import logging
from typing import Any

from batchwire.pipeline.dataset import ImageDataset, open_dataset
from batchwire.pipeline.decode.contract import BatchDecoder
from batchwire.pipeline.decode.restart import restart_share
from batchwire.pipeline.decode.select import make_decoder as select_decoder
from batchwire.pipeline.sources.metadata import MetadataError, check_batch_metadata
from batchwire.pipeline.sources.mix import MixDataset, is_mix, open_mix, parse_mix
from batchwire.pipeline.split import Split, build_split
from batchwire.pipeline.storage import redact_url, set_default_options
from batchwire.server.config import ServerConfig

log = logging.getLogger("batchwire.server")


class StartupError(RuntimeError):
    """The server cannot start as configured; the message says why and what to change."""


def data_roots(config: ServerConfig) -> dict[str, Any]:
    """split -> path (or a mix: its `mix:` text or TOML table); the embedded dataset when no
    --train is given."""
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


def make_decoder(config: ServerConfig) -> BatchDecoder:
    """The `--decoder` on `--device`, through the decoder selector (it logs why it chose)."""
    try:
        return select_decoder(
            config.decoder, config.device, config.decode_threads(), max_batch=config.batch_size
        )
    except (RuntimeError, ValueError) as exc:
        raise StartupError(
            f"cannot use --decoder {config.decoder} on --device {config.device}: {exc}"
        ) from None


_NAMES_SHOWN = 10


def _names(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_NAMES_SHOWN])
    more = len(names) - _NAMES_SHOWN
    return f"[{shown}{f', ... {more} more' if more > 0 else ''}]"


def _ids_only(dataset: ImageDataset) -> bool:
    """True when the dataset's class names are just its label ids, "0" to "N-1"."""
    return dataset.kind == "list" or dataset.classes == [str(i) for i in range(dataset.num_classes)]


def class_mismatch(train: ImageDataset, val: ImageDataset) -> str | None:
    """Why ``val``'s labels would not mean ``train``'s classes, or None when they do.

    Label ids index the class list, so two named class lists (ImageFolders, manifests or shards
    labelled by names) must have the same names in the same order. Where a split's classes are
    only its label ids ("0".."N-1": a list file, or any source with integer labels), every val
    label must be a class of train's (a val split may lack images of some classes).
    """
    if _ids_only(train) or _ids_only(val):
        if val.num_classes > train.num_classes:
            return (
                f"val has label ids up to {val.num_classes - 1}, train has "
                f"{train.num_classes} classes (ids 0 to {train.num_classes - 1})"
            )
        return None
    if train.classes == val.classes:
        return None
    val_set, train_set = set(val.classes), set(train.classes)
    missing = [c for c in train.classes if c not in val_set]
    extra = [c for c in val.classes if c not in train_set]
    parts = []
    if missing:
        parts.append(f"missing in val: {_names(missing)}")
    if extra:
        parts.append(f"extra in val: {_names(extra)}")
    if not parts:
        pairs = zip(train.classes, val.classes, strict=True)
        i = next(i for i, (a, b) in enumerate(pairs) if a != b)
        parts.append(
            f"same names in another order: class {i} is {train.classes[i]!r} in train, "
            f"{val.classes[i]!r} in val"
        )
    return f"{'; '.join(parts)}; train has {train.num_classes} classes, val {val.num_classes}"


def open_splits(config: ServerConfig, decoder: Any) -> dict[str, Split]:
    """Open every split's dataset and build its producer; StartupError on unusable data."""
    splits: dict[str, Split] = {}
    set_default_options(config.store_options())  # every store opened below reads with them
    for name, given in data_roots(config).items():
        try:
            dataset = _open_split_data(config, name, given)
        except (OSError, ValueError) as exc:
            shown = "mix" if is_mix(given) else redact_url(given)
            raise StartupError(f"--{name} {shown}: {exc}") from None
        # What logs and errors show: never a credential.
        root = str(dataset.root) if is_mix(given) else redact_url(given)
        if name != "train" and "train" in splits:
            problem = class_mismatch(splits["train"].dataset, dataset)
            if problem is not None:
                raise StartupError(
                    f"--{name} {root}: its classes are not --train's ({problem}); the label ids "
                    f"would name other classes than the model learnt. Give --{name} the same "
                    "class folders as --train"
                )
        if dataset.metadata is not None:  # any batch must carry its samples' metadata
            largest = max(int(config.batch_size), int(getattr(config, "max_batch_size", 0) or 0))
            try:
                if isinstance(dataset, MixDataset):
                    dataset.check_metadata(largest, root)
                else:
                    check_batch_metadata(dataset.metadata, largest, root)
            except MetadataError as exc:
                raise StartupError(f"--{name} {exc}") from None
        augment = config.augment(train=(name == "train"))
        try:
            split = build_split(
                name, dataset, augment, config.seed, decoder, max_pixels=config.max_pixels
            )
        except ValueError as exc:  # e.g. UnreadableDatasetError from the probe
            raise StartupError(f"--{name} {root}: {exc}") from None
        log.info("%s: %d images, %d classes from %s", name, len(dataset), dataset.num_classes, root)
        if config.train is not None:  # the embedded demo dataset has no manifest to write
            for part, part_root in _checked_parts(dataset, root):
                unchecked = checksum_warning(name, part, part_root, config.verify_checksums)
                if unchecked is not None:
                    log.warning("%s", unchecked)
        samples = split.samples_per_epoch
        small = batch_size_warning(
            name, samples, split.train, int(config.batch_size), int(config.batch_size_cap)
        )
        if small is not None:
            log.warning("%s", small)
        _log_restart_share(name, dataset, decoder)
        splits[name] = split
    return splits


def _open_split_data(config: ServerConfig, name: str, given: Any) -> ImageDataset:
    """A split's dataset: one source (`open_dataset`), or a mix of several, each part opened
    the same way (its own checksum manifest), ordered by `--mix-schedule` (train only)."""

    def open_one(source: str) -> ImageDataset:
        return open_dataset(
            source,
            allow_outside_root=config.allow_outside_root,
            verify_checksums=config.verify_checksums,
            checksum_dirs=config.checksum_dirs,
        )

    if not is_mix(given):
        return open_one(given)
    spec = parse_mix(given)
    train = name == "train"
    dataset = open_mix(spec, open_one, train=train, schedule=config.mix_schedule if train else None)
    for part_name, part in zip(dataset.names, dataset.parts, strict=True):
        log.info(
            "%s: mix part %s: %d images, %d classes from %s",
            name,
            part_name,
            len(part),
            part.num_classes,
            redact_url(str(part.root)),
        )
    return dataset


def _checked_parts(dataset: ImageDataset, root: str) -> list[tuple[ImageDataset, str]]:
    """The datasets whose checksum manifests a split reads, each with the root to show: a
    mix's parts, else the dataset itself."""
    if isinstance(dataset, MixDataset):
        return [(part, redact_url(str(part.root))) for part in dataset.parts]
    return [(dataset, root)]


def checksum_warning(name: str, dataset: ImageDataset, root: str, verify: str) -> str | None:
    """What serving ``dataset`` without a checksum manifest risks, and the command that writes
    one; None when it has one, or checks are off (`--verify-checksums off`: a choice)."""
    if verify == "off" or dataset.checksums is not None:
        return None
    return (
        f"{name}: no checksum manifest for {root}: a damaged image that still decodes (a byte "
        "changed in a JPEG's entropy-coded data or Huffman table) is served as wrong pixels, "
        "unseen (22 of 100 such damaged samples in a test; with checksums all 300 were "
        f"caught). Write one with `pipeline-prepare --checksums-only {root}` (once; the "
        "server checks every read against it)"
    )


def batch_size_warning(
    name: str, num_samples: int, train: bool, batch_size: int, most: int
) -> str | None:
    """Why the split cannot serve the server's batch size (`--batch-size`), or clients' asks up
    to `--max-batch-size` (``most``), as the loaders would learn only when they ask; None when
    a batch of ``most`` fits. Train epochs drop an incomplete last batch (`Split.sampler`): a
    batch larger than the split leaves none, and the hello is refused. Val batches are padded:
    a larger one is served, mostly padding. At world size 1: each rank more takes a batch more."""
    if max(batch_size, most) <= num_samples:
        return None
    if train:
        if batch_size > num_samples:
            return (
                f"{name} has {num_samples} samples, fewer than one batch of {batch_size} "
                "(--batch-size): a train epoch drops its incomplete last batch, so it has none "
                "and every loader asking for this split at that size is refused; lower "
                "--batch-size (batch size x ranks must fit in the split)"
            )
        return (
            f"{name} has {num_samples} samples: a loader asking for a batch size above "
            f"{num_samples} (--max-batch-size allows up to {most}) is refused, since a train "
            "epoch drops its incomplete last batch"
        )
    size = batch_size if batch_size > num_samples else most
    flag = "--batch-size" if batch_size > num_samples else "--max-batch-size"
    return (
        f"{name} has {num_samples} samples, fewer than one batch of {size} ({flag}): its "
        f"batches are padded ({size - num_samples} of {size} slots at world size 1, label -100)"
    )


def _log_restart_share(name: str, dataset: ImageDataset, decoder: BatchDecoder) -> None:
    """Say whether the split's JPEGs were `pipeline-prepare`d (crops then decode from their
    restart intervals), and on the CPU decoder, what preparing would gain where they were not."""
    entered, looked = restart_share(dataset.paths)
    if looked == 0:
        return
    if entered:
        log.info(
            "%s: %d of %d sampled JPEGs have restart markers: their crops decode from the "
            "restart intervals under them (pipeline-prepare)",
            name,
            entered,
            looked,
        )
    elif decoder.name == "cpu":
        log.info(
            "%s: no sampled JPEG has restart markers; `pipeline-prepare SRC DST` rewrites a "
            "dataset losslessly so that random crops of photos decode about 1.4x cheaper on "
            "the CPU",
            name,
        )
