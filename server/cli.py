"""`pipeline-server`: the command line (and TOML config) front of the batch server."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from batchwire.common.cores import available_cores
from batchwire.pipeline.augment_plan import parse_views
from batchwire.server.config import (
    DECODERS,
    DEFAULT_BIND,
    VERIFY_MODES,
    ServerConfig,
    config_from_toml,
)
from batchwire.server.logformat import LOG_FORMATS, formatter
from batchwire.wire import DTYPES, LAYOUTS, PROTOCOL_VERSION
from batchwire.wire.cli import ArgumentParser
from batchwire.wire.version import add_version_argument

log = logging.getLogger("batchwire.server")

_D = ServerConfig(workers=1)  # defaults for the help text (workers shown separately)


def _numbers(form: str) -> Callable[[str], tuple[float, ...]]:
    """An argparse type for as many numbers as `form` names ('LO,HI', 'R,G,B'), split at commas
    or spaces; the error names `form`."""
    count = len(form.split(","))

    def parse(text: str) -> tuple[float, ...]:
        parts = text.replace(",", " ").split()
        if len(parts) != count:
            raise argparse.ArgumentTypeError(f"expected {count} numbers {form!r}, got {text!r}")
        try:
            return tuple(float(v) for v in parts)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected numbers {form!r}, got {text!r}") from None

    return parse


_PAIR = _numbers("LO,HI")
_RGB = _numbers("R,G,B")


def _image_size(text: str) -> int | tuple[int, int]:
    """--image-size: PX (square) or H,W."""
    parts = text.replace(",", " ").split()
    try:
        sizes = [int(v) for v in parts]
    except ValueError:
        sizes = []
    if len(sizes) == 1:
        return sizes[0]
    if len(sizes) == 2:
        return (sizes[0], sizes[1])
    raise argparse.ArgumentTypeError(f"expected PX or H,W integers, got {text!r}")


def _views(text: str) -> str:
    """--views: checked here (a clear usage error, exit 2), kept as spelled."""
    try:
        parse_views(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("views: ")) from None
    return text


def build_parser() -> argparse.ArgumentParser:
    """All options default to 'not given', so a TOML file's values apply unless overridden."""
    p = ArgumentParser(
        prog="pipeline-server",
        description=(
            "Decode and augment images into batches and stream them to training processes "
            f"(RemoteLoader) over ZeroMQ, wire protocol v{PROTOCOL_VERSION}. Without --train, "
            "serves the embedded synthetic dataset (train and val, generated on first use)."
        ),
        argument_default=argparse.SUPPRESS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "Every option can also be set in a TOML file (--config) under the same name, with "
            'dashes or underscores (batch-size = 64, bind = ["tcp://*:5555"]); command-line '
            "options win. SIGTERM drains (batches in production are finished and sent) for at "
            "most --drain-timeout, then stops; SIGINT, a second SIGTERM or --drain-timeout 0 "
            "stops at once. Either way connected clients are told and the exit code is 0, the "
            "stop itself within 2 s even with producers stuck in a slow read."
        ),
    )
    add_version_argument(p)
    data = p.add_argument_group("data")
    data.add_argument(
        "--train",
        metavar="PATH",
        help="training split: an ImageFolder root or a list file, local or in a bucket "
        "(s3://bucket/prefix, s3://bucket/prefix/train.txt), or a mixture of sources by weight: "
        "mix:NAME=WEIGHT@SOURCE,NAME=WEIGHT@SOURCE (VALUE may be repeat:R or choose:N instead "
        "of a weight; ';labels=separate' keeps each part's label ids) "
        "(default: the embedded dataset's train split)",
    )
    data.add_argument(
        "--val",
        metavar="PATH",
        help="validation split, or a mix: (each part's samples once, weights ignored) "
        "(default: the embedded dataset's val split when --train is not given, else none)",
    )
    data.add_argument(
        "--mix-schedule",
        metavar="EPOCH:NAME=W,...[;EPOCH:...]",
        help="change a --train mix's weights from an epoch on (e.g. '5:web=0.5,curated=0.5'; "
        "a part not named keeps its weight); applies at that epoch's start, so runs resume "
        "exactly across it",
    )
    data.add_argument(
        "--allow-outside-root",
        action="store_true",
        default=argparse.SUPPRESS,  # absent: the TOML file's setting, else the default
        help="let a list file or manifest name samples outside its own root (absolute paths, "
        "'..', a bucket URL in a local manifest, another bucket or prefix in a bucket "
        "manifest); refused by default: a manifest may come from elsewhere, and its rows would "
        "be read with this server's credentials",
    )
    data.add_argument(
        "--verify-checksums",
        choices=VERIFY_MODES,
        help="check every file read against the checksum manifest pipeline-prepare wrote (in "
        "a prepared DST, or by --checksums-only): a mismatch is a bad file, replaced. auto: "
        f"when one is found (default: {_D.verify_checksums})",
    )
    data.add_argument(
        "--checksum-dir",
        dest="checksum_dirs",
        action="append",
        metavar="DIR",
        help="also look for checksum manifests here (pipeline-prepare --checksums-only "
        "--manifest-dir DIR); repeatable",
    )
    store = p.add_argument_group(
        "object storage (--train/--val s3://, gs://, az://; credentials and endpoint from the "
        "environment: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL...)"
    )
    store.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="keep objects fetched from the store in DIR, so later epochs read them from local "
        "disk (least recently used evicted past --cache-size; safe against a crash)",
    )
    store.add_argument(
        "--cache-size",
        metavar="BYTES",
        help="bound of --cache-dir: bytes, or with K, M, G, T (e.g. 200G)",
    )
    store.add_argument(
        "--store-concurrency",
        type=int,
        metavar="N",
        help="object-store requests in flight per store: a batch's samples are read together "
        f"(default: {_D.store_concurrency})",
    )
    store.add_argument(
        "--listing-ttl",
        type=float,
        metavar="SECONDS",
        help="reuse a bucket prefix's cached listing for this long; 0 lists it at every start "
        f"(default: {_D.listing_ttl:g})",
    )
    data.add_argument("--config", metavar="FILE.toml", help="read settings from a TOML file")
    sec = p.add_argument_group("security")
    sec.add_argument(
        "--keys",
        metavar="DIR",
        help="a keys folder made by `pipeline-keys`: only holders of its client key are "
        "served, everything is encrypted (CURVE)",
    )
    sec.add_argument(
        "--insecure",
        action="store_true",
        default=argparse.SUPPRESS,
        help="allow a tcp bind beyond loopback without --keys (anyone who reaches the port "
        "can read the dataset); logged at every start",
    )
    sec.add_argument(
        "--metrics-host",
        metavar="HOST",
        help="address the Prometheus port listens on (default: 127.0.0.1)",
    )

    net = p.add_argument_group("network")
    net.add_argument(
        "--bind",
        action="append",
        metavar="ENDPOINT",
        help=f"ZeroMQ endpoint to listen on, repeatable; tcp:// or ipc:// "
        f"(default: {DEFAULT_BIND})",
    )
    net.add_argument(
        "--prefetch-depth",
        type=int,
        metavar="N",
        help="batches the server produces ahead for each client, at most; bounds "
        f"memory per client (default: {_D.prefetch_depth})",
    )
    net.add_argument(
        "--max-clients",
        type=int,
        metavar="N",
        help="streams served at once; a hello from one more client is refused with an error "
        f"naming this limit (default: {_D.max_clients})",
    )
    net.add_argument(
        "--max-buffers",
        type=int,
        metavar="N",
        help="batch buffers in all, shared by every client: a hard bound of the batches' "
        "memory (N x batch bytes, said at start); when all are held producers wait, each "
        "client keeps its share and a client holding none still gets one (default: "
        "2 x producers + 16 x prefetch-depth, 8 clients at full work-ahead)",
    )
    net.add_argument(
        "--share-window",
        type=int,
        metavar="N",
        help="batches kept after they were sent, so jobs of a sweep asking for the same batch "
        "(same split, epoch and global batch) get the same buffer without producing it again; "
        "inside --max-buffers (at most a quarter of it, idle ones freed first when buffers are "
        "short); 0 turns sharing off (default: 16)",
    )
    net.add_argument(
        "--handshake-timeout",
        type=float,
        metavar="SECONDS",
        help="close a connection that has not completed the ZeroMQ handshake after this "
        "long (a TCP connection that sends nothing), so idle connections cannot use up file "
        f"descriptors (default: {_D.handshake_timeout:g})",
    )
    net.add_argument(
        "--stall-timeout",
        type=float,
        metavar="SECONDS",
        help="close a tcp:// client's connection when data sent to it stays untaken this long "
        "(a stopped process, a peer that never reads, a host gone mid-batch), freeing the "
        "buffers ZeroMQ holds for it; a RemoteLoader always takes what it asked for "
        f"(default: {_D.stall_timeout:g})",
    )
    net.add_argument(
        "--client-timeout",
        type=float,
        metavar="SECONDS",
        help="drop a client that sent nothing (no credit, no hello) for this long; a client "
        "whose connection closes (process killed) or that answers no heartbeat for 3 s "
        f"(host gone) is dropped at once (default: {_D.client_timeout:g})",
    )
    net.add_argument(
        "--drain-timeout",
        type=float,
        metavar="SECONDS",
        help="on SIGTERM, drain for at most this long before stopping: refuse new clients, "
        "send the batches already in production, tell each client to take the rest to the "
        "other servers, and answer /readyz with 503; SIGINT, or a second SIGTERM, stops at once; "
        f"0: stop at once (default: {_D.drain_timeout:g})",
    )
    net.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve Prometheus metrics on http://HOST:PORT/metrics, HOST being --metrics-host, "
        "and the probes /healthz (the server's loop turns) and /readyz (serving, not "
        "draining) (default: off)",
    )

    batch = p.add_argument_group("batches")
    batch.add_argument(
        "--batch-size", type=int, metavar="B", help=f"images per batch (default: {_D.batch_size})"
    )
    batch.add_argument(
        "--max-batch-size",
        type=int,
        metavar="B",
        help="largest batch size a client may ask for (RemoteLoader(batch_size=...): jobs of a "
        "sweep with different batch sizes on one server); batch buffers are sized for it, a "
        "larger ask is refused (default: --batch-size)",
    )
    batch.add_argument(
        "--image-size",
        type=_image_size,
        metavar="PX|H,W",
        help=f"output size: PX (square) or H,W (default: {_D.image_size})",
    )
    batch.add_argument(
        "--max-image-size",
        type=_image_size,
        metavar="PX|H,W",
        help="largest output size a client may ask for (progressive resizing: "
        "RemoteLoader(image_size=...) / set_image_size); batch buffers are sized for it, a "
        "larger ask is refused (default: --image-size)",
    )
    batch.add_argument(
        "--seed", type=int, help=f"seed of shuffling and augmentation (default: {_D.seed})"
    )
    batch.add_argument(
        "--output-dtype",
        choices=list(DTYPES),
        help="dtype of the images on the wire; uint8 carries 4x fewer bytes than "
        "float32 and skips normalisation (RemoteLoader(normalize_on_device=True) normalises "
        f"on the device); a float dtype is normalised by the server (default: {_D.output_dtype})",
    )
    batch.add_argument(
        "--layout",
        choices=list(LAYOUTS),
        help=f"memory layout; nhwc = torch.channels_last (default: {_D.layout})",
    )

    batch.add_argument(
        "--views",
        type=_views,
        metavar="COUNTxSIZE:LO-HI,...",
        help="multi-view crops (self-supervised training, DINO/SimCLR): COUNT crops of SIZE "
        "(PX or HxW) with random-resized-crop scale LO-HI per group, e.g. "
        "2x224:0.4-1.0,6x96:0.05-0.4; each sample is decoded once, each view cropped on its own "
        "draws, and a batch is the list of the views' batches (replaces --image-size and "
        "--scale; default: one view)",
    )

    aug = p.add_argument_group("augmentation (train split; torchvision's defaults)")
    aug.add_argument(
        "--scale",
        type=_PAIR,
        metavar="LO,HI",
        help="random-resized-crop area fraction range (default: 0.08,1)",
    )
    aug.add_argument(
        "--ratio",
        type=_PAIR,
        metavar="LO,HI",
        help="random-resized-crop aspect ratio range (default: 0.75,1.3333)",
    )
    aug.add_argument(
        "--flip-prob",
        type=float,
        metavar="P",
        help=f"horizontal flip probability (default: {_D.flip_prob:g})",
    )
    for name in ("brightness", "contrast", "saturation", "hue"):
        aug.add_argument(
            f"--{name}",
            type=float,
            metavar="X",
            help=f"colour jitter {name} as in torchvision ColorJitter (default: 0 = off)",
        )
    aug.add_argument(
        "--mean",
        type=_RGB,
        metavar="R,G,B",
        help="normalisation mean for float outputs (default: ImageNet's 0.485,0.456,0.406)",
    )
    aug.add_argument(
        "--std",
        type=_RGB,
        metavar="R,G,B",
        help="normalisation std for float outputs (default: ImageNet's 0.229,0.224,0.225)",
    )
    aug.add_argument(
        "--val-crop-fraction",
        type=float,
        metavar="F",
        help="val split: resize the shorter side to size/F, then centre crop "
        f"(default: {_D.val_crop_fraction:g})",
    )

    aug.add_argument(
        "--transform",
        metavar="MODULE:CALLABLE",
        help="train split: run this Python callable(image, generator) on each decoded image "
        "instead of the built-in augmentation (module:callable or file.py:callable; it runs in "
        "this process: your own code only; docs/transforms.md)",
    )
    aug.add_argument(
        "--val-transform",
        metavar="MODULE:CALLABLE",
        help="val split: the same, in place of the centre crop (default: the centre crop)",
    )

    work = p.add_argument_group("compute")
    work.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help="decode threads (default: the CPU cores this process may use; when decoding on the "
        "CPU with at least as many --producers as cores, 1: each producer decodes its own batch)",
    )
    work.add_argument(
        "--producers",
        type=int,
        metavar="N",
        help="batches produced concurrently, so one batch's augmentation overlaps "
        f"the next one's reading and decoding (default: {_D.producers})",
    )
    work.add_argument(
        "--decoder",
        choices=list(DECODERS),
        help="JPEG decoder: cpu (TurboJPEG/OpenCV), nvjpeg, dali, or auto = the "
        f"best available for --device (default: {_D.decoder})",
    )
    work.add_argument(
        "--device",
        metavar="DEV",
        help=f"where to decode and augment: cpu, cuda or cuda:N (default: {_D.device})",
    )
    work.add_argument(
        "--max-pixels",
        type=int,
        metavar="N",
        help="images whose header claims more pixels are treated as bad and "
        f"replaced (decompression-bomb guard) (default: {_D.max_pixels})",
    )
    p.add_argument(
        "--log-level",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        type=str.upper,
        help=f"logging verbosity (default: {_D.log_level})",
    )
    p.add_argument(
        "--log-format",
        choices=list(LOG_FORMATS),
        help="text lines, or one JSON object per line (time, level, logger, message, "
        f"exception) for a log collector (default: {_D.log_format})",
    )
    return p


