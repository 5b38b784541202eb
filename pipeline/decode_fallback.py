"""The CPU safety net shared by the GPU-side decoders (DALI, nvJPEG).

A GPU decoder hands every image it could not or would not decode (not a JPEG, too large for the
GPU memory bound, rejected by the library, a corrupt file that made a whole batch fail) to the
CPU decoder, one image at a time, so one bad file never fails a batch. Each such image is
counted and logged once per dataset index, so a dataset with a few odd files says so without
flooding the log every epoch.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import torch
from batchwire.pipeline.decode import CpuBatchDecoder, DecodeRequest, DecodeResult

log = logging.getLogger("batchwire.pipeline")


class CpuFallback:
    """Decodes requests on a `CpuBatchDecoder` and moves the pixels to `device`.

    `fallbacks` counts images handed over; `failures` counts those the CPU could not decode
    either (their results carry `image=None` and the error).
    """

    def __init__(self, owner: str, device: torch.device, threads: int) -> None:
        self.owner = owner
        self.device = device
        self.threads = max(1, int(threads))
        self._cpu: CpuBatchDecoder | None = None
        self._lock = threading.Lock()
        self._logged: set[int] = set()
        self.fallbacks = 0
        self.failures = 0

    def _decoder(self) -> CpuBatchDecoder:
        with self._lock:
            if self._cpu is None:
                self._cpu = CpuBatchDecoder(self.threads)
            return self._cpu

    def decode(
        self,
        requests: Sequence[DecodeRequest],
        reasons: Sequence[str],
        routine: Sequence[bool] | None = None,
    ) -> list[DecodeResult]:
        """CPU-decode `requests` (why each one is here: `reasons`), results in request order.

        `routine[i]` marks an image sent here by design (not a JPEG, over the GPU bound): it is
        logged at DEBUG unless the CPU fails too; the rest (rejected by the GPU decoder) at
        WARNING, once per dataset index.
        """
        if not requests:
            return []
        results = self._decoder().decode_batch(requests)
        out: list[DecodeResult] = []
        with self._lock:
            self.fallbacks += len(requests)
            flags = routine if routine is not None else [False] * len(requests)
            for req, reason, quiet, res in zip(requests, reasons, flags, results, strict=True):
                if res.image is None:
                    self.failures += 1
                if req.index not in self._logged:
                    self._logged.add(req.index)
                    outcome = "decoded on the CPU" if res.image is not None else res.error
                    level = logging.DEBUG if quiet and res.image is not None else logging.WARNING
                    log.log(
                        level,
                        "%s decoder: image %d (%s): %s",
                        self.owner,
                        req.index,
                        reason,
                        outcome,
                    )
        for res in results:
            if res.image is not None and res.image.device != self.device:
                res = DecodeResult(image=res.image.to(self.device), box=res.box, error=None)
            out.append(res)
        return out

    def close(self) -> None:
        with self._lock:
            if self._cpu is not None:
                self._cpu.close()
                self._cpu = None
