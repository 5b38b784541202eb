"""Mixtures (issue 33): pipeline/mix_order.py, pipeline/sources/mix.py, MixSampler.

Weights hold in every window of 256 positions, each part is drawn without replacement through
its own epochs, ranks get equal disjoint batches, a resume at another world size mid-epoch
gives exactly the rest of the epoch, a schedule entry added on a restart changes only the
epochs from it on; labels, metadata, checksums and bad-sample substitutes stay in their part.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from batchwire.pipeline.augment_plan import AugmentConfig
from batchwire.pipeline.checksums import CHECKSUMS_MANIFEST, checksum
from batchwire.pipeline.dataset import ImageDataset, open_dataset
from batchwire.pipeline.decode import CpuBatchDecoder
from batchwire.pipeline.local import LocalLoader
from batchwire.pipeline.mix_order import MixPlan, apportion
from batchwire.pipeline.sampler import MixSampler, ShardSampler
from batchwire.pipeline.samples import SampleLoader
from batchwire.pipeline.sources.mix import MixDataset, open_mix, parse_mix, parse_schedule
from batchwire.pipeline.split import Split, build_split
from batchwire.server.config import ServerConfig, config_from_toml
from batchwire.server.core import SplitInfo
from oddfiles import write_image_folder

WINDOW = 256


def part_draws(plan: MixPlan, order: np.ndarray, part: int) -> np.ndarray:
    """Part-local sample ids of ``part``'s draws in ``order``, in order."""
    starts = np.asarray([at for at, _, _ in plan.blocks])
    mine = order[plan.parts_of(order) == part]
    return mine - starts[np.searchsorted(starts, mine, "right") - 1]


@pytest.mark.parametrize("seed", [0, 7, 123])
def test_weights_hold_in_every_window_of_256(seed: int) -> None:
    weights = (0.5, 0.3, 0.15, 0.05)
    plan = MixPlan((5000, 700, 2600, 90), "weight", weights)
    # The chi-square bound of 3 degrees of freedom at p = 0.001 (random draws exceed it in
    # 1 of 1000 windows; the interleave never comes close).
    chi2_bound = 16.27
    for epoch in (0, 1, 5):
        parts = plan.parts_of(plan.epoch_order(seed, epoch))
        counts = np.stack([np.convolve(parts == p, np.ones(WINDOW), "valid") for p in range(4)])
        expected = np.asarray(weights)[:, None] * WINDOW
        assert np.all(np.abs(counts - expected) <= 3 * np.sqrt(expected)), epoch
        chi2 = ((counts - expected) ** 2 / expected).sum(axis=0)
        assert chi2.max() < chi2_bound, (epoch, chi2.max())


def test_counts_by_weight_repeat_and_choose() -> None:
    assert apportion([0.7, 0.3], 10).tolist() == [7, 3]
    assert apportion([1, 1, 1], 10).tolist() == [4, 3, 3]  # ties to the first part
    w = MixPlan((100, 50), "weight", (0.2, 0.8))
    assert w.epoch_length == 150 and w.counts(0).tolist() == [30, 120] and w.copies == (1, 4)
    r = MixPlan((100, 50), "repeat", (1, 2.5))
    assert r.epoch_length == 225 and r.counts(3).tolist() == [100, 125]
    c = MixPlan((100, 50), "choose", (10, 20))
    assert c.epoch_length == 30 and c.copies == (1, 1)
    with pytest.raises(ValueError, match="not all be 0"):
        MixPlan((10, 10), "weight", (0, 0))
    with pytest.raises(ValueError, match="changes weights"):
        MixPlan((10, 10), "choose", (1, 2), schedule=((1, (3, 4)),))


@pytest.mark.parametrize(
    ("mode", "values"), [("weight", (0.6, 0.4)), ("repeat", (0.5, 3)), ("choose", (77, 400))]
)
def test_no_sample_twice_in_a_parts_epoch(mode: str, values: tuple[float, ...]) -> None:
    """Draws of a part across mix epochs, cut into its own epochs: each a permutation."""
    plan = MixPlan((311, 97), mode, values)
    orders = [plan.epoch_order(4, e) for e in range(6)]
    assert all(len(o) == plan.epoch_length for o in orders)
    assert all(int(o.max()) < plan.num_indices for o in orders)
    for p, size in enumerate(plan.sizes):
        draws = np.concatenate([part_draws(plan, o, p) for o in orders])
        assert len(draws) == sum(int(plan.counts(e)[p]) for e in range(6))
        whole = len(draws) // size
        assert whole >= 1
        for q in range(whole):
            assert sorted(draws[q * size : (q + 1) * size].tolist()) == list(range(size)), q
        # Reshuffled when exhausted: consecutive part epochs in another order.
        if whole >= 2:
            assert not np.array_equal(draws[:size], draws[size : 2 * size])


