"""User transforms: the operator's own Python code in place of the fused augment op.

`--transform module:callable` (or ``path/to/file.py:callable``; the TOML key ``transform``; the
``transform=`` argument of `LocalLoader`, which also takes the callable itself) names a function

    callable(image: torch.Tensor, generator: torch.Generator) -> torch.Tensor

called on each decoded sample in the producer threads. ``image`` is the whole decoded image,
HWC uint8 RGB, at full resolution (no crop-region decode and no DCT reduction: the transform
decides the crop, so the decoder cannot know which part or scale it will read), on the
decoder's device (a GPU decoder's images are CUDA tensors; docs/transforms.md). ``generator``
is a CPU `torch.Generator` seeded from (seed, epoch, sample index) through the pipeline's
counter-based draws (`augment_plan.draw_uniforms` with `TRANSFORM_SALT`), so a sample's output
depends on nothing else: any server, thread count or resume point produces the same bytes, as
long as the transform draws its randomness from ``generator`` only. It returns a CHW tensor of
the configured output size; the server casts it to the output dtype (a float result into uint8
is rounded half to even and clamped to [0, 255]) and writes it in the output layout. The server
applies no normalisation to a transform's output: the values it returns are the values sent.

A transform that raises (anything, `SystemExit` and `KeyboardInterrupt` included: see
`TransformRunner.apply`) on a sample, or returns what the server cannot send as it is (not a
tensor, not a dense one: sparse, quantized or nested; the wrong shape, a tensor on another
device than the image's or the output's, NaN or inf, values the output dtype cannot hold: an
int 300 for a uint8 output, which the cast would wrap to 44, or 1e5 for a float16 one, which it
would make inf), is counted
(`transform_errors_total`) and logged (the traceback once per distinct error), and the sample
is replaced like a corrupt file (its next substitute, transformed in turn); it never stops a
producer. The failure is not remembered as a bad file: it may depend on the epoch's draws, and a
server that had not seen it must pick the same sample for the same (seed, epoch, index).

A transform that draws from a global RNG (torch's default generator: ``torch.rand(...)``
without ``generator=``; Python's `random`; NumPy's legacy ``np.random``) would make each
server's bytes differ. Its first `PROBE_CALLS` calls watch for that; once one draws, the server
logs a warning naming the transform (once) and from then on runs it as `torchvision_v2` runs
its transform: one call at a time, with those RNGs seeded from the sample's seed, so its output
is reproducible again, at the cost of its calls no longer running in parallel.
torchvision v2 transforms draw from torch's global RNG; `torchvision_v2` adapts one.

Security: `--transform` imports and runs arbitrary code in the server process. It is the
operator's code, given on the server's command line or config file; clients can never name one.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import numbers
import random
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from batchwire.pipeline.augment_plan import draw_uniforms

log = logging.getLogger("batchwire.pipeline")

#: `draw_uniforms` salt of the transforms' generator seeds ("XFRM"): the augmentation plan's
#: draws (salt 0) and the substitutes' keep their values.
TRANSFORM_SALT = 0x5846524D
#: Distinct errors logged with a traceback; past that only counted (and logged at debug).
MAX_LOGGED_ERRORS = 64
#: A transform's first calls watched for draws from a global RNG (`TransformRunner`): enough to
#: catch one that draws on one sample in ten with 96 % odds; each costs ~150 µs more and runs alone.
PROBE_CALLS = 32
#: XORed into a sample's seed to seed the global RNGs for a transform that draws from them: a
#: seed of their own, so that ``torch.rand(1)`` and ``torch.rand(1, generator=generator)`` in
#: one transform are not the same number.
GLOBAL_SEED_MASK = 0x2545F4914F6CDD1D

Transform = Callable[[torch.Tensor, torch.Generator], torch.Tensor]


def transform_seeds(seed: int, epoch: int, indices: Sequence[int], view: int = 0) -> list[int]:
    """The generator seed of each sample: 53 random bits of (seed, epoch, index, view).

    View v draws with salt ``TRANSFORM_SALT + v``; view 0 is the single-view case.
    """
    u = draw_uniforms(
        seed, epoch, np.asarray(indices, dtype=np.int64), 1, salt=TRANSFORM_SALT + int(view)
    )
    return [int(x) for x in (u[:, 0] * float(1 << 53)).astype(np.int64).tolist()]


def sample_generator(seed: int) -> torch.Generator:
    """A CPU generator in the state ``manual_seed(seed)`` leaves it."""
    g = torch.Generator()
    g.manual_seed(int(seed))
    return g


def transform_name(fn: Any) -> str:
    """A readable name for logs and errors (module.qualname, else the repr)."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    module = getattr(fn, "__module__", None)
    if name is None:
        return type(fn).__name__
    return f"{module}.{name}" if module and module != "builtins" else str(name)


