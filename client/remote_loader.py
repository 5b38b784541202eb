"""RemoteLoader: a drop-in data loader that trains from one or more pipeline-servers.

    loader = RemoteLoader("tcp://127.0.0.1:5555", split="train", device="cuda")
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for images, labels in loader:  # float32 [B, 3, H, W] normalised on the device, int64 [B]
            ...

Position semantics (those of torch's DataLoader and torchdata's StatefulDataLoader): every
``iter(loader)`` starts a fresh pass from batch 0, unless `load_state_dict` positioned the
loader, in which case that one pass starts at the saved batch (a saved position at the epoch's
end gives an empty pass). Which epoch: the one `set_epoch` selected; a train loader iterated
again after a full pass with no `set_epoch` since moves to the next epoch by itself (as a
DataLoader over a RandomSampler reshuffles on every ``iter()``: Lightning cannot reach
``set_epoch`` through ``DataLoader(loader, batch_size=None)``); an explicit `set_epoch` always
decides, and a val loader repeats its epoch. `set_epoch` with the current epoch keeps a
restored position (so "load state, then the usual ``set_epoch(epoch)`` loop" resumes
mid-epoch). A state saved on any rank restores on every rank of the same job: ranks move in
lockstep, so the position is the same for all. A state saved at one world size resumes at
another (elastic trainers): the rest of that epoch is re-split over the new ranks (see
`state_dict`).

Frameworks: Lightning finds `set_epoch` through ``loader.sampler`` and Accelerate through the
dataset of a DataLoader it prepared; `batchwire.client.lightning.RemoteLoaderCallback` covers
``DataLoader(loader, batch_size=None)`` under Lightning and makes mid-epoch checkpoints exact.
Accelerate's ``prepare`` re-shards iterable datasets and would lose data: the loader refuses to
run under it (see `frameworks`).

Next epoch early: once the servers have sent the last batch of an epoch, the loader asks them
for the next epoch (``epoch + 1`` from batch 0), so the usual ``set_epoch(epoch + 1)`` finds
its first batches already received instead of waiting for the servers to start. Any other next
step (another epoch, ``load_state_dict``, iterating the same epoch again) discards those batches
and asks for what it needs; the position above never counts them. After a long pause between
epochs (over `speculation.AHEAD_MAX_AGE_S`, e.g. a long validation) the early session is replaced
rather than trusted, since the server may have dropped it meanwhile. ``prefetch_next_epoch=False``
turns this off (e.g. a loader whose epochs are not consecutive); setting
``loader.prefetch_next_epoch = False`` before the last epoch saves the batches of an epoch that
never comes (pipeline-train and `RemoteLoaderCallback` do so).

Tensor lifetime. On CPU every batch is yours to keep: it is never overwritten while any tensor,
view or numpy array of it exists (a normalised batch's buffer is recycled only after that,
``reuse_buffers``). On CUDA a batch lives in one of a fixed ring of device slots
(``budget + hold + 1`` of them; the budget is ``prefetch`` with one server,
``max(prefetch, 4 x servers)`` with several), and the contract is:

- **Which stream.** A batch is handed to the *consumer stream*: ``stream=`` if given, else the
  current CUDA stream when the batch is handed out (when ``next()`` returns it). That stream
  waits for the batch's copy; other streams do not. To use a batch on another stream, pass that
  stream as ``stream=``, or make it wait for the consumer stream (``other.wait_stream(s)``) and
  make the consumer stream wait for it (``s.wait_stream(other)``) before the batch is recycled.
- **How long.** The last ``hold`` batches handed out (default 2) stay valid: requesting one more
  recycles the oldest. Everything queued on the consumer stream before that request is safe (an
  event recorded on it then guards the slot); anything queued later may read the next batch's
  bytes. At the end of a pass the last batches stay valid until the next ``iter(loader)`` or
  `close`. `clone()` (on the consumer stream) what you keep longer.
- **Prefetch pattern.** "Fetch the next batch, then run this step" holds two batches at once,
  which the default ``hold=2`` allows::

      it = iter(loader)
      nxt = next(it, None)
      while nxt is not None:
          images, labels = nxt
          nxt = next(it, None)  # the batch before `images` is recycled now, not `images`
          step(images, labels)

  Holding more (e.g. ``k`` batches fetched ahead) needs ``hold=k + 1``.
- **Closing.** `close` (or leaving the ``with`` block) waits until every slot is idle on every
  stream a batch was handed to, then frees the slots: batches handed out are invalid afterwards.

One loader serves one consumer thread (it is not thread-safe); use one loader per rank.
"""

