"""scripts/trace_journey.py loaded as a module (it is a script, not a package module), for the
tests that use its recorder and rules."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "trace_journey.py"


def trace_journey() -> ModuleType:
    spec = importlib.util.spec_from_file_location("trace_journey", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
