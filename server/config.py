"""`ServerConfig`: every setting of `pipeline-server`, from the CLI or a TOML file.

One dataclass means the CLI, the TOML loader and the server agree on names and defaults: a
TOML key is the option's name with dashes or underscores (``batch-size`` = ``batch_size``).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from batchwire.common.cores import available_cores
from batchwire.common.devices import check_device_spec
from batchwire.pipeline.augment_plan import AugmentConfig
from batchwire.pipeline.checksums import VERIFY_MODES
from batchwire.pipeline.decode.contract import DECODERS
from batchwire.pipeline.sources.mix import is_mix, parse_mix, parse_schedule
from batchwire.pipeline.storage.cache import parse_size
from batchwire.pipeline.storage.options import (
    DEFAULT_CONCURRENCY,
    DEFAULT_LISTING_TTL_S,
    StoreOptions,
)
from batchwire.pipeline.storage.urls import is_url
from batchwire.wire import MAX_PREFETCH, BatchSpec
from batchwire.wire.messages import MAX_BATCH_NBYTES

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

DEFAULT_BIND = "tcp://127.0.0.1:5555"
# The augmentation settings are AugmentConfig's fields under the same names, with its defaults,
# so the two cannot drift apart; `ServerConfig.augment` hands them over by name and
# AugmentConfig validates them (one validation, one message).
_AUGMENT = AugmentConfig(image_size=224, train=True)
_PER_SPLIT = ("image_size", "train", "transform")  # set per split, not copied by name


@dataclass
class ServerConfig:
    """What the server serves and how (defaults: torchvision's ImageNet training recipe)."""

    # A path or URL, or a mixture: `mix:NAME=WEIGHT@SOURCE,...` (TOML: a [train.mix] table;
    # pipeline/sources/mix.py), whose weights `mix_schedule` may change from an epoch on.
    train: str | dict[str, Any] | None = None
    val: str | dict[str, Any] | None = None
    mix_schedule: str | None = None
    bind: list[str] = field(default_factory=lambda: [DEFAULT_BIND])
    batch_size: int = 64
    # The largest batch size a client may ask for (`Hello.batch_size`: jobs of a sweep with
    # different batch sizes on one server); buffers are sized for it. None: --batch-size.
    max_batch_size: int | None = None
    # One int (square) or (height, width): `--image-size 224` or `--image-size 160,224`.
    image_size: int | tuple[int, int] = 224
    # The largest output size a client may ask for (progressive resizing: `Hello.image_size`),
    # PX or (height, width); buffers are sized for it. None: --image-size (no larger asks).
    max_image_size: int | tuple[int, int] | None = None
    seed: int = 0
    workers: int | None = None  # --workers; None: `decode_threads` decides
    # Three batches in production keep two cores busy across batch boundaries (the Python
    # between one batch's decode and augment overlaps the others' work): 3-4 % more images/s
    # than two on a 2-core machine (bench/RESULTS.md), one batch buffer more of memory.
    producers: int = 3
    # uint8 on the wire by default: 4x fewer bytes than float32, and what every docs snippet
    # and recipe expects (RemoteLoader(normalize_on_device=True) normalises on the device).
    # LocalLoader and AugmentConfig keep float32: they hand batches straight to a model.
    output_dtype: str = "uint8"
    layout: str = _AUGMENT.layout
    scale: tuple[float, float] = _AUGMENT.scale
    ratio: tuple[float, float] = _AUGMENT.ratio
    flip_prob: float = _AUGMENT.flip_prob
    brightness: float = _AUGMENT.brightness
    contrast: float = _AUGMENT.contrast
    saturation: float = _AUGMENT.saturation
    hue: float = _AUGMENT.hue
    mean: tuple[float, float, float] = _AUGMENT.mean
    std: tuple[float, float, float] = _AUGMENT.std
    val_crop_fraction: float = _AUGMENT.val_crop_fraction
    # Multi-view crops, the --views spelling ("2x224:0.4-1.0,6x96:0.05-0.4"; TOML: the same
    # string); None: one view of --image-size. AugmentConfig.views parses and checks it.
    views: str | None = None
    # The operator's own transforms (pipeline/transforms.py), "module:callable" or
    # "file.py:callable", instead of the fused op: `transform` for train, `val_transform` for
    # val (None: the built-in augmentation). They import and run code in this process.
    transform: str | None = None
    val_transform: str | None = None
    decoder: str = "auto"
    device: str = "cpu"
    max_pixels: int = 89_478_485
    prefetch_depth: int = 4
    # None: bufpool.default_max_buffers(producers, prefetch_depth) (8 clients at full depth).
    max_buffers: int | None = None
    # Batches kept after their last send so other sessions asking for the same batch are served
    # without producing it again (server/sharing.py), inside --max-buffers (at most a quarter);
    # None: sharing.DEFAULT_WINDOW; 0: no sharing at all (not even of batches in production).
    share_window: int | None = None
    max_clients: int = 256
    client_timeout: float = 60.0
    # A connection that has not completed the ZeroMQ handshake after this long is closed (a
    # bare TCP connection that sends nothing never does): ZMQ_HANDSHAKE_IVL.
    handshake_timeout: float = 10.0
    # A tcp:// connection whose sent data stays untaken this long is closed (TCP_USER_TIMEOUT).
    stall_timeout: float = 30.0
    # SIGTERM drains for at most this long (no new clients, what is in production is sent,
    # clients told to move on) before the usual stop; 0: stop at once, as SIGINT does. 5 s:
    # far more than a batch in production takes, and within Docker's 10 s stop grace.
    drain_timeout: float = 5.0
    metrics_port: int | None = None
    # A list file's or manifest's rows may leave its root (other folders, bucket URLs; read
    # with this server's credentials): pipeline/sources/manifest.py.
    allow_outside_root: bool = False
    # Check every file read against its checksum manifest (pipeline/checksums.py): "auto" when
    # one is found beside the data or in a checksum_dirs folder, "on" requires one, "off".
    verify_checksums: str = "auto"
    checksum_dirs: list[str] = field(default_factory=list)
    # Object stores (pipeline/storage): a bounded local cache of fetched objects (both or
    # neither; the size in bytes or "20G"), requests in flight per store, and how long a
    # bucket's cached listing is reused (seconds; 0: list at every start).
    cache_dir: str | None = None
    cache_size: int | str | None = None
    store_concurrency: int = DEFAULT_CONCURRENCY
    listing_ttl: float = DEFAULT_LISTING_TTL_S
    keys: str | None = None  # a `pipeline-keys` folder: CURVE on every endpoint
    insecure: bool = False  # accept a tcp bind beyond loopback without keys (logged)
    metrics_host: str = "127.0.0.1"
    log_level: str = "INFO"
    log_format: str = "text"  # "json": one JSON object per line (server/logformat.py)

    def __post_init__(self) -> None:
        self.validate()

    def augment(self, train: bool) -> AugmentConfig:
        """A split's augmentation: every AugmentConfig field this config has, by name."""
        shared = {
            f.name: getattr(self, f.name)
            for f in fields(AugmentConfig)
            if f.name in _FIELDS and f.name not in _PER_SPLIT
        }
        transform = self.transform if train else self.val_transform
        return AugmentConfig(image_size=self.image_hw, train=train, transform=transform, **shared)

    @property
    def image_hw(self) -> tuple[int, int]:
        """--image-size as (height, width)."""
        return _hw(self.image_size)

    @property
    def max_image_hw(self) -> tuple[int, int]:
        """--max-image-size as (height, width) (default: --image-size)."""
        return self.image_hw if self.max_image_size is None else _hw(self.max_image_size)

    @property
    def batch_size_cap(self) -> int:
        """--max-batch-size (default: --batch-size)."""
        return int(self.batch_size if self.max_batch_size is None else self.max_batch_size)

    def capacity_spec(self) -> BatchSpec:
        """The largest batch this server may send (what a batch buffer holds): the batch spec
        at --max-image-size and --max-batch-size (multi-view: the views' own)."""
        spec = self.batch_spec()
        most = self.batch_size_cap
        if spec.multi_view:
            return spec if most == spec.batch_size else self.augment(train=True).batch_spec(most)
        if self.max_image_hw == self.image_hw and most == spec.batch_size:
            return spec
        h, w = self.max_image_hw
        return BatchSpec(most, h, w, spec.dtype, spec.layout)

    def store_options(self) -> StoreOptions:
        """How object stores are read (`pipeline.storage.StoreOptions`), from the flags."""
        size = self.cache_size
        try:
            size = parse_size(size) if size is not None else None
        except ValueError as exc:
            raise ValueError(f"--cache-size: {exc}") from None
        return StoreOptions(
            concurrency=int(self.store_concurrency),
            cache_dir=None if self.cache_dir is None else str(Path(self.cache_dir).expanduser()),
            cache_size=size,
            listing_ttl_s=float(self.listing_ttl),
        )

    def decode_threads(self) -> int:
        """Threads of the decoder's own pool: --workers where given. By default the cores,
        except for CPU decoding with at least as many producers as cores: 1 (no pool), each
        producer decoding its own batch. There the pool adds no parallelism, only hand-offs
        between threads: without it 4 % more images/s on 2 cores (bench/RESULTS.md)."""
        if self.workers is not None:
            return int(self.workers)
        cores = available_cores()
        cpu_decoding = self.device == "cpu" and self.decoder in ("auto", "cpu")
        return 1 if cpu_decoding and self.producers >= cores else cores

    @property
    def buffer_cap(self) -> int:
        """--max-buffers, or its default for these producers and this depth."""
        if self.max_buffers is not None:
            return int(self.max_buffers)
        from batchwire.server.bufpool import default_max_buffers

        return default_max_buffers(self.producers, self.prefetch_depth)

    def batch_spec(self) -> BatchSpec:
        """What every batch the server sends is (the same for all splits)."""
        return self.augment(train=True).batch_spec(self.batch_size)

    def validate(self) -> None:
        """Reject impossible settings with a message naming the option."""
        problems = []
        if not self.bind:
            problems.append("--bind needs at least one endpoint")
        for ep in self.bind:
            if "://" not in ep:
                problems.append(
                    f"--bind {ep!r} is not a ZeroMQ endpoint (tcp://host:port, ipc://path)"
                )
        if int(self.seed) < 0:
            problems.append(f"--seed must be >= 0, got {self.seed}")
        size = self.image_size
        if isinstance(size, (tuple, list)) and (
            len(size) != 2 or any(isinstance(v, bool) or not isinstance(v, int) for v in size)
        ):
            problems.append(f"--image-size must be PX or H,W integers, got {size!r}")
        elif min(self.image_hw) < 1:
            problems.append(f"--image-size must be >= 1, got {size!r}")
        most = self.max_image_size
        if most is not None:
            if isinstance(most, (tuple, list)) and (
                len(most) != 2 or any(isinstance(v, bool) or not isinstance(v, int) for v in most)
            ):
                problems.append(f"--max-image-size must be PX or H,W integers, got {most!r}")
            elif self.views:
                problems.append(
                    "--max-image-size does not go with --views (the views fix their sizes)"
                )
            elif any(m < s for m, s in zip(self.max_image_hw, self.image_hw, strict=True)):
                problems.append(
                    f"--max-image-size {most!r} must be at least --image-size {size!r} "
                    "in height and width"
                )
        if self.max_batch_size is not None and int(self.max_batch_size) < int(self.batch_size):
            problems.append(
                f"--max-batch-size {self.max_batch_size} must be at least --batch-size "
                f"{self.batch_size}"
            )
        for name in ("batch_size", "workers", "producers", "prefetch_depth"):
            if getattr(self, name) is not None and int(getattr(self, name)) < 1:
                flag = "--" + name.replace("_", "-")
                problems.append(f"{flag} must be >= 1, got {getattr(self, name)}")
        if self.prefetch_depth > MAX_PREFETCH:
            problems.append(f"--prefetch-depth must be <= {MAX_PREFETCH}")
        problems.extend(self._mix_problems())
        # A transform for a split the server does not serve would be ignored, unsaid.
        if self.val_transform is not None and self.val is None and self.train is not None:
            problems.append("--val-transform needs --val: this server serves no val split")
        if self.verify_checksums not in VERIFY_MODES:
            problems.append(
                f"--verify-checksums must be one of {list(VERIFY_MODES)}, "
                f"got {self.verify_checksums!r}"
            )
        if self.decoder not in DECODERS:
            problems.append(f"--decoder must be one of {list(DECODERS)}, got {self.decoder!r}")
        try:
            check_device_spec(self.device)
        except ValueError:
            problems.append(f"--device must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.client_timeout <= 0:
            problems.append("--client-timeout must be > 0")
        if not self.handshake_timeout > 0:
            problems.append("--handshake-timeout must be > 0")
        if not self.stall_timeout > 0:
            problems.append("--stall-timeout must be > 0")
        if not 0 <= self.drain_timeout <= 3600:
            problems.append(f"--drain-timeout must be 0 to 3600 s, got {self.drain_timeout}")
        if self.share_window is not None and int(self.share_window) < 0:
            problems.append(f"--share-window must be >= 0, got {self.share_window}")
        if self.max_buffers is not None and int(self.max_buffers) < 1:
            problems.append(f"--max-buffers must be >= 1, got {self.max_buffers}")
        if int(self.max_clients) < 1:
            problems.append(f"--max-clients must be >= 1, got {self.max_clients}")
        if self.log_format not in ("text", "json"):
            problems.append(f"--log-format must be text or json, got {self.log_format!r}")
        try:
            self.store_options()
        except ValueError as exc:
            problems.append(str(exc))
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            problems.append(f"--metrics-port must be a TCP port, got {self.metrics_port}")
        if not problems:
            try:  # the augmentation and output settings, checked where they are defined
                self.batch_spec()
                problems.extend(self._batch_bound_problems())
            except ValueError as exc:
                problems.append(str(exc))
        if problems:
            raise ValueError("; ".join(problems))

    def _batch_bound_problems(self) -> list[str]:
        """The largest batch past what every client accepts (`wire.MAX_BATCH_NBYTES`): each
        trainer's welcome would be refused, so the start says so instead."""
        largest = self.capacity_spec()
        if largest.nbytes <= MAX_BATCH_NBYTES:
            return []
        return [
            f"the largest batch ({largest.batch_size} images of {largest.height}x{largest.width}, "
            f"{self.output_dtype}: {largest.nbytes / 2**30:.1f} GiB) is over the "
            f"{MAX_BATCH_NBYTES >> 30} GiB a client accepts: lower --batch-size, "
            "--max-batch-size, --image-size or --max-image-size, or use --output-dtype uint8"
        ]

    def _mix_problems(self) -> list[str]:
        """What is wrong with the --train/--val mixes and --mix-schedule (pipeline.sources.mix)."""
        problems = []
        for flag, value in (("--train", self.train), ("--val", self.val)):
            if isinstance(value, dict) and not is_mix(value):
                problems.append(f"{flag}: a table must be a mix ([train.mix])")
            elif is_mix(value):
                try:
                    parse_mix(value, flag)  # type: ignore[arg-type]
                except ValueError as exc:
                    problems.append(str(exc))
        if self.mix_schedule is not None:
            if not is_mix(self.train):
                problems.append("--mix-schedule needs a --train mix (mix:NAME=WEIGHT@SOURCE,...)")
            else:
                try:
                    parse_schedule(self.mix_schedule, parse_mix(self.train))  # type: ignore[arg-type]
                except ValueError as exc:
                    problems.append(str(exc))
        return problems


_FIELDS = {f.name: f for f in fields(ServerConfig)}


def _hw(size: Any) -> tuple[int, int]:
    if isinstance(size, (tuple, list)):
        return (int(size[0]), int(size[1]))
    return (int(size), int(size))


def _keeps_text(value: str) -> bool:
    """A URL or mix is kept as written (a mix expands its parts' paths itself)."""
    return is_url(value) or is_mix(value)


# The TOML value types a setting's annotation admits (None aside); other annotations (tuples,
# lists, mappings) are left to `ServerConfig.validate`.
_TOML_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "float": (int, float),
    "bool": (bool,),
    "str": (str,),
}


def _check_toml_type(path: str | os.PathLike[str], key: str, value: Any) -> Any:
    """``value``, checked: a setting of the wrong type is an error naming the file and the key,
    as argparse names the option, rather than whatever Python says deep inside the checks. A
    whole float for an integer setting (max-pixels = 1e9) is that integer, as it always was."""
    kinds = [k.strip() for k in str(_FIELDS[key.replace("-", "_")].type).split("|")]
    kinds = [k for k in kinds if k != "None"]
    if not all(k in _TOML_TYPES for k in kinds):
        return value
    if "int" in kinds and "float" not in kinds and isinstance(value, float) and value.is_integer():
        return int(value)
    accepted = tuple(t for k in kinds for t in _TOML_TYPES[k])
    if not isinstance(value, accepted) or (isinstance(value, bool) and "bool" not in kinds):
        raise ValueError(f"{path}: {key} = {value!r}: expected {' or '.join(kinds)}")
    return value


def config_from_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a TOML file of server settings into ``{field: value}``; unknown keys are an error."""
    with open(path, "rb") as fh:
        try:
            raw = tomllib.load(fh)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{path}: not valid TOML: {exc}") from None
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in _FIELDS:
            raise ValueError(f"{path}: unknown setting {key!r}; known: {sorted(_FIELDS)}")
        value = _check_toml_type(path, key, value)
        if name in ("bind", "checksum_dirs") and isinstance(value, str):
            value = [value]
        if name in ("scale", "ratio", "mean", "std") and isinstance(value, list):
            value = tuple(float(v) for v in value)
        if name in ("image_size", "max_image_size") and isinstance(value, list):
            value = tuple(value)
        if name in ("train", "val") and isinstance(value, str) and not _keeps_text(value):
            value = str(Path(value).expanduser())
        out[name] = value
    return out
