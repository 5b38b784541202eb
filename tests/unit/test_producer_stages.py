"""BatchProducer through its declared stages: the clock sees all six, the batch's report is
data (`BatchStats`), and producing a batch makes no call back (scripts/trace_journey.py's
recorder and rules, in this process: the decoder handed in is called, nothing calls up)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from batchwire.pipeline.augment_plan import AugmentConfig
from batchwire.pipeline.dataset import ImageDataset, open_dataset
from batchwire.pipeline.decode import CpuBatchDecoder
from batchwire.pipeline.producer import BatchProducer
from batchwire.pipeline.sampler import BatchPlan, ShardSampler
from batchwire.pipeline.stages import STAGES, StageHook
from oddfiles import write_image_folder
from tracejourney import trace_journey

REPO = Path(__file__).resolve().parents[2]
CONFIG = AugmentConfig(image_size=16, train=True, output_dtype="uint8")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> ImageDataset:
    tmp = tmp_path_factory.mktemp("producer-stages")
    root = write_image_folder(
        tmp / "tree", classes=2, good_per_class=4, bad={"class1": ("text", "truncated")}
    )
    return open_dataset(root, cache_dir=tmp / "cache")


def _plan(ds: ImageDataset) -> BatchPlan:
    return next(
        iter(ShardSampler(len(ds), len(ds), seed=0, shuffle=True, drop_last=False).plans(0))
    )


def test_a_batch_enters_all_six_stages_and_reports_data(folder: ImageDataset) -> None:
    hook = StageHook()
    with CpuBatchDecoder(2) as dec:
        producer = BatchProducer(folder, CONFIG, 0, dec)
        plan = _plan(folder)
        out = producer.output_spec(len(plan.indices)).empty()
        clock = hook.start()
        meta = producer.produce(plan, out, clock=clock)
        stats = producer.batch_stats(clock)  # stops the clock
        assert set(clock.seconds) == {s.name for s in STAGES}
        untimed = producer.output_spec(len(plan.indices)).empty()
        producer.produce(plan, untimed)  # no clock: the same pixels
    assert torch.equal(out, untimed)
    assert meta.replaced == 2
    assert set(stats.seconds) == {"read", "decode", "augment"}
    assert all(s >= 0 for s in stats.seconds.values())
    assert (stats.decoder, stats.fallbacks) == ("cpu", 0)
    bad = {p for p in folder.paths if Path(p).name.startswith("bad_")}
    assert set(stats.bad_files) == bad  # then reported once
    assert producer.batch_stats(hook.start()).bad_files == ()
    assert hook.depth == {"read": 0, "decode": 0, "augment": 0}


@pytest.mark.parametrize("threads", [1, 3])  # reads in the producer's thread, or on the pool
def test_producing_a_batch_makes_no_call_back(folder: ImageDataset, threads: int) -> None:
    tj = trace_journey()
    rules = tj.import_rules()
    layers = tj.Layers(rules)
    recorder = tj.Recorder([str(rules.folder_of(pkg)) for pkg in rules.ALLOWED])
    with CpuBatchDecoder(threads) as dec:
        producer = BatchProducer(folder, CONFIG, 0, dec)
        plan = _plan(folder)
        out = producer.output_spec(len(plan.indices)).empty()
        clock = StageHook().start()
        recorder.start()
        try:
            producer.produce(plan, out, clock=clock)
            producer.batch_stats(clock)
        finally:
            recorder.stop()
    hops = set()
    for _, _, caller, _, caller_func, callee, callee_func, first, _ in recorder.calls:
        if caller and tj.written_as_call(callee, callee_func, first):
            hops.add((tj._rel(caller), caller_func, tj._rel(callee), callee_func))
    assert any(h[2] == "pipeline/decode/cpu.py" for h in hops)  # the trace saw the decoder
    back = sorted(h for h in hops if layers.direction(h[0], h[2]))
    assert back == []