def load_transform(spec: str | Transform) -> Transform:
    """Resolve ``module:attr`` (``attr`` may be dotted) or ``file.py:attr`` to a callable.

    ValueError naming the spec when it does not import or is not callable (the server turns it
    into a start-up error, before any client connects). A callable is returned as it is.
    """
    if callable(spec):
        return spec
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise ValueError(f"transform must be 'module:callable' or 'file.py:callable', got {spec!r}")
    where, attr = spec.split(":")
    if not where or not attr:
        raise ValueError(f"transform must be 'module:callable' or 'file.py:callable', got {spec!r}")
    try:
        if where.endswith(".py"):
            path = Path(where).expanduser().resolve()
            name = f"batchwire_user_transform_{abs(hash(str(path)))}"
            module_spec = importlib.util.spec_from_file_location(name, path)
            if module_spec is None or module_spec.loader is None:
                raise ImportError(f"cannot load {path}")
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[name] = module
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except Exception as exc:  # the user's module: any error at import is a setup problem
        raise ValueError(f"transform {spec!r}: cannot import {where}: {exc!r}") from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"transform {spec!r}: {where} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"transform {spec!r}: {attr} is a {type(obj).__name__}, not callable")
    return obj


class TransformError(Exception):
    """A transform raised or returned something the server cannot send (wrong shape, type,
    device, NaN or inf, values out of the output dtype's range)."""


#: The largest value of a float image a uint8 output refuses as "not in 0..255" (`value_problem`):
#: above a normalised ImageNet image's 2.64, far below any photo's brightest pixel.
UINT8_SCALE_HINT = 3.0


def value_problem(
    result: torch.Tensor, dtype: torch.dtype, source: torch.Tensor | None = None
) -> str | None:
    """Why ``result``'s values cannot be written into a ``dtype`` output, or None when they can.

    NaN and inf are never sent. A float into a uint8 output is rounded and clamped (the
    documented cast), so beyond its finiteness only one mistake is caught: a whole image at most
    `UINT8_SCALE_HINT` (a [0, 1] image, or one already normalised, [-2.1, 2.6] for ImageNet's
    statistics), which the cast would send as a black one (0..3 of 255), unless ``source`` (the
    decoded photo) is itself that dark: a near-black photo stays one (its max read only then).
    An integer into an integer output must fit (the cast would wrap: 300 becomes 44, -1 becomes
    255); anything into a float output must fit its finite range (1e5 would become inf in
    float16). One `aminmax` pass (about 23 µs on a [3, 224, 224] float32 tensor on one core,
    under 1 % of its decode), skipped when the cast cannot go wrong (bool, or an integer tensor
    of the output's own dtype).
    """
    if result.dtype == torch.bool or (result.dtype == dtype and not dtype.is_floating_point):
        return None
    lo, hi = torch.stack(torch.aminmax(result)).double().tolist()  # one device sync, not two
    if result.is_floating_point() and not (math.isfinite(lo) and math.isfinite(hi)):
        return "non-finite values (NaN or inf)"
    if (
        dtype == torch.uint8
        and result.is_floating_point()
        and 0 < hi <= UINT8_SCALE_HINT
        and not (source is not None and float(source.max()) <= UINT8_SCALE_HINT)
    ):
        return (
            f"values in [{lo:g}, {hi:g}] (an image scaled to [0, 1] or normalised, sent black "
            "as uint8: return pixels in 0..255, which the loader normalises, or use a float "
            "--output-dtype)"
        )
    if dtype.is_floating_point:
        limit = float(torch.finfo(dtype).max)
        if lo < -limit or hi > limit:
            return f"values in [{lo:g}, {hi:g}], beyond {dtype}'s range"
    elif not result.is_floating_point():
        info = torch.iinfo(dtype)
        if lo < info.min or hi > info.max:
            return f"values in [{lo:g}, {hi:g}], out of {dtype}'s [{info.min}, {info.max}]"
    return None


