"""The GPU check's kit (scripts/gpu_kit.sh, gpu_steps.py), in-process.

The lent GPU machine reaches no package index, so what it lacks must travel in the kit: the
requirement-list check runs everywhere (it reads pyproject.toml and the copied package list of
the image, scripts/gpu_image_packages.txt). The built-kit check needs a kit packed by
scripts/gpu_kit.sh and says so when there is none. gpu_check.sh's guard rails, run as a process,
are tests/e2e/test_gpu_check_script.py's.
"""

from __future__ import annotations

import importlib.util
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
BUILT_KIT = ROOT / ".gpukit"

spec = importlib.util.spec_from_file_location("gpu_steps", SCRIPTS / "gpu_steps.py")
gpu_steps = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_steps)

#: The lent image: CPython 3.12 on x86-64 Linux with glibc 2.39 (Ubuntu 24.04's Python 3.12.3).
IMAGE_PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(39, 4, -1)] + ["linux_x86_64"]
IMAGE_TAGS = {
    *cpython_tags((3, 12), platforms=IMAGE_PLATFORMS),
    *compatible_tags((3, 12), "cp312", IMAGE_PLATFORMS),
}


def installs_on_the_image(wheel_name: str) -> bool:
    """Whether pip on the image's CPython 3.12 (x86-64, glibc) would install this wheel."""
    _, _, _, tags = parse_wheel_filename(wheel_name)
    return any(Tag(t.interpreter, t.abi, t.platform) in IMAGE_TAGS for t in tags)


