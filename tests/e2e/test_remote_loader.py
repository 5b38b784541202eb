"""RemoteLoader against a real pipeline-server process on the embedded dataset.

One server (32 px, batch 16, uint8 wire) serves every test of this module; loaders are closed
(bye) before the next test so clients of different world sizes never overlap on a split. It
serves the embedded val folder (400 real JPEGs) as both splits: short epochs, same code paths.
Its --mean/--std are not ImageNet's, so a loader normalising with the server's statistics is
told apart from one using the usual constants.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from batchwire.client import LoaderError, RemoteLoader, ServerError, ServerUnavailable
from batchwire.pipeline.dataset import open_dataset
from batchwire.pipeline.local import LocalLoader
from batchwire.pipeline.sampler import ShardSampler
from batchwire.pipeline.synthetic import default_dataset
from serverproc import free_tcp_endpoint, running_server
from torch.utils.data import DataLoader

B = 16
PX = 32
SEED = 7
SERVER_MEAN = (0.5, 0.45, 0.4)  # the server's --mean/--std (welcome), not ImageNet's
SERVER_STD = (0.25, 0.24, 0.23)


@pytest.fixture(scope="module")
def data_root() -> str:
    return str(default_dataset().val_root)


@pytest.fixture(scope="module")
def server(data_root):
    with running_server(
        "--train",
        data_root,
        "--val",
        data_root,
        "--batch-size",
        str(B),
        "--image-size",
        str(PX),
        "--output-dtype",
        "uint8",
        "--workers",
        "1",
        "--seed",
        str(SEED),
        "--mean",
        ",".join(map(str, SERVER_MEAN)),
        "--std",
        ",".join(map(str, SERVER_STD)),
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def datasets(data_root):
    ds = open_dataset(data_root)
    return {"train": ds, "val": ds}


def collect(loader, limit: int | None = None) -> list[tuple[torch.Tensor, ...]]:
    """Iterate (at most ``limit`` batches), cloning each batch so it outlives the loader."""
    out = []
    for batch in loader:
        out.append(tuple(t.clone() for t in batch))
        if limit is not None and len(out) == limit:
            break
    return out


def assert_same(a: list[tuple[torch.Tensor, ...]], b: list[tuple[torch.Tensor, ...]]) -> None:
    assert len(a) == len(b)
    for k, (x, y) in enumerate(zip(a, b, strict=True)):
        for tx, ty in zip(x, y, strict=True):
            assert torch.equal(tx, ty), f"batch {k} differs"


@pytest.fixture(scope="module")
def reference(server):
    """Rank 0 of 1, epoch 0, with indices: the uninterrupted run other tests compare to."""
    with RemoteLoader(
        server.endpoint, "train", rank=0, world_size=1, device="cpu", with_indices=True, timeout=30
    ) as loader:
        return collect(loader)


@pytest.fixture(scope="module")
def raw_reference(server):
    """`reference`'s batches as the wire carries them: uint8, as the loader yields on request."""
    with RemoteLoader(
        server.endpoint,
        "train",
        rank=0,
        world_size=1,
        device="cpu",
        with_indices=True,
        timeout=30,
        normalize_on_device=False,
    ) as loader:
        return collect(loader)


class UserNet(torch.nn.Module):
    """A plain float model, as a training script written for torch's DataLoader has it."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, stride=2)
        self.head = torch.nn.Linear(8, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.adaptive_avg_pool2d(F.relu(self.conv(x)), 1).flatten(1))


@pytest.mark.timeout(60)
def test_default_is_a_drop_in_for_a_dataloader_with_normalize(server, raw_reference):
    """Issue 29: code written for ``DataLoader(ToTensor + Normalize)`` with RemoteLoader swapped
    in, as users wrote it before the server's default wire became uint8, runs unchanged: the
    loader yields float32 normalised with the server's mean/std on its device, equal to the
    uint8 wire normalised by hand (it stopped at the first forward: "Input type (unsigned
    char) and bias type (float) should be the same")."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = UserNet(num_classes=10).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = RemoteLoader(server.endpoint, "train", batch_size=B)
    seen = []
    try:
        for images, labels in loader:  # the user's loop, unchanged
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            seen.append(images.clone().cpu())
            if len(seen) == 3:
                break
        welcome = loader.server_info()
    finally:
        loader.close()  # a failed run leaves no session behind for the next tests
    assert images.dtype == torch.float32 and images.device.type == torch.device(device).type
    assert tuple(welcome.mean) == pytest.approx(SERVER_MEAN)
    mean = torch.tensor(welcome.mean).view(1, 3, 1, 1)
    std = torch.tensor(welcome.std).view(1, 3, 1, 1)
    for k, (got, (raw, _, _)) in enumerate(zip(seen, raw_reference, strict=False)):
        expected = (raw.float() / 255 - mean) / std
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5, msg=f"batch {k}")
    pixels = torch.cat(seen)
    assert abs(float(pixels.mean())) < 0.5 and 0.6 < float(pixels.std()) < 1.6, (
        f"not in the normalised range: mean {float(pixels.mean()):.3f}, "
        f"std {float(pixels.std()):.3f}"
    )