class TransformRunner:
    """Applies one transform to samples, writing into a batch; counts and logs its failures.

    Thread-safe: several producer threads call `apply` at once (the counters take a lock; the
    transform itself is the user's, called concurrently unless it is an adapter that locks, or
    it draws from a global RNG: module doc). Its first `PROBE_CALLS` calls run under
    `GLOBAL_RNG_LOCK` with the global RNGs seeded from the sample's seed, watching whether it
    draws from them: if one does, every later call runs that way too ("global"), else none does
    ("plain"). A watched call's output is the one a "global" call would give, and equals a
    plain one's whenever the transform did not draw, so the output stays a function of (seed,
    epoch, sample) however the calls were split between the modes.
    """

    def __init__(self, transform: str | Transform, out_hw: tuple[int, int]) -> None:
        self.fn = load_transform(transform)
        self.name = transform_name(self.fn) if callable(transform) else str(transform)
        self.out_hw = (int(out_hw[0]), int(out_hw[1]))
        self.errors_total = 0
        self._seen: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        # "probe" for the first PROBE_CALLS calls, then "plain" or "global" (class doc). An
        # adapter that seeds the global RNGs itself (torchvision_v2) needs no watching.
        self._mode = "plain" if getattr(self.fn, "seeds_global_rngs", False) else "probe"
        self._probes = 0

    @property
    def draws_global_rng(self) -> bool:
        """Whether the transform was seen drawing from a global RNG (its calls now serialise)."""
        return self._mode == "global"

    def apply(self, image: torch.Tensor, seed: int, out: torch.Tensor) -> None:
        """Transform ``image`` (HWC uint8) with a generator of ``seed`` into ``out`` ([3, H, W]
        view of the batch); TransformError when the transform fails (nothing useful written)."""
        generator = sample_generator(seed)
        if self._mode == "plain":
            result = self._call(image, generator)
        else:
            result = self._call_seeded(image, generator, seed)
        self._write(result, image, out)

    def _call(self, image: torch.Tensor, generator: torch.Generator) -> Any:
        """The transform's result; whatever it raises as a TransformError.

        BaseException, not Exception: a transform's ``sys.exit()`` (SystemExit) or stray
        KeyboardInterrupt would otherwise end the producer thread it runs on (`threading`
        drops SystemExit silently) and leave a server that accepts clients and never produces.
        On a producer thread these can only be the transform's own: Python runs signal
        handlers, so delivers a real Ctrl-C (or a handler's SystemExit), on the main thread
        only. There, where a caller runs `BatchProducer.produce` itself (a bench, a script),
        the two go through, so that a Ctrl-C still stops the caller.
        """
        try:
            return self.fn(image, generator)
        except BaseException as exc:
            if isinstance(exc, (KeyboardInterrupt, SystemExit)) and (
                threading.current_thread() is threading.main_thread()
            ):
                raise
            raise TransformError(
                f"transform {self.name} raised {type(exc).__name__}: {exc}"
            ) from exc

    def _call_seeded(self, image: torch.Tensor, generator: torch.Generator, seed: int) -> Any:
        """`_call` with the global RNGs seeded from ``seed`` (and restored after), one call at a
        time; while probing, watch whether it draws from them."""
        with GLOBAL_RNG_LOCK, seeded_global_rngs(seed ^ GLOBAL_SEED_MASK):
            before = global_rng_states() if self._mode == "probe" else None
            try:
                return self._call(image, generator)
            finally:
                if before is not None:
                    self._probed(global_rng_states() != before)

    def _probed(self, drew: bool) -> None:
        """One watched call done: switch to "global" (and warn, once) if it drew, or to
        "plain" after `PROBE_CALLS` calls that did not."""
        with self._lock:
            if self._mode != "probe":
                return
            self._probes += 1
            if drew:
                self._mode = "global"
            elif self._probes >= PROBE_CALLS:
                self._mode = "plain"
        if drew:
            log.warning(
                "transform %s draws from a global RNG (torch's default generator: torch.rand(...) "
                "without generator=; Python's random; NumPy's np.random): its output would "
                "differ between servers and runs. The server now runs it one call at a time "
                "with those RNGs seeded per sample, so its batches stay reproducible, but its "
                "calls no longer run in parallel. Fix: draw every random number from the "
                "generator argument (torch.rand(..., generator=generator)), or wrap a "
                "torchvision v2 transform in batchwire.pipeline.transforms.torchvision_v2",
                self.name,
            )

    def _write(self, result: Any, image: torch.Tensor, out: torch.Tensor) -> None:
        """Check ``result`` can be sent as it is (TransformError naming why not), then cast it
        into ``out``."""
        h, w = self.out_hw
        if not isinstance(result, torch.Tensor):
            raise TransformError(
                f"transform {self.name} returned a {type(result).__name__}, expected a "
                f"[3, {h}, {w}] tensor"
            )
        if result.is_nested or result.layout != torch.strided or result.is_quantized:
            # Before any look at its shape or values: these tensors have no dense sizes, or no
            # aminmax (`value_problem`), and would fail the whole batch instead of one sample.
            kind = "nested" if result.is_nested else "quantized" if result.is_quantized else ""
            raise TransformError(
                f"transform {self.name} returned a {kind or result.layout} tensor, expected a "
                f"dense [3, {h}, {w}] one"
            )
        if tuple(result.shape) != (3, h, w):
            raise TransformError(
                f"transform {self.name} returned shape {list(result.shape)}, expected [3, {h}, {w}]"
            )
        if result.device not in (image.device, out.device):
            raise TransformError(
                f"transform {self.name} returned a tensor on {result.device}, expected one on "
                f"{image.device} (the image's device)"
            )
        if result.is_complex():
            raise TransformError(f"transform {self.name} returned a {result.dtype} tensor")
        problem = value_problem(result, out.dtype, image)
        if problem is not None:
            raise TransformError(
                f"transform {self.name} returned {problem} for a {out.dtype} output"
            )
        # Values only: a result that requires grad (a transform built on a torch module) would
        # make the batch carry its autograd graph (`LocalLoader` yields that batch).
        result = result.detach()
        if out.dtype == torch.uint8 and result.is_floating_point():
            result = result.round().clamp_(0, 255)
        if out.is_cuda and not result.is_cuda:
            # Only a GPU server gets here: a trainer importing BatchMixer loads no decoder.
            from batchwire.pipeline.decode.fallback import upload

            result = upload(result, out.device)  # pinned and queued: a pageable copy waits
        out.copy_(result)

    def record_error(self, exc: TransformError, where: str) -> None:
        """Count one failure; log its traceback the first time this error is seen."""
        cause = exc.__cause__ or exc
        key = (type(cause).__name__, str(exc))
        with self._lock:
            self.errors_total += 1
            first = key not in self._seen and len(self._seen) < MAX_LOGGED_ERRORS
            if first:
                self._seen.add(key)
        if first:
            log.warning("%s on %s: replacing the sample", exc, where, exc_info=cause)
        else:
            log.debug("%s on %s: replacing the sample", exc, where)