def parse_config(argv: list[str] | None = None) -> ServerConfig:
    """Command line (over an optional TOML file) -> validated `ServerConfig`; exits on misuse."""
    parser = build_parser()
    args: dict[str, Any] = vars(parser.parse_args(argv))
    settings: dict[str, Any] = {}
    config_path = args.pop("config", None)
    if config_path is not None:
        try:
            settings.update(config_from_toml(config_path))
        except (OSError, ValueError) as exc:
            parser.error(str(exc))
    settings.update(args)
    try:
        return ServerConfig(**settings)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def _limit_intra_op_threads(config: ServerConfig) -> None:
    """One intra-op thread for the CPU augment op when the producer threads alone fill the cores.

    Each producer runs its own augment call, so there the op's extra threads cannot add
    throughput; they only cost synchronisation and spin-waiting (measured on 2 cores: ~0.13
    CPU ms per image with one thread, 0.17-0.22 with two). The output does not depend on the
    thread count. An explicit OMP_NUM_THREADS is left alone, as are larger machines.
    """
    if config.device != "cpu" or "OMP_NUM_THREADS" in os.environ:
        return
    cores = available_cores()
    if cores <= config.producers:
        import torch

        if torch.get_num_threads() > 1:
            torch.set_num_threads(1)
            log.info(
                "%d cores for %d producers: augmenting with 1 thread each", cores, config.producers
            )