def wheel_requirements(wheel: Path) -> list[str]:
    """The canonical names a wheel requires on the image's Python (extras left out)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    env = {"python_version": "3.12", "python_full_version": "3.12.3", "extra": "",
           "implementation_name": "cpython", "sys_platform": "linux"}  # fmt: skip
    reqs = [Requirement(ln.split(":", 1)[1]) for ln in lines if ln.startswith("Requires-Dist:")]
    return [canonicalize_name(r.name) for r in reqs if r.marker is None or r.marker.evaluate(env)]


def test_kit_requirements_cover_every_dependency_the_image_lacks() -> None:
    image = gpu_steps.image_packages()
    assert image["torch"] == "2.11.0" and len(image) > 150, "the copied package list is short"
    kit = gpu_steps.kit_requirements()
    gap = gpu_steps.image_gap()
    missing = [name for name in gap if name not in kit]
    assert not missing, (
        f"the lent image lacks {missing}, which scripts/gpu_kit_requirements.txt does not carry"
    )
    # Today's gap, so a list emptied by mistake cannot pass: these four are not in the image.
    assert {"pyzmq", "pyturbojpeg", "dnspython", "obstore"} <= set(gap)


def test_kit_carries_only_pinned_packages_the_image_lacks() -> None:
    # A wheel of a package the image has would shadow the image's build of it (a numpy or torch
    # of another version under the image's CUDA torch); unpinned, the kit could change silently.
    image = gpu_steps.image_packages()
    for name, line in gpu_steps.kit_requirements().items():
        assert name not in image, f"{line}: the image has {name}; carrying it would shadow it"
        assert "==" in line, f"{line}: pin the kit's versions"


def test_every_runtime_dependency_is_counted(tmp_path: Path) -> None:
    # A dependency added to pyproject.toml shows in the gap, or in the image; a marker for
    # Pythons other than the image's (tomli) does not.
    names = gpu_steps.needed_names()
    assert "torch" in names and "obstore" in names and "torchvision" in names
    assert "tomli" not in names
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\ndependencies = ["numpy>=1", "brand-new-dep>=1"]\n')
    assert gpu_steps.runtime_requirements(pyproject) == ["numpy>=1", "brand-new-dep>=1"]


@pytest.mark.parametrize(
    ("wheel", "ok"),
    [
        ("pyzmq-27.3.0-cp312-abi3-manylinux_2_26_x86_64.manylinux_2_28_x86_64.whl", True),
        ("obstore-0.12.1-cp311-abi3-manylinux_2_17_x86_64.manylinux2014_x86_64.whl", True),
        ("dnspython-2.9.2-py3-none-any.whl", True),
        ("pyzmq-27.3.0-cp311-cp311-manylinux_2_28_x86_64.whl", False),  # the rehearsal's build
        ("pyzmq-27.3.0-cp312-cp312-musllinux_1_2_x86_64.whl", False),
        ("pyzmq-27.3.0-cp312-cp312-manylinux_2_28_aarch64.whl", False),
    ],
)
def test_wheel_tags_for_the_image(wheel: str, ok: bool) -> None:
    assert installs_on_the_image(wheel) is ok


def test_built_kit_has_an_image_wheel_for_every_requirement() -> None:
    if not (BUILT_KIT / "whl").is_dir():
        pytest.skip(
            f"no kit packed at {BUILT_KIT}: run scripts/gpu_kit.sh (the list is checked above)"
        )
    wheels = {}
    for path in (BUILT_KIT / "whl").glob("*.whl"):
        name = canonicalize_name(parse_wheel_filename(path.name)[0])
        wheels[name] = path.name
    kit, image = gpu_steps.kit_requirements(), gpu_steps.image_packages()
    for name, line in kit.items():
        assert name in wheels, f"{line}: no wheel in {BUILT_KIT}/whl"
        assert installs_on_the_image(wheels[name]), f"{wheels[name]} does not install on cp312"
        # The kit installs with --no-deps: what a wheel needs must be the image's or the kit's.
        for need in wheel_requirements(BUILT_KIT / "whl" / wheels[name]):
            assert need in image or need in kit, f"{wheels[name]} needs {need}: neither has it"
    assert (BUILT_KIT / "lib" / "libturbojpeg.so.0").is_file()
    assert (BUILT_KIT / "include" / "jpeglib.h").is_file()


#: compute-sanitizer's printed errors in the shape initcheck printed them on the H200 (2026-11-28):
#: backtraces cut short, the kernel lines made up (the log kept only the tail of one backtrace).
SANITIZER_OUTPUT = """========= COMPUTE-SANITIZER
========= Uninitialized __global__ memory read of size 1 bytes
=========     at void at::native::elementwise_kernel<128, 4>(int)+0x1f0
=========     by thread (0,0,0) in block (0,0,0)
=========         Host Frame: at::_ops::clone::call [0x29bb14d] in libtorch_cpu.so
=========         Host Frame: _check_inputs in test_native.py:120
=========         Host Frame: test_unit_scale_copies_pixels_and_flip_mirrors in test_native.py:239
=========         Host Frame: pytest_pyfunc_call in python.py:167
=========
========= Uninitialized __global__ memory read of size 4 bytes
=========     at void batchwire_augment_kernel<float>(Params)+0x80
=========         Host Frame: test_matches_reference_on_random_batches in test_native.py:133
=========
========= Uninitialized __global__ memory read of size 1 bytes
=========     at void at::native::elementwise_kernel<128, 4>(int)+0x1f0
=========         Host Frame: test_unit_scale_copies_pixels_and_flip_mirrors in test_native.py:239
=========
========= Target application returned an error
========= ERROR SUMMARY: 3 errors
"""


def test_sanitizer_errors_are_counted_by_kernel_and_test_line() -> None:
    found = gpu_steps.sanitizer_errors(SANITIZER_OUTPUT)
    torch_copy = (
        "Uninitialized __global__ memory read of size 1 bytes",
        "void at::native::elementwise_kernel<128, 4>(int)+0x1f0",
        "test_unit_scale_copies_pixels_and_flip_mirrors in test_native.py:239",
    )
    ours = (
        "Uninitialized __global__ memory read of size 4 bytes",
        "void batchwire_augment_kernel<float>(Params)+0x80",
        "test_matches_reference_on_random_batches in test_native.py:133",
    )
    assert found == {torch_copy: 2, ours: 1}
    assert gpu_steps.sanitizer_errors("========= ERROR SUMMARY: 0 errors\n") == {}


def test_the_sanitizer_summary_is_its_count_not_the_unprinted_rest() -> None:
    tail = (
        "========= ERROR SUMMARY: 7009 errors\n========= ERROR SUMMARY: 6989 errors were not "
        "printed. Use --print-limit option to adjust the number of printed errors\n"
    )  # run 1's initcheck, on the H200
    assert gpu_steps.sanitizer_summary(tail) == "ERROR SUMMARY: 7009 errors"
    race = "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n"
    assert gpu_steps.sanitizer_summary(race).startswith("RACECHECK SUMMARY: 0 hazards")
    assert gpu_steps.sanitizer_summary("14 passed\n") == "no summary"


@pytest.mark.parametrize(
    ("only", "tools"),
    [
        ("", ["memcheck", "racecheck", "synccheck", "initcheck"]),
        ("CUDA tests, sanitizers", ["memcheck", "racecheck", "synccheck", "initcheck"]),
        ("CUDA tests,sanitizer initcheck", ["initcheck"]),
        (" sanitizer racecheck , sanitizer memcheck", ["memcheck", "racecheck"]),
        ("CUDA tests", []),
    ],
)
def test_only_chooses_the_sanitizers_it_names(only: str, tools: list[str]) -> None:
    assert gpu_steps.chosen_sanitizers(only) == tools


def test_the_study_list_makes_epochs_long_enough(tmp_path: Path) -> None:
    paths = [f"/data/{i}.jpg" for i in range(200)]  # the kit's 200 photos
    lines = gpu_steps.study_list(paths, 64, tmp_path).read_text().splitlines()
    assert len(lines) >= gpu_steps.STUDY_EPOCH_BATCHES * 64
    assert len(lines) % 200 == 0 and lines[:200] == [f"{p} 0" for p in paths]
    many = gpu_steps.study_list([f"/d/{i}" for i in range(5000)], 64, tmp_path).read_text()
    assert len(many.splitlines()) == 5000  # long enough already: named once
