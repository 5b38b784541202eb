"""scripts/trace_journey.py's rules on known calls: which way a hop goes, and what is a hop."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location(
        "trace_journey", REPO / "scripts/trace_journey.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_calls_down_up_and_through_what_was_handed() -> None:
    tj = _script()
    layers = tj.Layers(tj.import_rules())
    assert layers.direction("server/app.py", "server/core.py") == ""  # app imports core
    assert layers.direction("server/workers.py", "pipeline/sampler.py") == ""  # a layer down
    assert layers.direction("pipeline/samples.py", "server/workers.py") == "up"  # a layer up
    assert layers.direction("pipeline/decode/cpu.py", "pipeline/samples.py") == "up"
    assert layers.direction("client/receiver.py", "client/loader_stats.py") == "handed"


def test_properties_and_operators_are_not_hops() -> None:
    tj = _script()
    spec = str(REPO / "wire/batch_spec.py")
    lines = Path(spec).read_text().splitlines()
    nbytes = next(i for i, line in enumerate(lines) if line.strip().startswith("def nbytes("))
    assert lines[nbytes - 1].strip() == "@property"  # 1-based line `nbytes`: co_firstlineno
    assert not tj.written_as_call(spec, "BatchSpec.nbytes", nbytes)
    assert not tj.written_as_call(spec, "UnaskedBatches.__bool__", 1)
    assert tj.written_as_call(spec, "BatchSpec.__post_init__", 1)
    assert tj.written_as_call(spec, "BatchSpec.from_shape", 1)