from __future__ import annotations

import functools
import logging
import math
import numbers
import os
import time
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from batchwire import wire
from batchwire.client.errors import LoaderError
from batchwire.client.fleet import FleetConfig
from batchwire.client.frameworks import refuse_resharding_wrappers
from batchwire.client.loader_stats import LoaderStats
from batchwire.client.normalize import IMAGENET_MEAN, IMAGENET_STD, check_dtype
from batchwire.client.placement import check_rank, default_job, resolve_device, resolve_rank
from batchwire.client.progress import STATE_KEYS, Progress
from batchwire.client.receiver import Arrived, BatchReceiver
from batchwire.client.staging import BatchFormat, CpuStager, CudaStager, Staged
from batchwire.wire.keys import client_keys
from batchwire.wire.messages import MAX_BATCH_SIZE
from torch.utils.data import IterableDataset, get_worker_info

log = logging.getLogger(__name__)

_CPU_OUTPUT_BUFFERS = 4


def _metadata_of(header: wire.BatchHeader) -> list[dict[str, Any] | None]:
    """A batch's per-sample metadata (None each from a server that sent none)."""
    if header.metadata is None:
        return [None] * header.batch_size
    return list(header.metadata)


def _make_stager(
    welcome: wire.Welcome,
    slots: int,
    *,
    device: torch.device,
    normalize: bool | None,
    mean: tuple[float, ...] | None,
    std: tuple[float, ...] | None,
    dtype: torch.dtype,
    reuse_buffers: bool,
    hold: int = 1,
) -> CpuStager | CudaStager:
    """Build the stager for what the first server's welcome announced."""
    fmt = BatchFormat(
        spec=welcome.spec,
        normalize=_normalizes(normalize, welcome.dtype),
        out_dtype=dtype,
        mean=mean or tuple(welcome.mean) or IMAGENET_MEAN,
        std=std or tuple(welcome.std) or IMAGENET_STD,
        label_width=welcome.label_width,
        num_classes=welcome.num_classes,
    )
    if device.type == "cuda":
        # The receiver's ``slots`` count one batch handed out; the others of `hold` come on top.
        return CudaStager(fmt, device, slots + hold - 1)
    # Output buffers are taken at hand-out: the batch the consumer holds, the one it may still
    # hold while asking for the next, and slack; beyond that a buffer is allocated afresh.
    return CpuStager(fmt, _CPU_OUTPUT_BUFFERS if reuse_buffers else 0)


def _normalizes(normalize: bool | None, wire_dtype: str) -> bool:
    """Whether the loader turns the wire's images into normalised floats.

    ``None`` (the default): a uint8 wire is normalised, a float wire (normalised by the server)
    passes through, so the loader yields what a DataLoader with ToTensor and Normalize yields
    whatever the server sends. ``False``: the wire as it is (raw uint8 from a uint8 server).
    ``True``: normalise, which a float wire cannot be (an error rather than a second pass).
    """
    if normalize is None:
        return wire_dtype == "uint8"
    if normalize and wire_dtype != "uint8":
        raise ValueError(
            f"normalize_on_device=True needs a uint8 wire, but the server sends {wire_dtype} "
            "(normalised by the server, or a --transform's values as they are); drop "
            "normalize_on_device (the default passes a float wire through) or start the server "
            "with --output-dtype uint8"
        )
    return normalize