def _raise_descriptor_limit() -> None:
    """Lift the soft RLIMIT_NOFILE to the hard one (as Go and many servers do): every client
    connection and every image read takes a descriptor, and the common soft default (1024)
    is soon reached by a few hundred trainers. A hard limit is left as it is."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY:
            hard = 1 << 20
        if soft != resource.RLIM_INFINITY and soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            log.debug("descriptor limit raised from %d to %d", soft, hard)
    except (ImportError, OSError, ValueError):  # not POSIX, or not allowed: keep what we have
        pass


def main(argv: list[str] | None = None) -> int:
    """Console script `pipeline-server`: run until SIGINT/SIGTERM, exit 0 on a clean stop."""
    config = parse_config(argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(config.log_format))
    logging.basicConfig(level=config.log_level, handlers=[handler])
    logging.captureWarnings(True)  # warnings too go through the handler (one JSON line each)
    from batchwire.server.app import ServerApp, StartupError  # heavy imports after --help

    _limit_intra_op_threads(config)
    _raise_descriptor_limit()
    try:
        app = ServerApp(config)
        code = app.run(exit_by_deadline=True)
    except StartupError as exc:
        log.error("%s", exc)
        return 2
    # Everything is closed and joined by now. Interpreter teardown with torch loaded takes
    # seconds (module finalisation) and would delay a supervisor's restart for nothing.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
