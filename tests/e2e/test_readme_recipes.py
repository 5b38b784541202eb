"""The documentation's code is the code we run: the framework recipes (docs/frameworks.md) are the
files tests/e2e/test_frameworks.py runs, verbatim, and the loop snippets of docs/your-data.md ("In
your own loop"; the README's example is the first, verbatim) run as written against a real server
started with the server's default output format."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from batchwire.pipeline.synthetic import default_dataset
from serverproc import running_server

ROOT = Path(__file__).resolve().parents[2]
README_ENDPOINT = "tcp://127.0.0.1:5555"


@pytest.mark.parametrize("name", ["lightning_ddp.py", "accelerate_ddp.py", "torchrun_ddp.py"])
def test_readme_shows_the_tested_recipe(name):
    page = (ROOT / "docs" / "frameworks.md").read_text()
    code = (ROOT / "examples" / name).read_text().rstrip("\n")
    assert f"<summary>examples/{name}</summary>\n\n```python\n{code}\n```" in page


def own_data_snippets() -> list[str]:
    """The ```python blocks of docs/your-data.md's loop sections ("In your own loop" and "On a
    GPU"), in order."""
    page = (ROOT / "docs" / "your-data.md").read_text()
    section = page.split("\n## In your own loop\n", 1)[1].split("\n## Python API", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_the_readme_example_is_the_tested_loop():
    """The README's one example is the docs' first loop snippet, verbatim (so it runs below)."""
    readme = (ROOT / "README.md").read_text()
    (example,) = re.findall(r"```python\n(.*?)```", readme, re.S)
    assert example == own_data_snippets()[0]


@pytest.mark.timeout(120)
def test_readme_loop_snippets_run_as_written(capsys):
    snippets = own_data_snippets()
    assert len(snippets) == 2 and README_ENDPOINT in snippets[0]
    assert "num_classes" in snippets[0] and "keys" in snippets[0]
    root = str(default_dataset().val_root)  # 10 classes, 400 images: short epochs
    # No --output-dtype: the snippet must fit the server's default (uint8, normalized on device).
    args = ("--train", root, "--batch-size", "16", "--image-size", "32", "--workers", "1")
    with running_server(*args) as srv:
        namespace: dict = {"__name__": "readme"}
        for code in snippets:  # one namespace: the second snippet goes on from the first
            exec(
                compile(code.replace(README_ENDPOINT, srv.endpoint), "your-data.md", "exec"),
                namespace,
            )
        namespace["loader"].close()
    out = capsys.readouterr().out
    assert re.search(r"^epoch 1: last loss [\d.]+$", out, re.M), out
    assert namespace["model"][-1].out_features == 10  # the server's class count