class RemoteLoader(IterableDataset):
    """Batches of one split for one rank, streamed from pipeline-server(s).

    Args:
        endpoints: one endpoint or a list; each batch is asked of whichever server has room
            (a faster server produces more, a lost server's batches go to the others) and the
            loader yields them in epoch order.
        split: ``"train"`` or ``"val"`` (whatever the servers serve).
        rank, world_size: default from torch.distributed, else ``RANK``/``WORLD_SIZE``, else 0/1,
            resolved when the loader first connects (not here: see `placement`).
        prefetch: batches asked for and not yet consumed, across all servers (with several
            servers at least 4 per server); each is one credit of the server it was asked of.
        timeout: seconds to wait for any one batch (reconnects included) before raising
            `ServerUnavailable`. 60 s by default: a restarting server comes back within it, and a
            refusal that clears by itself (``busy``) clears within the server's
            ``--client-timeout`` (60 s): keep it no lower than that.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"``; None picks CUDA when available; ``"cuda"``
            is this process's GPU (``LOCAL_RANK``'s unless `torch.cuda.set_device` chose one).
        with_indices: yield ``(images, labels, indices)``; padding slots have index -1.
        with_metadata: yield one more element, the batch's metadata: a list of one dict per
            sample (a CSV / JSON-lines manifest's columns or keys other than path and label;
            None for a padding slot, and for every sample of a dataset without metadata). Asked
            of the servers in the hello: off, nothing extra travels.
        normalize_on_device: None (default): yield what a DataLoader with ToTensor and
            Normalize yields, normalised floats on ``device``: a uint8 wire (the server's
            default) is converted to ``dtype`` with ``(x/255 - mean)/std`` on the device (the
            wire keeps its 4x smaller bytes), a float wire (normalised by the server) passes
            through unchanged. False: the wire's images as they are (raw uint8 [0, 255] from a
            uint8 server). True: always normalise on the device; a float wire is then an
            error, raised when the server's welcome says so.
        mean, std: for normalising on the device; None takes the server's (ImageNet if absent).
        dtype: float dtype of images normalised on the device (float32, bfloat16 or float16).
        heartbeat: seconds of silence from a server that owes a batch before the hello is
            re-sent (the fallback for restarts the connection events do not reveal).
        prefetch_next_epoch: at the end of an epoch, have the servers start the next one (see
            the module's docstring); the batches yielded are the same either way.
        keys: a keys folder made by `pipeline-keys` (the server's, copied here): the loader
            authenticates with its client key and encrypts everything; default:
            ``$BATCHWIRE_KEYS``, else plain sockets. A key the server rejects raises
            `ServerError` at once.
        job: names the training job; a server refuses ranks of other world sizes only within
            one job. Default: ``BATCHWIRE_JOB``, else torchrun's ``TORCHELASTIC_RUN_ID``, else
            "" (one job per server).
        reuse_buffers: CPU only: recycle the output buffers of normalised batches once no
            tensor refers to them any more (saves allocating, and page-faulting, a fresh batch
            each step); False allocates every batch afresh.
        stream: CUDA only: the consumer stream batches are handed to (it waits for each
            batch's copy, and the batch's slot is recycled only after the work queued on it);
            default: the current stream at each hand-out. Must be on the loader's device.
        hold: CUDA only: how many of the latest batches handed out stay valid (see the
            module's docstring); each costs one device slot (and one pinned host slot).
        image_size: the output size to ask the servers for, PX or (H, W) (progressive
            resizing: change it between epochs with `set_image_size`); None: the servers'
            --image-size. A server refuses a size beyond its --max-image-size.
        batch_size: images per batch to ask the servers for (jobs of a sweep with different
            batch sizes on one server); None: the servers' --batch-size. A server refuses a
            batch size beyond its --max-batch-size. Recorded by `state_dict`.

    Multi-view servers (``pipeline-server --views``): each step yields ``(views_list, labels)``
    (``views_list[k]`` is ``[B, 3, Hk, Wk]``, the views in the order the server lists them);
    normalisation on the device applies to each view.
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        split: str = "train",
        *,
        rank: int | None = None,
        world_size: int | None = None,
        prefetch: int = 4,
        timeout: float = 60.0,
        device: str | torch.device | None = None,
        with_indices: bool = False,
        with_metadata: bool = False,
        normalize_on_device: bool | None = None,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        dtype: torch.dtype = torch.float32,
        heartbeat: float = 1.0,
        prefetch_next_epoch: bool = True,
        reuse_buffers: bool = True,
        job: str | None = None,
        keys: str | os.PathLike[str] | None = None,
        stream: torch.cuda.Stream | None = None,
        hold: int = 2,
        image_size: int | tuple[int, int] | None = None,
        batch_size: int | None = None,
    ) -> None:
        super().__init__()
        self._image_size = _image_size(image_size)
        # The size the pass of the current position runs at (`set_image_size` waits for the
        # next pass): what `state_dict` records of a position inside a pass.
        self._pass_image_size = self._image_size
        self._batch_size = _batch_size(batch_size)
        eps = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        if not eps or not all(isinstance(e, str) and "://" in e for e in eps):
            raise ValueError(f"endpoints must be 'tcp://host:port' style strings, got {endpoints}")
        if len(set(eps)) != len(eps):
            raise ValueError(f"endpoints must be distinct, got {eps}")
        if not _is_int(prefetch) or not 1 <= prefetch <= wire.MAX_PREFETCH:
            raise ValueError(
                f"prefetch must be an integer in [1, {wire.MAX_PREFETCH}], got {prefetch!r}"
            )
        for name, seconds in (("timeout", timeout), ("heartbeat", heartbeat)):
            if not _is_seconds(seconds):
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {seconds!r}")
        if stream is not None and not isinstance(stream, torch.cuda.Stream):
            raise ValueError(f"stream must be a torch.cuda.Stream, got {type(stream).__name__}")
        if isinstance(hold, bool) or not isinstance(hold, int) or not 1 <= hold <= 64:
            raise ValueError(f"hold must be an integer in [1, 64], got {hold!r}")
        self.endpoints = eps
        self.split = split
        check_rank(rank, world_size)
        self._rank_arg, self._world_size_arg = rank, world_size
        self._placement: tuple[int, int] | None = None  # (rank, world_size) once connected
        self.prefetch = int(prefetch)
        self.timeout = float(timeout)
        self.heartbeat = float(heartbeat)
        self.with_indices = bool(with_indices)
        self.with_metadata = bool(with_metadata)
        self.normalize_on_device = (
            None if normalize_on_device is None else bool(normalize_on_device)
        )
        self.mean = None if mean is None else tuple(float(v) for v in mean)
        self.std = None if std is None else tuple(float(v) for v in std)
        self.dtype = check_dtype(dtype)
        self._prefetch_next_epoch = bool(prefetch_next_epoch)
        self.job = default_job() if job is None else str(job)
        self.keys = client_keys(keys)  # loaded now: a bad keys folder fails at construction
        self.reuse_buffers = bool(reuse_buffers)
        self.cuda_stream = stream
        self.hold = hold
        self._device_arg = device
        self.device: torch.device | None = None  # resolved on first connection
        #: Epoch, next batch, pass and a restored position's checks: the position policy.
        self._progress = Progress()
        self._receiver: BatchReceiver | None = None
        # Batches handed out and not yet recycled, oldest first (at most `hold`).
        self._handed: deque[Staged] = deque()
        self._iteration = 0  # bumps with every __iter__, so a stale iterator stops
        # The call that moved the position during a pass (`_end_pass`), which that pass's
        # iterator names when it stops; None: a newer iter(loader) superseded it.
        self._ended_by: str | None = None
        self._started = 0  # the latest iteration whose iterator has begun (its first next())
        self._stats: LoaderStats | None = LoaderStats()  # None only while pickled
        self._finalizer: weakref.finalize | None = None

    # ------------------------------------------------------------------ public API

    @property
    def rank(self) -> int:
        """This loader's rank: fixed once connected, else what the process says now."""
        return (self._placement or resolve_rank(self._rank_arg, self._world_size_arg))[0]

    @property
    def world_size(self) -> int:
        return (self._placement or resolve_rank(self._rank_arg, self._world_size_arg))[1]

    @property
    def epoch(self) -> int:
        """The epoch the next pass iterates (`set_epoch`, a restored state, or the advance);
        read-only: `set_epoch` and `load_state_dict` move it."""
        return self._progress.epoch

    @property
    def next_batch(self) -> int:
        """The next batch of the epoch to hand out."""
        return self._progress.next_batch

    #: Lightning, having found ``sampler``, reads this too (as it would on a DataLoader).
    batch_sampler = None

    @property
    def sampler(self) -> _EpochSetter:
        """What Lightning calls ``set_epoch`` on (it looks for ``loader.sampler.set_epoch``)."""
        return _EpochSetter(self)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch to iterate next (keeps a restored position if it is the current one)."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be an integer >= 0, got {epoch!r}")
        refuse_resharding_wrappers()  # Accelerate's shard calls this before iterating
        if epoch != self._progress.epoch:
            self._end_pass("set_epoch()")
        self._progress.set_epoch(epoch)

    @property
    def prefetch_next_epoch(self) -> bool:
        """Whether the servers start the next epoch when this one's last batch is sent (the
        module's "Next epoch early"). Settable at any time: turn it off before the last epoch
        and no batch is made for an epoch that never comes (pipeline-train and
        `RemoteLoaderCallback` do)."""
        return self._prefetch_next_epoch

    @prefetch_next_epoch.setter
    def prefetch_next_epoch(self, enabled: bool) -> None:
        self._prefetch_next_epoch = bool(enabled)
        if self._receiver is not None:
            self._receiver.ask_ahead(self._prefetch_next_epoch)

    @property
    def image_size(self) -> tuple[int, int] | None:
        """The output size asked of the servers (None: theirs)."""
        return self._image_size

    def set_image_size(self, image_size: int | tuple[int, int] | None) -> None:
        """Ask for batches of ``image_size`` (PX or (H, W); None: the servers' --image-size)
        from the next pass on (the next ``iter(loader)``, usually the next epoch): progressive
        resizing without restarting the servers. A pass under way keeps its size. Batches at a
        size are those a server started at that size sends (train crops do not depend on
        the output size); a server refuses a size beyond its --max-image-size."""
        self._image_size = _image_size(image_size)
        if self._receiver is not None:  # no next-epoch batches asked early at the old size
            self._receiver.ask_image_size(self._image_size)

    def __len__(self) -> int:
        """This rank's number of batches per epoch (asks the server on first use)."""
        return self.server_info().num_batches

    def server_info(self) -> wire.Welcome:
        """The server's welcome: batches per epoch, samples, batch shape, dtype, classes, ...

        Connects (and starts streaming the current epoch) on first use.
        """
        receiver = self._connect()
        if receiver.welcome is None:
            progress = self._progress
            receiver.start(progress.epoch, progress.start_batch(), progress.pass_, self._image_size)
            receiver.wait_welcome()
        assert receiver.welcome is not None
        return receiver.welcome

    @property
    def num_classes(self) -> int:
        return self.server_info().num_classes

    @property
    def classes(self) -> list[str]:
        """Class names in label id order, as torchvision's ImageFolder has them (folder names,
        a manifest's names, Parquet's ClassLabel names; "0".."N-1" for integer labels). Empty
        from a server too old to send them, or for a list too long for a welcome."""
        return list(self.server_info().classes)

    @property
    def class_to_idx(self) -> dict[str, int]:
        """Class name -> label id (torchvision's `class_to_idx`)."""
        return {name: i for i, name in enumerate(self.classes)}

    @property
    def num_samples(self) -> int:
        """Samples an epoch draws, all ranks together, before padding or dropping: the split's
        images, or a train mix's epoch length."""
        return self.server_info().num_samples

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        if get_worker_info() is not None:
            raise LoaderError(
                "RemoteLoader cannot run inside DataLoader worker processes: every worker would "
                "stream the same batches. It already receives and prefetches in the background; "
                "use DataLoader(loader, batch_size=None, num_workers=0) or iterate it directly"
            )
        refuse_resharding_wrappers()
        if self._progress.begin_pass(repeats=self.split == "val"):
            log.debug(
                "RemoteLoader: split %r moves on to epoch %d by itself", self.split, self.epoch
            )
        self._iteration += 1
        self._ended_by = None
        return self._iterate(self._iteration)

    def stats(self) -> dict | None:
        """Prefetch depth, wait per batch, data-wait fraction, images/s (`LoaderStats.figures`)."""
        return None if self._stats is None else self._stats.figures()

    def batch_totals(self) -> tuple[int, int]:
        """(batches received, those of them the server produced for another job too: a sweep's
        shared production) since the loader was made."""
        return (0, 0) if self._stats is None else self._stats.totals()

    def state_dict(self) -> dict[str, Any]:
        """Where the loader stands: resume with `load_state_dict` to get exactly the rest.

        Once connected it also records the epoch's shape (``epoch_shape``: batches per epoch,
        batch size, samples): a position means nothing against a server restarted with other data or
        another batch size, and resuming there would repeat or skip samples.

        Elastic trainers: ``start_sample`` and ``epoch_world_size`` say which pass of the epoch
        this is (0 and ``world_size`` for the epoch's own batches). The global position is
        ``start_sample + next_batch * world_size * batch_size`` samples of the epoch order:
        every rank has consumed ``next_batch`` batches (ranks step in lockstep: a checkpoint
        is taken at a step all ranks reached, so rank 0's state, which frameworks save, holds
        for all). Restored at another world size, the rest of the epoch from there is split
        over the new ranks (`load_state_dict`).
        """
        rank, world_size = self._placement or resolve_rank(self._rank_arg, self._world_size_arg)
        position = self._progress.position(world_size)
        state: dict[str, Any] = {
            "epoch": position["epoch"],
            "next_batch": position["next_batch"],
            "split": self.split,
            "rank": rank,  # informative: any rank's state restores on every rank
            "world_size": world_size,
            "start_sample": position["start_sample"],
            "epoch_world_size": position["epoch_world_size"],
        }
        # Inside a pass, its own size; at a pass's start, the size the next pass will ask.
        size = self._pass_image_size if position["next_batch"] > 0 else self._image_size
        if size is not None:
            state["image_size"] = list(size)
        if self._batch_size is not None:
            state["batch_size"] = self._batch_size
        welcome = None if self._receiver is None else self._receiver.welcome
        if welcome is not None:
            state["epoch_shape"] = _epoch_shape(welcome)
        elif self._progress.resume_shape:
            state["epoch_shape"] = dict(self._progress.resume_shape)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Start the next pass at ``state``'s position.

        The state may come from any rank (a framework's checkpoint often holds rank 0's only):
        all ranks of a job stand at the same batch. The split must match; the epoch's shape
        (batches per epoch, batch size, samples) is checked against the next welcome. States
        saved before ``epoch_shape`` was named so carry it as ``stream``.

        Another world size (elastic trainers): the next pass serves the rest of the epoch:
        the samples after the saved global position (see `state_dict`), split over this
        loader's ranks, its last round padded (index -1, label -100) so that every sample of
        the epoch is served exactly once; each sample's augmentation is unchanged. Its order
        is a pure function of (seed, epoch, saved world size, position, new world size).
        """
        missing = [k for k in STATE_KEYS if k not in state]
        if missing:
            raise ValueError(f"RemoteLoader state is missing {missing}")
        if state["split"] != self.split:
            raise ValueError(
                f"state is for split {state['split']!r}, this loader serves {self.split!r}"
            )
        if "image_size" in state:  # the size the saved pass was trained at (progressive)
            self._image_size = self._pass_image_size = _image_size(state["image_size"])
        if state.get("batch_size") is not None:  # the batch size the saved pass asked for
            self._batch_size = _batch_size(state["batch_size"])
            if self._receiver is not None:
                self._receiver.ask_batch_size(self._batch_size)
        saved_world = int(state["world_size"])
        self._progress.restore(state, self._current_world_size(saved_world))
        self._end_pass("load_state_dict()")

    def _end_pass(self, call: str) -> None:
        """``call`` moved the position, which decides the next ``iter(loader)``: a pass under
        way cannot go on from a position that is no longer its own, so its iterator stops,
        with a `LoaderError` naming the call if batches of it were left (nothing if it had
        handed out its last one). An iterator not begun yet starts from the new position:
        Lightning restores a loader's state between ``iter(loader)`` and the first batch."""
        if self._started == self._iteration:
            self._iteration += 1
            self._ended_by = call

    def _current_world_size(self, default: int) -> int:
        """This loader's world size if it can be known now (argument, torch.distributed,
        the environment), else ``default``."""
        if self._placement is not None:
            return self._placement[1]
        try:
            return resolve_rank(self._rank_arg, self._world_size_arg)[1]
        except ValueError:
            return default

    def close(self) -> None:
        """Leave the servers (bye) and free sockets and buffers; the loader reconnects if used."""
        self._release_handed()
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None
        self._placement = None  # a later use resolves (and connects) again
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None

    def __enter__(self) -> RemoteLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (for DataLoader workers, which then refuse to run): no live sockets."""
        state = self.__dict__.copy()
        state.update(
            _receiver=None, _handed=deque(), _finalizer=None, _stats=None, cuda_stream=None
        )
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """An unpickled copy (a spawned process's loader) counts and reports its own batches."""
        self.__dict__.update(state)
        self._stats = LoaderStats()

    def __repr__(self) -> str:
        where = (
            "unresolved"
            if self._placement is None
            else "rank={}, world_size={}".format(*self._placement)
        )
        return (
            f"RemoteLoader({self.endpoints}, split={self.split!r}, {where}, "
            f"epoch={self.epoch}, next_batch={self.next_batch})"
        )

    # ------------------------------------------------------------------ internals

    def _connect(self) -> BatchReceiver:
        if self._receiver is None:
            rank, world_size = resolve_rank(self._rank_arg, self._world_size_arg)
            self.device = resolve_device(self._device_arg)
            self._check_cuda_stream(self.device)
            self._placement = (rank, world_size)
            config = FleetConfig(
                split=self.split,
                rank=rank,
                world_size=world_size,
                prefetch=self.prefetch,
                timeout=self.timeout,
                heartbeat=self.heartbeat,
                speculate=self._prefetch_next_epoch,
                job=self.job,
                batch_size=self._batch_size,
                metadata=self.with_metadata,
            )
            self._receiver = BatchReceiver(
                self.endpoints,
                config,
                keys=self.keys,
                make_stager=functools.partial(
                    _make_stager,
                    device=self.device,
                    normalize=self.normalize_on_device,
                    mean=self.mean,
                    std=self.std,
                    dtype=self.dtype,
                    reuse_buffers=self.reuse_buffers,
                    hold=self.hold,
                ),
            )
            # Sockets and the context must close even if the user never calls close(); the
            # receiver holds no reference back to the loader, so the loader can be collected.
            self._finalizer = weakref.finalize(self, self._receiver.close)
        return self._receiver

    def _check_cuda_stream(self, device: torch.device) -> None:
        if self.cuda_stream is None:
            return
        if device.type != "cuda":
            raise ValueError(f"stream= is for a CUDA loader; this one delivers to {device}")
        if self.cuda_stream.device != device:
            raise ValueError(
                f"stream= is on {self.cuda_stream.device}, the loader delivers to {device}"
            )

    def _known_world_size(self) -> int | None:
        """This loader's world size if it is known (connected, the argument, or an initialised
        torch.distributed), else None."""
        known = self._placement[1] if self._placement else self._world_size_arg
        if known is None:
            dist = torch.distributed
            if dist.is_available() and dist.is_initialized():
                known = dist.get_world_size()
        return known

    def _release_handed(self, keep: int = 0) -> None:
        """Recycle the batches handed out, oldest first, until ``keep`` are left."""
        while len(self._handed) > keep:
            staged = self._handed.popleft()
            if self._receiver is not None:
                self._receiver.release(staged)

    def _iterate(self, iteration: int) -> Iterator[tuple[torch.Tensor, ...]]:
        if iteration != self._iteration:  # begun after a newer iter(loader): touch nothing
            raise LoaderError("this iterator was superseded by a newer iter(loader)")
        self._started = iteration
        receiver = self._connect()
        # The last batches of an earlier pass were valid until now (see the module's docstring).
        self._release_handed()
        progress, stats = self._progress, self._stats
        total = receiver.num_batches
        if total is None or progress.next_batch < total or self._image_size != receiver.image_size:
            receiver.start(progress.epoch, progress.next_batch, progress.pass_, self._image_size)
        self._pass_image_size = self._image_size
        if receiver.welcome is None:
            receiver.wait_welcome()
        total = len(self)
        welcome = receiver.welcome
        shape = None if welcome is None else _epoch_shape(welcome)
        known_world = None if progress.resume_world is None else self._known_world_size()
        progress.check_resumed(shape, known_world)
        if progress.at_end(total):  # a restored position at the epoch's end: an empty pass
            return
        # Nothing is recycled when a pass ends (or is left): its last `hold` batches stay valid,
        # e.g. for the prefetch pattern's last step; the next pass or `close` recycles them.
        handed_all = False
        while True:  # checked first: set_epoch or load_state_dict may have moved `progress`
            if iteration != self._iteration:
                if self._ended_by is None:
                    raise LoaderError("this iterator was superseded by a newer iter(loader)")
                if handed_all:
                    return
                raise LoaderError(
                    f"{self._ended_by} during a pass ended it: the call decides the next "
                    "iter(loader), so make it before the loop (or after it)"
                )
            if self._receiver is not receiver:
                raise LoaderError("the loader was closed while this iterator was in use")
            if progress.next_batch >= total:
                return
            t0 = time.perf_counter()
            self._release_handed(keep=self.hold - 1)  # the oldest of `hold` is recycled
            # The report rides on the credits this hand-out makes (data, not a callback).
            report = None if stats is None else stats.as_dict()
            arrived = receiver.get(progress.next_batch, report)
            receiver.hand_out(arrived, self.cuda_stream)
            self._handed.append(arrived.staged)
            progress.handed_out(total)
            handed_all = progress.next_batch >= total
            if stats is not None:
                stats.record_wait(time.perf_counter() - t0)
                stats.record_batch(arrived.header.batch_size, arrived.header.shared)
                stats.set_prefetch_depth(receiver.depth)
            yield self._output(arrived)

    def _output(self, arrived: Arrived) -> tuple[torch.Tensor, ...]:
        staged: Staged = arrived.staged
        extra = (_metadata_of(arrived.header),) if self.with_metadata else ()
        if not self.with_indices:
            return staged.images, staged.labels, *extra
        indices = torch.tensor(arrived.header.indices, dtype=torch.int64)
        if self.device is not None and self.device.type == "cuda":
            # From pinned memory the copy is queued, not waited for: a pageable copy would make
            # the host wait for all the GPU work queued before it. Queued on the consumer
            # stream, like the batch it comes with.
            assert self._receiver is not None
            with torch.cuda.stream(self._receiver.consumer_stream(self.cuda_stream)):
                indices = indices.pin_memory().to(self.device, non_blocking=True)
        return staged.images, staged.labels, indices, *extra


class _EpochSetter:
    """``loader.sampler``: the handle frameworks call ``set_epoch`` on."""

    def __init__(self, loader: RemoteLoader) -> None:
        self._loader = weakref.ref(loader)

    def set_epoch(self, epoch: int) -> None:
        loader = self._loader()
        if loader is not None:
            loader.set_epoch(epoch)


def _is_int(value: Any) -> bool:
    """An integer (numpy's too), and not a bool (``True`` would pass for 1)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_seconds(value: Any) -> bool:
    """A finite number > 0 (inf and NaN would reach the socket waits as integers)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and 0 < value < math.inf


def _batch_size(size: Any) -> int | None:
    """RemoteLoader's ``batch_size``: None or a positive integer."""
    if size is None:
        return None
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_BATCH_SIZE:
        raise ValueError(f"batch_size must be an integer in 1..{MAX_BATCH_SIZE}, got {size!r}")
    return size


def _image_size(size: Any) -> tuple[int, int] | None:
    """RemoteLoader's ``image_size``: None, PX or (H, W) of positive integers."""
    if size is None:
        return None
    pair = (
        (size, size)
        if isinstance(size, int)
        else tuple(size)
        if isinstance(size, (list, tuple))
        else ()
    )
    if len(pair) != 2 or any(
        isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= wire.MAX_IMAGE_SIDE
        for v in pair
    ):
        raise ValueError(
            f"image_size must be PX or (height, width) positive integers, got {size!r}"
        )
    return (pair[0], pair[1])


def _epoch_shape(welcome: wire.Welcome) -> dict[str, int]:
    return {
        "num_batches": welcome.num_batches,
        "batch_size": welcome.batch_size,
        "num_samples": welcome.num_samples,
    }
