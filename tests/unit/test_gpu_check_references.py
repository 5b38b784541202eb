"""The GPU check's decode references (bench/gpu_check.py), on the CPU.

nvJPEG replicates chroma samples where libjpeg-turbo smooths them, so the GPU check measures each
GPU image against the closer of libjpeg-turbo's two upsamplings. These cases pin what that
comparison accepts and refuses, with pixels libjpeg-turbo itself made in each role.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from batchwire.bench.gpu_check import mean_diff_to_closer_reference, replicated_chroma_reference
from batchwire.pipeline.decode import decode_full
from batchwire.pipeline.decode.orientation import apply_orientation
from oddfiles import exif_jpeg, smooth_image
from turbojpeg import TJFLAG_FASTUPSAMPLE, TJPF_RGB, TurboJPEG


@pytest.mark.parametrize("orientation", [1, 3, 6, 8])
def test_the_replicated_reference_is_the_oriented_fast_upsampled_decode(orientation: int) -> None:
    data = exif_jpeg(smooth_image(64, 96, seed=5), orientation)
    ref = replicated_chroma_reference(data)
    stored = TurboJPEG().decode(data, pixel_format=TJPF_RGB, flags=TJFLAG_FASTUPSAMPLE)
    assert ref is not None
    assert np.array_equal(ref, apply_orientation(stored, orientation))
    assert ref.shape == decode_full(data).shape  # oriented as the decoders orient it


def test_a_replicated_chroma_image_passes_and_a_mistake_does_not() -> None:
    data = exif_jpeg(smooth_image(64, 96, seed=5), 1)
    default = torch.from_numpy(decode_full(data))
    replicated = replicated_chroma_reference(data)
    as_nvjpeg = torch.from_numpy(replicated.copy())
    # Against the default decode alone it is levels off (2.4378 with libjpeg-turbo 2.1.5 here and
    # for nvJPEG on the H200).
    assert (as_nvjpeg.int() - default.int()).abs().float().mean().item() > 1.0
    mean, most = mean_diff_to_closer_reference(as_nvjpeg, default, replicated)
    assert mean == 0.0 and most > 0
    swapped = as_nvjpeg.flip(-1)  # BGR served as RGB
    flipped = as_nvjpeg.flip(1)  # a missed mirror
    for wrong in (swapped, flipped):
        assert mean_diff_to_closer_reference(wrong, default, replicated)[0] > 10.0


def test_a_file_turbojpeg_cannot_decode_has_no_second_reference() -> None:
    assert replicated_chroma_reference(b"\xff\xd8\xff\xe0 not a jpeg") is None