def test_repeats_in_one_epoch_get_their_own_indices() -> None:
    """A part drawn 3 times its size in an epoch: each draw under another mix index, so its
    augmentation (keyed on the index) differs between the copies."""
    plan = MixPlan((50, 20), "repeat", (1, 3))
    assert plan.copies == (1, 4) and plan.num_indices == 130
    for epoch in range(4):
        order = plan.epoch_order(0, epoch)
        assert len(np.unique(order)) == len(order)
    skewed = MixPlan((700, 300), "weight", (0.3, 0.7))  # b: 700 draws of 300 an epoch
    for epoch in range(6):
        b = skewed.epoch_order(1, epoch)
        b = b[skewed.parts_of(b) == 1]
        assert len(np.unique(b)) == len(b)


def test_pure_function_of_seed_and_epoch() -> None:
    a = MixPlan((300, 200), "weight", (0.5, 0.5))
    b = MixPlan((300, 200), "weight", (0.5, 0.5))
    assert np.array_equal(a.epoch_order(3, 2), b.epoch_order(3, 2))
    assert not np.array_equal(a.epoch_order(3, 2), a.epoch_order(3, 1))
    assert not np.array_equal(a.epoch_order(3, 2), a.epoch_order(4, 2))


def rank_batches(sampler: MixSampler, epoch: int) -> list[np.ndarray]:
    return [sampler.plan(epoch, k).indices for k in range(sampler.num_batches)]


