"""The distribution installs one import namespace, ships the native sources, and the Docker files
copy paths that exist and start commands that the package really installs."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from importlib.metadata import distribution
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    out = tmp_path_factory.mktemp("wheel")
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    subprocess.run(
        [*pip_wheel, "-q", "-w", str(out), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=240,
    )
    (wheel,) = out.glob("batchwire-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        return zf.namelist()


@pytest.mark.timeout(300)
def test_wheel_installs_only_the_batchwire_namespace(wheel_names: list[str]) -> None:
    top = {name.split("/")[0] for name in wheel_names if not name.startswith("batchwire-")}
    assert top == {"batchwire"}, f"bare top-level modules would land in site-packages: {top}"
    # batchwire/__init__.py carries only __version__ (read lazily; batchwire/__init__.py).
    assert "batchwire/__init__.py" in wheel_names
    for sub in ("pipeline", "server", "client", "native", "train", "monitor", "bench"):
        assert f"batchwire/{sub}/__init__.py" in wheel_names


@pytest.mark.timeout(300)
def test_every_package_is_marked_typed(wheel_names: list[str]) -> None:
    """PEP 561: without py.typed a type checker ignores an installed package's hints."""
    packages = [n.removesuffix("__init__.py") for n in wheel_names if n.endswith("/__init__.py")]
    assert packages
    untyped = [p for p in packages if f"{p}py.typed" not in wheel_names]
    assert not untyped, f"packages without py.typed: {untyped}"


@pytest.mark.timeout(300)
def test_wheel_ships_every_native_source(wheel_names: list[str]) -> None:
    sources = sorted(
        p.relative_to(ROOT / "native").as_posix()
        for p in (ROOT / "native" / "csrc").iterdir()
        if p.suffix in {".cpp", ".cu", ".h", ".cuh"}
    )
    assert sources, "native/csrc holds the extension's sources"
    missing = [s for s in sources if f"batchwire/native/{s}" not in wheel_names]
    assert not missing, f"the JIT build needs these sources installed: {missing}"


def _console_scripts() -> set[str]:
    """The commands the installed distribution really provides."""
    eps = distribution("batchwire").entry_points
    return {ep.name for ep in eps if ep.group == "console_scripts"}


DOCKERFILES = sorted((ROOT / "docker").glob("Dockerfile.*"))


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfiles_copy_existing_paths_and_run_our_commands(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    for sources in re.findall(r"^COPY\s+(.+?)\s+\S+\s*$", text, flags=re.MULTILINE):
        for source in sources.split():
            assert (ROOT / source).exists(), f"{dockerfile.name} copies missing {source}"
    entry = re.search(r"^ENTRYPOINT\s+(\[.*\])", text, flags=re.MULTILINE)
    cmd = re.search(r"^CMD\s+(\[.*\])", text, flags=re.MULTILINE)
    words = (entry.group(1) if entry else "") + (cmd.group(1) if cmd else "")
    named = set(re.findall(r'"(pipeline-[a-z]+)"', words))
    assert named, f"{dockerfile.name} starts none of our commands"
    assert named <= _console_scripts(), f"{dockerfile.name} names unknown commands {named}"
