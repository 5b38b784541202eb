"""scripts/trace_journey.py's rules on known calls: which way a hop goes, and what is a hop."""

from __future__ import annotations

from pathlib import Path

from tracejourney import trace_journey

REPO = Path(__file__).resolve().parents[2]


def test_calls_down_up_and_through_what_was_handed() -> None:
    tj = trace_journey()
    layers = tj.Layers(tj.import_rules())
    assert layers.direction("server/app.py", "server/core.py") == ""  # app imports core
    assert layers.direction("server/workers.py", "pipeline/sampler.py") == ""  # a layer down
    assert layers.direction("pipeline/samples.py", "server/workers.py") == "up"  # a layer up
    assert layers.direction("pipeline/decode/cpu.py", "pipeline/samples.py") == "up"
    assert layers.direction("client/receiver.py", "client/loader_stats.py") == "handed"


def test_properties_and_operators_are_not_hops() -> None:
    tj = trace_journey()
    spec = str(REPO / "wire/batch_spec.py")
    lines = Path(spec).read_text().splitlines()
    nbytes = next(i for i, line in enumerate(lines) if line.strip().startswith("def nbytes("))
    assert lines[nbytes - 1].strip() == "@property"  # 1-based line `nbytes`: co_firstlineno
    assert not tj.written_as_call(spec, "BatchSpec.nbytes", nbytes)
    assert not tj.written_as_call(spec, "UnaskedBatches.__bool__", 1)
    assert tj.written_as_call(spec, "BatchSpec.__post_init__", 1)
    assert tj.written_as_call(spec, "BatchSpec.from_shape", 1)
