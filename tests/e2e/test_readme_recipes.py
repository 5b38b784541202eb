"""The README's framework recipes are the files tests/test_frameworks.py runs, verbatim."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["lightning_ddp.py", "accelerate_ddp.py", "torchrun_ddp.py"])
def test_readme_shows_the_tested_recipe(name):
    readme = (ROOT / "README.md").read_text()
    code = (ROOT / "examples" / name).read_text().rstrip("\n")
    assert f"<summary>examples/{name}</summary>\n\n```python\n{code}\n```" in readme