# ---------------------------------------------------------------------------------------------
# The global RNGs: torchvision v2 (and any transform that draws from them)

#: Held while the global RNGs are seeded for a call: they are one per process. Reentrant: a
#: transform watched by its runner may itself be a `torchvision_v2` adapter.
GLOBAL_RNG_LOCK = threading.RLock()

#: The global RNGs' states: torch's default CPU generator, Python's `random`, NumPy's legacy
#: `np.random` (its state as a hashable tuple, so that two states compare with ``!=``).
RngStates = tuple[bytes, object, tuple[object, ...]]


def global_rng_states() -> RngStates:
    """The three global RNGs' states (about 40 µs; only watched calls take it)."""
    npst = np.random.get_state(legacy=False)
    assert isinstance(npst, dict)
    key = npst["state"]
    return (
        torch.default_generator.get_state().numpy().tobytes(),
        random.getstate(),
        (key["key"].tobytes(), key["pos"], npst["has_gauss"], npst["gauss"]),
    )


@contextmanager
def seeded_global_rngs(seed: int) -> Iterator[None]:
    """The global RNGs seeded with ``seed`` for the block, their states restored after. Hold
    `GLOBAL_RNG_LOCK` around it. Only torch's CPU generator: CUDA's are left alone."""
    saved_torch = torch.default_generator.get_state()
    saved_random = random.getstate()
    saved_np = np.random.get_state()
    try:
        torch.default_generator.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % (1 << 32))
        yield
    finally:
        torch.default_generator.set_state(saved_torch)
        random.setstate(saved_random)
        np.random.set_state(saved_np)