def test_every_rank_gets_equal_disjoint_batches() -> None:
    plan = MixPlan((700, 300), "weight", (0.3, 0.7))
    samplers = [MixSampler(plan, 16, seed=1, rank=r, world_size=3) for r in range(3)]
    assert len({s.num_batches for s in samplers}) == 1
    n = samplers[0].num_batches
    assert n == plan.epoch_length // (16 * 3)
    batches = [rank_batches(s, 2) for s in samplers]
    # Global batch g = k * world_size + rank: together the epoch's first n rounds, in order.
    every = np.concatenate([batches[g % 3][g // 3] for g in range(n * 3)])
    assert np.array_equal(every, plan.epoch_order(1, 2)[: n * 48])


def test_resume_mid_epoch_at_another_world_size_is_exact() -> None:
    plan = MixPlan((700, 300), "weight", (0.3, 0.7))
    batch, old_ws, new_ws, done_rounds = 8, 2, 3, 11
    order = plan.epoch_order(5, 1)
    stop = MixSampler(plan, batch, seed=5, world_size=old_ws).epoch_stop(old_ws)
    start = done_rounds * batch * old_ws
    served = []
    for r in range(new_ws):
        s = MixSampler(plan, batch, seed=5, rank=r, world_size=new_ws).resumed(start, old_ws)
        for k in range(s.num_batches):
            p = s.plan(1, k)
            served.extend(p.indices[p.valid].tolist())
    assert sorted(served) == sorted(order[start:stop].tolist())
    assert len(served) == stop - start


def test_schedule_added_on_restart_changes_only_later_epochs() -> None:
    """A restart adding `--mix-schedule 3:...` resumes epochs 0-2 exactly (the same orders)
    and from epoch 3 draws by the new weights, each part still without replacement."""
    spec = parse_mix("mix:a=0.8@/x,b=0.2@/y")
    before = spec.plan([400, 400], train=True)
    after = spec.plan([400, 400], train=True, schedule="3:a=0.2,b=0.8")
    for e in range(3):
        assert np.array_equal(before.epoch_order(9, e), after.epoch_order(9, e))
        assert after.counts(e).tolist() == [640, 160]
    assert after.counts(3).tolist() == [160, 640] and after.counts(7).tolist() == [160, 640]
    assert not np.array_equal(before.epoch_order(9, 3), after.epoch_order(9, 3))
    # Mid-epoch resume across the change: the resumed sampler (built anew, as after a
    # restart) serves exactly the rest of epoch 3 under the new weights.
    order = after.epoch_order(9, 3)
    rest = MixSampler(after, 10, seed=9).resumed(300)
    served = np.concatenate([rest.plan(3, k).indices for k in range(rest.num_batches)])
    assert np.array_equal(served[: 800 - 300], order[300:800])
    # Part b's draws continue its own epoch across the change: 3 x 160 drawn before.
    draws_b = np.concatenate([part_draws(after, after.epoch_order(9, e), 1) for e in range(5)])
    assert sorted(draws_b[:400].tolist()) == list(range(400))
    assert sorted(draws_b[400:800].tolist()) == list(range(400))


def test_parse_text_table_and_errors(tmp_path: Path) -> None:
    spec = parse_mix("mix:web=0.7@s3://bucket/web-shards/,curated=0.3@/data/c;labels=separate")
    assert spec.names == ("web", "curated") and spec.labels == "separate"
    assert spec.parts[0].source == "s3://bucket/web-shards/" and spec.parts[0].value == 0.7
    assert (spec.parts[1].mode, spec.parts[1].value) == ("weight", 0.3)
    repeat = parse_mix("mix:a=repeat:1@/x,b=repeat:2.5@/y").parts
    assert [(p.mode, p.value) for p in repeat] == [("repeat", 1.0), ("repeat", 2.5)]
    braces = parse_mix("mix:a=choose:9@/d/shard-{000..003}.tar,b=choose:5@/e")
    assert braces.parts[0].source == "/d/shard-{000..003}.tar"
    toml = tmp_path / "server.toml"
    toml.write_text(
        'mix-schedule = "2:web=0.5"\n[train.mix]\nlabels = "shared"\n'
        '[train.mix.web]\nsource = "s3://b/web/"\nweight = 0.7\n'
        '[train.mix.curated]\nsource = "~/curated"\nweight = 0.3\nprefix = "cur/"\n'
    )
    settings = config_from_toml(toml)
    table = parse_mix(settings["train"])
    assert table.names == ("web", "curated") and table.parts[1].prefix == "cur/"
    assert not table.parts[1].source.startswith("~")
    assert ServerConfig(**settings).mix_schedule == "2:web=0.5"
    assert parse_schedule("2:web=0.5;4:curated=0.1", table) == ((2, (0.5, 0.3)), (4, (0.5, 0.1)))
    for bad, message in [
        ("mix:a=0.7", "NAME=VALUE@SOURCE"),
        ("mix:a=0.7@/x,a=0.3@/y", "must differ"),
        ("mix:a=0.7@/x,b=repeat:2@/y", "the same way"),
        ("mix:a=x@/x", "not a number"),
        ("mix:a=1@/x;labels=other", "labels must be"),
    ]:
        with pytest.raises(ValueError, match=message):
            ServerConfig(train=bad)
    with pytest.raises(ValueError, match="needs a --train mix"):
        ServerConfig(train="/data", mix_schedule="1:a=1")
    with pytest.raises(ValueError, match="no part 'c'"):
        ServerConfig(train="mix:a=1@/x", mix_schedule="1:c=1")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("mix")
    a = write_image_folder(tmp / "a", classes=3, good_per_class=4, seed=1)
    b = write_image_folder(tmp / "b", classes=2, good_per_class=5, bad={"class1": ("text",)})
    (b / "extra").mkdir()  # a class only b has
    (b / "extra" / "x.jpg").write_bytes(
        (a / "class0" / sorted(p.name for p in (a / "class0").iterdir())[0]).read_bytes()
    )
    return a, b


def mix_of(text: str, train: bool = True) -> MixDataset:
    return open_mix(parse_mix(text), lambda s: open_dataset(s), train=train)


def test_shared_labels_are_the_union_by_name(folders: tuple[Path, Path]) -> None:
    a, b = folders
    mix = mix_of(f"mix:a=0.5@{a},b=0.5@{b}")
    da, db = open_dataset(a), open_dataset(b)
    assert mix.classes == sorted(set(da.classes) | set(db.classes))
    for i in range(len(mix)):
        p, k = mix.part_of(i)
        own = (da, db)[p]
        assert mix.classes[mix.labels[i]] == own.classes[own.labels[k]]
        assert mix.metadata[i] == {"part": ("a", "b")[p]}
        assert mix.paths[i] == own.paths[k]
    prefixed = open_mix(
        parse_mix({"mix": {"a": {"source": str(a)}, "b": {"source": str(b), "prefix": "b/"}}}),
        open_dataset,
        train=True,
    )
    assert prefixed.classes == sorted(da.classes + ["b/" + c for c in db.classes])


def test_separate_labels_keep_each_parts_ids(folders: tuple[Path, Path]) -> None:
    a, b = folders
    mix = mix_of(f"mix:a=0.5@{a},b=0.5@{b};labels=separate")
    da, db = open_dataset(a), open_dataset(b)
    for i in range(len(mix)):
        p, k = mix.part_of(i)
        assert mix.labels[i] == (da, db)[p].labels[k]
    assert mix.num_classes == max(da.num_classes, db.num_classes)


def test_val_mix_visits_each_sample_once(folders: tuple[Path, Path]) -> None:
    a, b = folders
    val = mix_of(f"mix:a=0.9@{a},b=0.1@{b}", train=False)
    assert val.plan is not None and val.plan.copies == (1, 1)
    assert len(val) == len(open_dataset(a)) + len(open_dataset(b))


def test_bad_sample_replaced_from_its_own_part(folders: tuple[Path, Path]) -> None:
    a, b = folders
    mix = mix_of(f"mix:a=0.2@{a},b=0.8@{b}")
    bad = [i for i in range(len(mix)) if Path(mix.paths[i]).name.startswith("bad_")]
    assert bad and all(mix.part_of(i)[0] == 1 for i in bad)
    with CpuBatchDecoder(threads=1) as dec:
        loader = SampleLoader(mix, AugmentConfig(image_size=16, train=True), seed=2, decoder=dec)
        for sample in loader.load(0, bad):
            assert sample.replaced and sample.index not in bad
            lo, hi = mix.substitute_range(sample.requested)
            assert lo <= sample.index < hi, (sample.requested, sample.index)


def test_checksums_per_part(folders: tuple[Path, Path], tmp_path: Path) -> None:
    """Part a has a checksum manifest that no longer matches one file: the mix reports it at
    that file's mix index; part b has none: its samples read unchecked."""
    a, b = folders
    damaged = tmp_path / "a"
    import shutil

    shutil.copytree(a, damaged)
    ds = open_dataset(damaged, verify_checksums="off")
    lines = []
    for path in ds.paths:
        data = Path(path).read_bytes()
        rel = str(Path(path).relative_to(damaged))
        lines.append(json.dumps({"path": rel, "bytes_out": len(data), "checksum": checksum(data)}))
    (damaged / CHECKSUMS_MANIFEST).write_text("\n".join(lines) + "\n")
    target = Path(ds.paths[2])
    raw = bytearray(target.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    target.write_bytes(bytes(raw))
    mix = mix_of(f"mix:b=0.5@{b},a=0.5@{damaged}")
    hits = [i for i in range(len(mix)) if mix.paths[i] == str(target)]
    assert hits
    for i in hits:
        assert mix.checksum_problem(i, mix.read_bytes(i)) is not None
    clean = next(i for i in range(len(mix)) if mix.part_of(i)[0] == 1 and i not in hits)
    assert mix.checksum_problem(clean, mix.read_bytes(clean)) is None
    assert mix.checksum_verdict(0, mix.read_bytes(0)).problem is None  # b: unchecked


def test_plain_dataset_substitutes_unchanged() -> None:
    """Outside a mix the substitute range is the whole dataset (today's sequence)."""
    ds = ImageDataset(
        paths=[f"/x/{i}.jpg" for i in range(9)], labels=np.zeros(9), classes=["c"], root="/x"
    )
    assert ds.substitute_range(4) == (0, 9)


def test_local_loader_opens_a_mix_text_as_the_server_does(folders: tuple[Path, Path]) -> None:
    """`LocalLoader("mix:...")` (not a path that "does not exist"): train in the plan's order,
    `mix_schedule` applied as --mix-schedule; val its parts once, in order; a schedule
    without a mix is an error."""
    a, b = folders
    text = f"mix:a=0.5@{a},b=0.5@{b}"
    want = open_mix(parse_mix(text), open_dataset, train=True, schedule="1:a=0.9")
    with LocalLoader(
        text, batch_size=4, image_size=16, seed=5, mix_schedule="1:a=0.9", decoder="cpu"
    ) as train:
        assert isinstance(train.sampler, MixSampler) and train.sampler.mix == want.plan
        assert train.classes == want.classes
    with LocalLoader(text, split="val", batch_size=4, image_size=16, decoder="cpu") as val:
        assert type(val.sampler) is ShardSampler and not val.sampler.shuffle
        assert len(val.dataset) == len(open_dataset(a)) + len(open_dataset(b))
    with pytest.raises(ValueError, match="mix_schedule needs a mix"):
        LocalLoader(a, batch_size=4, image_size=16, mix_schedule="1:a=0.9")


def _split_of(dataset: ImageDataset, train: bool, dec: CpuBatchDecoder) -> Split:
    augment = AugmentConfig(image_size=16, train=train)
    return build_split("train" if train else "val", dataset, augment, 0, dec)


@pytest.mark.parametrize("values", [("repeat:2", "repeat:0.5"), ("choose:30", "choose:5")])
def test_samples_per_epoch_is_a_train_mix_epoch_length(
    folders: tuple[Path, Path], values: tuple[str, str]
) -> None:
    """The welcome's num_samples is what an epoch draws: a train mix's epoch length, not its
    index space (which holds a repeated part's extra copies); a val mix and a plain dataset
    draw each index once. The sampler's batches per epoch follow from the same count."""
    a, b = folders
    mix = mix_of(f"mix:a={values[0]}@{a},b={values[1]}@{b}")
    assert mix.plan is not None and mix.plan.epoch_length != len(mix)
    with CpuBatchDecoder(threads=1) as dec:
        train = _split_of(mix, True, dec)
        val_mix = mix_of(f"mix:a=0.5@{a},b=0.5@{b}", train=False)
        plain = open_dataset(a)
        for split, want in (
            (train, mix.plan.epoch_length),
            (_split_of(val_mix, False, dec), len(val_mix)),
            (_split_of(plain, True, dec), len(plain)),
        ):
            assert split.samples_per_epoch == want
            assert SplitInfo.of(split).num_samples == want
        assert train.sampler(4, 0, 0, 1).num_batches == mix.plan.epoch_length // 4


def test_fingerprint_tells_mixes_apart_but_not_where_parts_are_read(
    folders: tuple[Path, Path], tmp_path: Path
) -> None:
    """`MixDataset.fingerprint` (the welcome's, which a fleet's servers must agree on) changes
    with anything that changes the batches: weights, parts' names and order, labels mode,
    prefixes, the schedule; not with where a part is read from (a copy elsewhere)."""
    import shutil

    a, b = folders
    copy, smaller = tmp_path / "elsewhere", tmp_path / "smaller"
    shutil.copytree(a, copy)
    shutil.copytree(b, smaller)
    shutil.rmtree(smaller / "extra")
    base = mix_of(f"mix:a=0.5@{a},b=0.5@{b}").fingerprint
    assert len(base) == 16
    assert mix_of(f"mix:a=0.5@{copy},b=0.5@{b}").fingerprint == base
    others = [
        mix_of(f"mix:a=0.6@{a},b=0.4@{b}"),
        mix_of(f"mix:web=0.5@{a},b=0.5@{b}"),
        mix_of(f"mix:b=0.5@{b},a=0.5@{a}"),
        mix_of(f"mix:a=0.5@{a},b=0.5@{b};labels=separate"),
        mix_of(f"mix:a=0.5@{a},b=0.5@{smaller}"),  # b's size differs
        mix_of(f"mix:a=0.5@{a},b=0.5@{b}", train=False),
        open_mix(
            parse_mix({"mix": {"a": {"source": str(a)}, "b": {"source": str(b), "prefix": "b/"}}}),
            open_dataset,
            train=True,
        ),
        open_mix(parse_mix(f"mix:a=0.5@{a},b=0.5@{b}"), open_dataset, train=True, schedule="2:a=1"),
    ]
    prints = [m.fingerprint for m in others]
    assert base not in prints and len(set(prints)) == len(prints)
    with CpuBatchDecoder(threads=1) as dec:
        assert _split_of(open_dataset(a), True, dec).mix_fingerprint == ""