@pytest.mark.timeout(60)
def test_uint8_opt_out_yields_the_raw_wire(server, data_root, raw_reference):
    """``normalize_on_device=False``, as users who wanted the raw wire already passed it: uint8
    [B, 3, H, W] in 0..255, exactly the pipeline's own uint8 batches (LocalLoader, no server)."""
    with LocalLoader(
        data_root, batch_size=B, image_size=PX, seed=SEED, output_dtype="uint8", with_indices=True
    ) as local:
        want = collect(local, limit=3)
    for (images, labels, indices), (w_images, w_labels, w_indices) in zip(
        raw_reference, want, strict=False
    ):
        assert images.dtype == torch.uint8 and images.shape == (B, 3, PX, PX)
        assert torch.equal(images, w_images) and torch.equal(labels, w_labels)
        assert torch.equal(indices, w_indices)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_disjoint_complete_and_labelled(server, datasets, world_size):
    ds = datasets["train"]
    per_rank = []
    for rank in range(world_size):
        with RemoteLoader(
            server.endpoint,
            "train",
            rank=rank,
            world_size=world_size,
            device="cpu",
            with_indices=True,
            timeout=30,
        ) as loader:
            batches = collect(loader)
            assert len(loader) == len(batches)
            assert loader.num_samples == len(ds) and loader.num_classes == ds.num_classes
        per_rank.append(batches)

    counts = {len(b) for b in per_rank}
    assert len(counts) == 1, f"unequal batch counts per rank: {[len(b) for b in per_rank]}"
    n = counts.pop()
    assert n == len(ds) // (B * world_size)
    seen = []
    for batches in per_rank:
        for images, labels, indices in batches:
            assert images.shape == (B, 3, PX, PX) and images.dtype == torch.float32
            assert labels.dtype == torch.int64 and indices.dtype == torch.int64
            assert (indices >= 0).all(), "the train split has no padding"
            np.testing.assert_array_equal(labels.numpy(), ds.labels[indices.numpy()])
            seen.extend(indices.tolist())
    assert len(seen) == len(set(seen)) == n * B * world_size, "ranks overlap"
    sampler = ShardSampler(
        len(ds), B, seed=SEED, shuffle=True, drop_last=True, world_size=world_size
    )
    assert set(seen) == set(sampler.epoch_order(0)[: n * B * world_size].tolist())


@pytest.mark.timeout(60)
def test_two_runs_are_bit_identical_and_epochs_differ(server, reference):
    with RemoteLoader(
        server.endpoint, "train", rank=0, world_size=1, device="cpu", with_indices=True
    ) as loader:
        assert_same(collect(loader), reference)
        loader.set_epoch(1)
        epoch1 = collect(loader, limit=3)
    assert not torch.equal(epoch1[0][2], reference[0][2]), "epoch 1 repeats epoch 0's order"


@pytest.mark.timeout(60)
def test_resume_mid_epoch_yields_exactly_the_rest(server, reference):
    k = 7
    with RemoteLoader(
        server.endpoint, "train", rank=0, world_size=1, device="cpu", with_indices=True, prefetch=3
    ) as first:
        assert_same(collect(first, limit=k), reference[:k])
        state = first.state_dict()
    assert state["epoch"] == 0 and state["next_batch"] == k

    with RemoteLoader(
        server.endpoint, "train", rank=0, world_size=1, device="cpu", with_indices=True
    ) as resumed:
        resumed.load_state_dict(state)
        resumed.set_epoch(0)  # the trainer's usual loop must not reset the position
        assert_same(collect(resumed), reference[k:])
        assert resumed.state_dict()["next_batch"] == len(reference)


