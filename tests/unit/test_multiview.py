"""Multi-view crops (issue 22), in-process: the --views spelling, planning per view, the batch
spec and its wire form, and LocalLoader's views against the fused op called by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from batchwire import native, wire
from batchwire.client.staging import BatchFormat, CpuStager
from batchwire.pipeline.augment_plan import (
    NUM_DRAWS,
    VIEW_SALT,
    AugmentConfig,
    View,
    draw_uniforms,
    parse_views,
    plan_arrays,
    plan_samples,
)
from batchwire.pipeline.decode import decode_full, read_header
from batchwire.pipeline.local import LocalLoader
from batchwire.server.config import ServerConfig, config_from_toml
from batchwire.wire import BatchHeader, BatchSpec, ProtocolError, Welcome

VIEWS = "2x32:0.4-1.0,3x16:0.05-0.4"


def test_the_views_spelling_expands_in_order() -> None:
    views = parse_views("2x224:0.4-1.0,6x96:0.05-0.4")
    assert len(views) == 8
    assert views[:2] == (View((224, 224), (0.4, 1.0)),) * 2
    assert views[2:] == (View((96, 96), (0.05, 0.4)),) * 6
    assert parse_views("1x160x224:0.3-0.9") == (View((160, 224), (0.3, 0.9)),)


@pytest.mark.parametrize(
    "text", ["", "2x224", "2x:0.1-1", "ax224:0.1-1", "2x224:0.1", "2x1x2x3:0.1-1", "2x224:0-1"]
)
def test_a_bad_views_spelling_is_a_value_error_naming_the_form(text: str) -> None:
    with pytest.raises(ValueError, match="views"):
        parse_views(text)


def test_views_live_in_the_config_file_and_refuse_a_transform(tmp_path) -> None:
    path = tmp_path / "server.toml"
    path.write_text(f'train = "/data"\nviews = "{VIEWS}"\n')
    config = ServerConfig(**config_from_toml(path))
    spec = config.batch_spec()
    assert spec.views == ((32, 32), (32, 32), (16, 16), (16, 16), (16, 16))
    assert config.augment(train=False).views == config.augment(train=True).views
    with pytest.raises(ValueError, match="views cannot be combined with a user transform"):
        ServerConfig(train="/data", views=VIEWS, transform="m:f")
    with pytest.raises(ValueError, match="cannot read"):
        ServerConfig(train="/data", views="2x32")


def test_views_draw_with_their_own_salts_and_one_view_is_unchanged() -> None:
    plain = AugmentConfig(image_size=32, train=True, brightness=0.4)
    multi = AugmentConfig(image_size=32, train=True, brightness=0.4, views=VIEWS)
    idx, hs, ws = [3, 7, 11], [200, 300, 120], [150, 180, 400]
    # The single-view plan is what salt 0 gives, as before views existed.
    u = draw_uniforms(5, 2, idx, NUM_DRAWS)
    boxes, flips, _ = plan_arrays(plain, 5, 2, idx, hs, ws)
    assert np.array_equal(flips, u[:, 40] < 0.5)
    assert np.array_equal(boxes, plan_arrays(multi, 5, 2, idx, hs, ws)[0])  # views aside
    plans = [plan_arrays(multi, 5, 2, idx, hs, ws, view=k) for k in range(5)]
    for k, (b, f, _) in enumerate(plans):
        uk = draw_uniforms(5, 2, idx, NUM_DRAWS, salt=VIEW_SALT + k)
        assert np.array_equal(f, uk[:, 40] < 0.5)
        assert not np.array_equal(b, boxes)
        # A view's plan is per sample: planning one sample alone gives the same.
        alone = plan_samples(multi, 5, 2, [idx[1]], [hs[1]], [ws[1]], view=k)[0]
        assert alone.box == tuple(b[1].tolist())
    # The local views (scale <= 0.4) are smaller crops than the global ones (>= 0.4).
    area = [((b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])).tolist() for b, _, _ in plans]
    for s in range(3):
        assert max(area[k][s] for k in (2, 3, 4)) <= min(area[k][s] for k in (0, 1)) * 1.05
    with pytest.raises(ValueError, match="out of range"):
        plan_arrays(multi, 5, 2, idx, hs, ws, view=5)


def test_a_multi_view_spec_lays_its_views_back_to_back() -> None:
    spec = BatchSpec(4, 32, 32, "uint8", "nhwc", ((32, 32), (16, 24)))
    assert spec.nbytes == 4 * 3 * (32 * 32 + 16 * 24)
    flat = torch.arange(spec.nbytes, dtype=torch.int64).to(torch.uint8)
    v0, v1 = spec.view_bytes(flat)
    assert list(v0.shape) == [4, 3, 32, 32] and list(v1.shape) == [4, 3, 16, 24]
    assert v0.is_contiguous(memory_format=torch.channels_last)
    assert v1.data_ptr() == flat.data_ptr() + 4 * 3 * 32 * 32
    spec.check([v0, v1])
    with pytest.raises(ValueError):
        spec.check(v0)
    with pytest.raises(ProtocolError, match="first view"):
        BatchSpec(4, 32, 32, "uint8", views=((16, 16), (32, 32)))


def test_welcome_and_header_carry_the_views_and_single_view_maps_are_unchanged() -> None:
    views = [[32, 32], [16, 16]]
    w = Welcome(1, 10, 160, 16, [16, 3, 32, 32], "uint8", "nchw", [0.0] * 3, [1.0] * 3, 10)
    assert "views" not in w.to_map()  # the map older peers know
    wv = Welcome(
        1, 10, 160, 16, [16, 3, 32, 32], "uint8", "nchw", [0.0] * 3, [1.0] * 3, 10, [], views
    )
    back = wire.decode_server_message(wv.pack())
    assert back == wv and back.spec.views == ((32, 32), (16, 16))
    nbytes = wv.spec.nbytes
    h = BatchHeader(1, "train", 0, 0, [16, 3, 32, 32], "uint8", "nchw", [0] * 16, 0, nbytes, views)
    assert wire.decode_server_message(h.pack()) == h
    single = BatchHeader(1, "train", 0, 0, [16, 3, 32, 32], "uint8", "nchw", [0] * 16, 0, nbytes)
    with pytest.raises(ProtocolError, match="nbytes"):
        wire.decode_server_message(single.pack())
    bad = BatchHeader(
        1,
        "train",
        0,
        0,
        [16, 3, 32, 32],
        "uint8",
        "nchw",
        [0] * 16,
        0,
        nbytes,
        [[16, 16], [32, 32]],
    )
    with pytest.raises(ProtocolError, match="views"):
        wire.decode_server_message(bad.pack())


def test_the_cpu_stager_normalises_each_view() -> None:
    spec = BatchSpec(2, 8, 8, "uint8", "nchw", ((8, 8), (4, 4)))
    fmt = BatchFormat(spec, True, torch.float32, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    stager = CpuStager(fmt, 2)
    raw = torch.randint(0, 256, (spec.nbytes,), dtype=torch.uint8)

    class Frame:
        def __init__(self, data: bytes) -> None:
            self.buffer = memoryview(bytearray(data))

    h = BatchHeader(
        1, "train", 0, 0, spec.shape, "uint8", "nchw", [0, 1], 0, spec.nbytes, [[8, 8], [4, 4]]
    )
    labels = Frame(np.array([3, 4], dtype="<i8").tobytes())
    staged = stager.stage_frames(h, Frame(raw.numpy().tobytes()), labels)
    stager.hand_out(staged)
    v0, v1 = staged.images
    assert v0.shape == (2, 3, 8, 8) and v1.shape == (2, 3, 4, 4)
    want0, want1 = spec.view_bytes(raw)
    torch.testing.assert_close(v0, (want0.float() / 255 - 0.5) / 0.25)
    torch.testing.assert_close(v1, (want1.float() / 255 - 0.5) / 0.25)


@pytest.mark.timeout(120)
def test_each_local_view_is_the_fused_op_on_that_views_crop() -> None:
    """The oracle of the e2e tests, checked: decode the file whole, plan view k, run the op."""
    with LocalLoader(
        None, batch_size=4, image_size=32, seed=3, views=VIEWS, output_dtype="uint8",
        with_indices=True, brightness=0.3, hue=0.1,
    ) as local:  # fmt: skip
        local.set_epoch(2)
        views, labels, indices = next(iter(local))
        config, ds = local.config, local.dataset
    mean = torch.tensor(config.mean)
    std = torch.tensor(config.std)
    for s, index in enumerate(indices.tolist()):
        data = ds.read_bytes(index)
        header = read_header(data)
        image = torch.from_numpy(np.ascontiguousarray(decode_full(data)))
        assert labels[s] == ds.labels[index]
        for k, got in enumerate(views):
            plan = plan_samples(config, 3, 2, [index], [header.height], [header.width], view=k)[0]
            out = torch.empty((1, *got.shape[1:]), dtype=torch.uint8)
            native.augment_batch(
                [image],
                torch.tensor([plan.box], dtype=torch.float32),
                torch.tensor([plan.flip]),
                torch.tensor([plan.jitter], dtype=torch.float32),
                mean,
                std,
                out,
            )
            assert torch.equal(got[s], out[0]), f"sample {s} view {k}"