def torchvision_v2(t: Callable[[torch.Tensor], torch.Tensor]) -> Transform:
    """Adapt a torchvision-v2-style transform ``t(chw_uint8) -> chw`` to ``(image, generator)``.

    v2 transforms draw their parameters from torch's global RNG (and a few v1 ones from Python's
    `random`), which every thread shares. The adapter makes each call deterministic: under a
    process-wide lock it seeds the global CPU RNG, Python's `random` and NumPy's `np.random`
    with the sample's seed (``generator.initial_seed()``, itself a function of (seed, epoch,
    sample)), runs ``t`` and restores their states (`seeded_global_rngs`). Inside the lock no
    other adapter touches the global RNGs, so the draws ``t`` makes are exactly the sequence
    that seed yields, whichever thread or server runs it; the states are restored, so code
    outside is undisturbed. The cost: adapted transforms run one at a time per process (plain
    ``(image, generator)`` transforms do not lock). Requires ``t`` to take a CHW tensor (v2
    transforms do) and to run its random draws on the CPU generator.
    """

    def run(image: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        chw = image.permute(2, 0, 1)
        with GLOBAL_RNG_LOCK, seeded_global_rngs(generator.initial_seed()):
            return t(chw)

    run.__name__ = run.__qualname__ = f"torchvision_v2({transform_name(t)})"
    run.seeds_global_rngs = True  # type: ignore[attr-defined]  # its runner need not watch it
    return run


# ---------------------------------------------------------------------------------------------
# An example in plain torch: what the fused op does, as a user transform would write it


class RandomResizedCropFlip:
    """torchvision's RandomResizedCrop + RandomHorizontalFlip (+ optional normalisation) in
    plain torch, drawing from the sample's generator: the reference user transform (tests, the
    bench's "the fused op in Python" row, and a template to copy).

    Returns float [3, H, W] pixels in [0, 255] (the server rounds them for uint8 output), or
    ``(x / 255 - mean) / std`` when ``mean`` and ``std`` are given (for float output).
    """

    def __init__(
        self,
        size: int | tuple[int, int],
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3.0 / 4.0, 4.0 / 3.0),
        flip_prob: float = 0.5,
        mean: tuple[float, float, float] | None = None,
        std: tuple[float, float, float] | None = None,
    ) -> None:
        # Checked here, as torchvision checks them: a bad value would otherwise fail (or
        # divide by zero) sample by sample on the producer threads.
        pair: tuple = (size, size) if isinstance(size, numbers.Integral) else ()
        if isinstance(size, (tuple, list)):
            pair = tuple(size)
        if len(pair) != 2 or any(
            isinstance(v, bool) or not isinstance(v, numbers.Integral) for v in pair
        ):
            raise ValueError(f"size must be PX or (H, W) integers, got {size!r}")
        if min(pair) < 1:
            raise ValueError(f"size must be >= 1, got {size!r}")
        for name, (lo, hi) in (("scale", scale), ("ratio", ratio)):
            if not 0 < lo <= hi or not math.isfinite(hi):
                raise ValueError(f"{name} must be (low, high) with 0 < low <= high, got {(lo, hi)}")
        if not 0.0 <= flip_prob <= 1.0:
            raise ValueError(f"flip_prob must be in [0, 1], got {flip_prob}")
        if (mean is None) != (std is None):
            raise ValueError("mean and std go together: give both, or neither")
        if std is not None and (len(std) != 3 or min(std) <= 0):
            raise ValueError(f"std must be three values > 0, got {std!r}")
        if mean is not None and len(mean) != 3:
            raise ValueError(f"mean must be three values, got {mean!r}")
        self.size = (int(pair[0]), int(pair[1]))
        self.scale = scale
        self.ratio = ratio
        self.flip_prob = flip_prob
        self.mean = None if mean is None else torch.tensor(mean).view(3, 1, 1) * 255.0
        self.std = None if std is None else torch.tensor(std).view(3, 1, 1) * 255.0

    def box(self, height: int, width: int, g: torch.Generator) -> tuple[int, int, int, int]:
        """(top, left, h, w) as RandomResizedCrop.get_params, drawn from ``g``."""
        import math

        area = height * width
        log_lo, log_hi = math.log(self.ratio[0]), math.log(self.ratio[1])
        for _ in range(10):
            target = area * float(torch.empty(1).uniform_(*self.scale, generator=g))
            aspect = math.exp(float(torch.empty(1).uniform_(log_lo, log_hi, generator=g)))
            w = round(math.sqrt(target * aspect))
            h = round(math.sqrt(target / aspect))
            if 0 < w <= width and 0 < h <= height:
                top = int(torch.randint(0, height - h + 1, (1,), generator=g))
                left = int(torch.randint(0, width - w + 1, (1,), generator=g))
                return top, left, h, w
        in_ratio = width / height
        if in_ratio < self.ratio[0]:
            w, h = width, round(width / self.ratio[0])
        elif in_ratio > self.ratio[1]:
            h, w = height, round(height * self.ratio[1])
        else:
            h, w = height, width
        return (height - h) // 2, (width - w) // 2, h, w

    def __call__(self, image: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        top, left, h, w = self.box(int(image.shape[0]), int(image.shape[1]), generator)
        crop = image[top : top + h, left : left + w].permute(2, 0, 1).unsqueeze(0).float()
        out = torch.nn.functional.interpolate(
            crop, size=self.size, mode="bilinear", align_corners=False, antialias=True
        )[0]
        if float(torch.rand(1, generator=generator)) < self.flip_prob:
            out = out.flip(-1)
        if self.mean is not None and self.std is not None:
            out = (out - self.mean) / self.std
        return out