@pytest.mark.timeout(60)
def test_resume_against_a_server_with_another_batch_size_is_refused(server, data_root):
    """A mid-epoch position means nothing for another batch size: a clear error, asked twice,
    rather than an epoch that silently repeats some samples and skips others."""
    with RemoteLoader(server.endpoint, "train", rank=0, world_size=1, device="cpu") as first:
        collect(first, limit=3)
        state = first.state_dict()
    assert state["epoch_shape"]["batch_size"] == B
    args = ("--train", data_root, "--batch-size", str(B // 2), "--image-size", str(PX))
    with (
        running_server(*args, "--workers", "1", "--seed", str(SEED)) as other,
        RemoteLoader(other.endpoint, "train", rank=0, world_size=1, device="cpu") as resumed,
    ):
        resumed.load_state_dict(state)
        for _ in range(2):
            with pytest.raises(ValueError, match="cannot resume epoch 0 at batch 3"):
                next(iter(resumed))
        # A state saved before the key was renamed ("stream") is checked the same way.
        old = {k: v for k, v in state.items() if k != "epoch_shape"}
        resumed.load_state_dict({**old, "stream": state["epoch_shape"]})
        with pytest.raises(ValueError, match="cannot resume epoch 0 at batch 3"):
            next(iter(resumed))
        # From an epoch boundary any epoch shape will do.
        resumed.set_epoch(1)
        images, _ = next(iter(resumed))
        assert images.shape[0] == B // 2


@pytest.mark.timeout(60)
def test_every_iter_is_a_fresh_pass_unless_a_state_positioned_it(server, reference):
    """DataLoader semantics: a loop that breaks early and iterates again starts over (Lightning's
    sanity check takes two val batches, then validation must still see every image)."""
    with RemoteLoader(
        server.endpoint, "train", rank=0, world_size=1, device="cpu", with_indices=True
    ) as loader:
        head = collect(loader, limit=5)
        again = collect(loader)
        # A full pass ended: iterated again without set_epoch, a train loader would move on to
        # epoch 1 (test_remote_loader_epochs); an explicit set_epoch keeps epoch 0.
        loader.set_epoch(0)
        replay = collect(loader, limit=2)
        loader.load_state_dict({**loader.state_dict(), "next_batch": 5})
        positioned = collect(loader)
        loader.set_epoch(0)
        after = collect(loader, limit=1)  # the restored position served one pass only
    assert_same(head, reference[:5])
    assert_same(again, reference)
    assert_same(replay, reference[:2])
    assert_same(positioned, reference[5:])
    assert_same(after, reference[:1])
    it = iter(loader)  # a closed loader reconnects when iterated again ...
    next(it)
    loader.close()
    with pytest.raises(LoaderError, match="closed"):  # ... but an iterator it closed under stops
        next(it)


@pytest.mark.timeout(60)
def test_under_dataloader(server, reference):
    loader = RemoteLoader(
        server.endpoint, "train", rank=0, world_size=1, device="cpu", with_indices=True
    )
    try:
        assert len(DataLoader(loader, batch_size=None)) == len(reference)
        assert_same(collect(DataLoader(loader, batch_size=None)), reference)
        with pytest.raises(LoaderError, match="num_workers=0"):
            next(iter(DataLoader(loader, batch_size=None, num_workers=1)))
    finally:
        loader.close()


@pytest.mark.timeout(60)
def test_val_split_pads_with_minus_one_and_covers_every_image_once(server, datasets):
    ds = datasets["val"]
    world_size = 3
    valid, padding = [], 0
    for rank in range(world_size):
        with RemoteLoader(
            server.endpoint,
            "val",
            rank=rank,
            world_size=world_size,
            device="cpu",
            with_indices=True,
        ) as loader:
            for images, labels, indices in loader:
                assert images.shape == (B, 3, PX, PX)
                keep = indices >= 0
                padding += int((~keep).sum())
                np.testing.assert_array_equal(
                    labels[keep].numpy(), ds.labels[indices[keep].numpy()]
                )
                valid.extend(indices[keep].tolist())
    per_round = B * world_size
    assert padding == -len(ds) % per_round > 0
    assert sorted(valid) == list(range(len(ds)))


@pytest.mark.timeout(60)
def test_normalize_on_device_matches_the_formula(server, raw_reference):
    """``x * scale + bias`` in float32 with scale = 1/(255 std), bias = -mean/std (both
    rounded from double, the server's own affine form): exactly, then rounded to ``dtype``;
    and within float32 rounding of the textbook ``(x / 255 - mean) / std``."""
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    scale = (1 / (255 * std.double())).float()
    bias = (-mean.double() / std.double()).float()
    expected = raw_reference[0][0].float() * scale + bias
    textbook = (raw_reference[0][0].float() / 255 - mean) / std
    torch.testing.assert_close(expected, textbook, rtol=0, atol=1e-6)
    for dtype in (torch.float32, torch.bfloat16):
        with RemoteLoader(
            server.endpoint,
            "train",
            rank=0,
            world_size=1,
            device="cpu",
            normalize_on_device=True,
            dtype=dtype,
            mean=mean.flatten().tolist(),
            std=std.flatten().tolist(),
        ) as loader:
            images, labels = next(iter(loader))
        assert images.dtype == dtype and images.shape == (B, 3, PX, PX)
        torch.testing.assert_close(images, expected.to(dtype), rtol=0, atol=0)
        assert torch.equal(labels, raw_reference[0][1])


@pytest.mark.timeout(60)
def test_cpu_batches_are_never_overwritten_while_referenced(server, raw_reference):
    """Normalised CPU batches come from recycled buffers: keeping every batch (or just a view
    of it) must keep them intact, and a trainer that drops each batch reuses a few buffers."""
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    scale = (1 / (255 * std.double())).float()
    bias = (-mean.double() / std.double()).float()
    expected = [raw.float() * scale + bias for raw, _, _ in raw_reference]
    kw = dict(rank=0, world_size=1, device="cpu", normalize_on_device=True, prefetch=2)
    kw.update(mean=mean.flatten().tolist(), std=std.flatten().tolist())
    with RemoteLoader(server.endpoint, "train", **kw) as loader:
        kept = [images for images, _ in loader]  # whole batches, no clone
        loader.set_epoch(0)  # the same epoch again (else the loader moves on by itself)
        views = [images[1:3] for images, _ in loader]  # only views of each batch survive
        for images, _ in loader:  # the usual loop: nothing kept
            del images
        pool = loader._receiver.stager._outputs[0]  # white-box: recycling really happens
    for k, (batch, view) in enumerate(zip(kept, views, strict=True)):
        assert torch.equal(batch, expected[k]), f"kept batch {k} was overwritten"
        assert torch.equal(view, expected[k][1:3]), f"view of batch {k} was overwritten"
    allocated_by_keeping = 2 * len(raw_reference)
    assert pool.allocated < allocated_by_keeping + 8, "buffers are not reused once dropped"


@pytest.mark.timeout(60)
def test_stats_travel_with_credits(server):
    with RemoteLoader(server.endpoint, "train", rank=0, world_size=1, device="cpu") as loader:
        it = iter(loader)
        for _ in range(6):
            next(it)
        mine = loader.stats()
        assert mine is not None and mine["images_per_s"] > 0
        assert set(mine) >= {"prefetch_depth", "wait_s_per_batch", "data_wait_fraction"}
        rows = [c for c in server.stats()["clients"] if c["loader"] is not None]
        assert rows, f"no loader stats reached the server: {server.stats()['clients']}"
        assert rows[0]["loader"]["images_per_s"] > 0
    # close() says bye: the server forgets the stream at once, not after its client timeout
    deadline = time.monotonic() + 5
    while server.stats()["clients"] and time.monotonic() < deadline:
        pass
    assert server.stats()["clients"] == []


@pytest.mark.timeout(60)
def test_server_error_reply_becomes_an_exception(server):
    with (
        RemoteLoader(
            server.endpoint, "no-such-split", rank=0, world_size=1, device="cpu"
        ) as loader,
        pytest.raises(ServerError, match="no-such-split"),
    ):
        len(loader)


@pytest.mark.timeout(60)
def test_world_size_mismatch_is_refused_with_both_sizes(server):
    """The refusal clears by itself once the other world size's session goes ("busy"): the
    loader asks again until its timeout, then says what it waited for, naming both sizes."""
    with RemoteLoader(server.endpoint, "val", rank=0, world_size=2, device="cpu") as a:
        next(iter(a))  # a live stream of world_size 2
        with (
            RemoteLoader(
                server.endpoint, "val", rank=0, world_size=5, device="cpu", timeout=2.0
            ) as b,
            pytest.raises(
                ServerUnavailable, match=r"world_size=5, but client \w+ \(rank 0 of world_size=2"
            ),
        ):
            len(b)


@pytest.mark.timeout(30)
def test_no_server_raises_naming_the_endpoint_within_the_timeout():
    endpoint = free_tcp_endpoint()
    loader = RemoteLoader(endpoint, "train", rank=0, world_size=1, device="cpu", timeout=1.0)
    t0 = time.monotonic()
    with pytest.raises(ServerUnavailable, match=endpoint) as info:
        len(loader)
    assert time.monotonic() - t0 < 3.0
    assert isinstance(info.value, TimeoutError) and isinstance(info.value, ConnectionError)
    with pytest.raises(ServerUnavailable, match=endpoint):
        next(iter(DataLoader(loader, batch_size=None)))
    loader.close()


def test_state_dict_of_another_split_is_refused_but_any_rank_and_world_restores():
    loader = RemoteLoader("tcp://127.0.0.1:9", "train", rank=1, world_size=2, device="cpu")
    state = loader.state_dict()
    assert state == {
        "epoch": 0, "next_batch": 0, "split": "train", "rank": 1, "world_size": 2,
        "start_sample": 0, "epoch_world_size": 2,
    }  # fmt: skip
    # Another world size resumes (elastic, tests/e2e/test_elastic.py); mid-epoch it needs the
    # batch size, recorded once the loader has connected.
    loader.load_state_dict({**state, "world_size": 4})
    with pytest.raises(ValueError, match="batch size"):
        loader.load_state_dict({**state, "world_size": 4, "next_batch": 3})
    with pytest.raises(ValueError, match="split"):
        loader.load_state_dict({**state, "split": "val"})
    with pytest.raises(ValueError, match="missing"):
        loader.load_state_dict({"epoch": 1})
    # A framework's checkpoint holds rank 0's state only: it restores on rank 1 too.
    loader.load_state_dict({**state, "rank": 0, "epoch": 3, "next_batch": 5})
    assert (loader.epoch, loader.next_batch) == (3, 5)
    loader.close()


def test_constructor_rejects_bad_arguments():
    with pytest.raises(ValueError, match="endpoints"):
        RemoteLoader("localhost:5555")
    with pytest.raises(ValueError, match="rank"):
        RemoteLoader("tcp://127.0.0.1:9", rank=2, world_size=2)
    with pytest.raises(ValueError, match="prefetch"):
        RemoteLoader("tcp://127.0.0.1:9", rank=0, world_size=1, prefetch=0)
    with pytest.raises(ValueError, match="dtype"):
        RemoteLoader("tcp://127.0.0.1:9", rank=0, world_size=1, dtype=torch.int32)
    loader = RemoteLoader(["tcp://127.0.0.1:9", "tcp://*:5555"], rank=0, world_size=1, device="cpu")
    with pytest.raises(ValueError, match=r"cannot connect to 'tcp://\*:5555'"):
        len(loader)


@pytest.mark.timeout(90)
def test_float16_nhwc_wire_and_normalize_refused_on_a_float_wire(data_root, raw_reference):
    """A float16, channels_last wire: the same pixels as the uint8 run, normalised by the
    server; asking the loader to normalise a float wire again is a clear error."""
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    with running_server(
        "--train",
        data_root,
        "--batch-size",
        str(B),
        "--image-size",
        str(PX),
        "--output-dtype",
        "float16",
        "--layout",
        "nhwc",
        "--workers",
        "1",
        "--seed",
        str(SEED),
    ) as srv:
        with RemoteLoader(
            srv.endpoint, "train", rank=0, world_size=1, device="cpu", with_indices=True
        ) as loader:
            got = collect(loader, limit=3)
        with RemoteLoader(
            srv.endpoint, "train", rank=0, world_size=1, device="cpu", normalize_on_device=True
        ) as loader:
            for _ in range(2):  # asked again, it says the same, not something else
                with pytest.raises(ValueError, match=r"needs a uint8 wire.*float16"):
                    next(iter(loader))
    for (images, labels, indices), (raw, want_labels, want_indices) in zip(
        got, raw_reference, strict=False
    ):
        assert images.dtype == torch.float16 and images.shape == (B, 3, PX, PX)
        assert images.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(labels, want_labels) and torch.equal(indices, want_indices)
        # uint8 is the rounded pixel: at most half a level (/ std) from the float output
        expected = (raw.float() / 255 - mean) / std
        torch.testing.assert_close(images.float(), expected, rtol=0, atol=0.5 / 255 / 0.224 + 4e-3)
