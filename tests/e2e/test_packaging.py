"""The distribution installs one import namespace, ships the native sources, and the Docker files
copy paths that exist and start commands that the package really installs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import zipfile
from importlib.metadata import distribution
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    subprocess.run(
        [*pip_wheel, "-q", "-w", str(out), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=240,
    )
    (path,) = out.glob("batchwire-*.whl")
    return path


@pytest.fixture(scope="module")
def wheel_names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        return zf.namelist()


@pytest.mark.timeout(300)
def test_the_wheel_installs_into_a_fresh_venv_and_works(wheel: Path, tmp_path: Path) -> None:
    """A user's `pip install batchwire-*.whl` in a venv of their own: the version, the CLIs, and
    the op compiled from the installed sources (a fresh build cache, so nothing is reused).
    Slow (a real compile, 12 s of CPU): only a build from the installed files shows that the
    wheel carries everything the compiler reads and that the build finds it there.

    The venv borrows this one's dependencies (torch and the rest: a path line, as
    `--system-site-packages` would for a system install) so that nothing is downloaded; its
    own site-packages comes first, so batchwire is the wheel's, not the checkout's."""
    import sysconfig

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    (Path(site) / "borrowed-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
         "--no-index", str(wheel)],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "BATCHWIRE_CACHE": str(tmp_path / "cache"),
           "HOME": str(tmp_path)}  # fmt: skip
    where = subprocess.run(
        [str(python), "-c", "import batchwire, batchwire.native; "
         "print(batchwire.__version__, batchwire.native.__file__)"],
        check=True, capture_output=True, text=True, env=env, cwd=tmp_path,
    ).stdout.split()  # fmt: skip
    assert where[0] == wheel.name.split("-")[1]
    assert where[1].startswith(site), f"batchwire came from {where[1]}, not the wheel"
    version = subprocess.run(
        [str(venv / "bin" / "pipeline-server"), "--version"],
        check=True, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60,
    ).stdout  # fmt: skip
    assert version.startswith(f"pipeline-server (batchwire {where[0]}")
    # The augment op (what `python -m batchwire.native build` builds first; the optional JPEG
    # region decoder is left out to keep the suite short: same build path, another source).
    probe = (
        "from batchwire.native.build import build, CSRC; r = build(); "
        "print(r.compiled, r.plan.library, CSRC)"
    )
    build = subprocess.run(
        [str(python), "-c", probe],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=240,
    )  # fmt: skip
    assert build.returncode == 0, build.stdout + build.stderr
    compiled, library, sources = build.stdout.split()
    assert compiled == "True", "the op was not compiled in the fresh cache"
    assert library.startswith(str(tmp_path / "cache")) and Path(library).exists()
    assert sources.startswith(site), f"compiled from {sources}, not the installed sources"


@pytest.mark.timeout(300)
def test_wheel_installs_only_the_batchwire_namespace(wheel_names: list[str]) -> None:
    top = {name.split("/")[0] for name in wheel_names if not name.startswith("batchwire-")}
    assert top == {"batchwire"}, f"bare top-level modules would land in site-packages: {top}"
    # batchwire/__init__.py carries only __version__ (read lazily; src/batchwire/__init__.py).
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


def test_the_server_images_metrics_port_is_reachable_from_outside_the_container() -> None:
    """The image publishes 9100 (docker/README, compose.yaml): a metrics port on the default
    host, 127.0.0.1, would be the container's own loopback, which a published port never
    reaches (a fleet audit found `-p 9100:9100` serving nothing)."""
    text = (ROOT / "docker" / "Dockerfile.server").read_text()
    cmd = re.search(r"^CMD\s+(\[.*\])", text, flags=re.MULTILINE)
    assert cmd is not None
    args = json.loads(cmd.group(1))
    assert "--metrics-port" in args
    assert args[args.index("--metrics-host") + 1] == "0.0.0.0", args
