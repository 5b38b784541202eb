#!/usr/bin/env bash
# Packs the GPU kit (default .gpukit/, git-ignored): what the lent GPU image (CPython 3.12; its
# packages in scripts/gpu_image_packages.txt) lacks to run scripts/gpu_check.sh, for a machine
# that cannot reach a package index. Run it here, carry the folder, run gpu_check.sh there: it
# installs the kit with `pip install --no-index` and contacts no index.
#
#   scripts/gpu_kit.sh [IMAGES_DIR [N]]   # with N (default 200) JPEGs of IMAGES_DIR
#
# Contents (printed with its size at the end; a carry takes 64 MiB with the working tree):
#   whl/      a manylinux x86_64 wheel for CPython KIT_PYTHON (default 3.12) of every line of
#             scripts/gpu_kit_requirements.txt, which `gpu_steps.py gap` checks covers every runtime
#             dependency the image lacks (PyTurboJPEG 1.x is source-only: its pure-Python wheel is
#             built here);
#   lib/, include/   libturbojpeg and libjpeg with the libjpeg headers (PyTurboJPEG loads the
#             first; the op's region decoder compiles and links against the others);
#   build/    wheels of pyproject.toml's build requirements (setuptools, wheel): batchwire is
#             built in an isolated environment from them, whatever setuptools the image holds
#             (an older one cannot read pyproject.toml's `license`);
#   images/   the sample JPEGs (GPU pixels against the CPU's, the timed server run).
# Knobs: GPU_KIT (the folder), KIT_PYTHON (3.12; 3.11 for scripts/gpu_rehearsal.sh on this host).
set -euo pipefail
cd "$(dirname "$0")/.."
kit=${GPU_KIT:-.gpukit}
version=${KIT_PYTHON:-3.12}
python=.venv/bin/python
[ -x "$python" ] || python=python3

"$python" scripts/gpu_steps.py gap  # exits 1 naming what the requirement list lacks
rm -rf "$kit"
mkdir -p "$kit/whl" "$kit/build" "$kit/lib" "$kit/include" "$kit/images"
grep -v -e '^#' -e '^PyTurboJPEG' scripts/gpu_kit_requirements.txt > "$kit/binary.txt"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$version" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$kit/whl" \
    -r "$kit/binary.txt"
python3 -m pip wheel -q --no-deps -w "$kit/whl" "$(grep '^PyTurboJPEG' scripts/gpu_kit_requirements.txt)"
grep -v '^#' scripts/gpu_kit_requirements.txt > "$kit/requirements.txt"
"$python" -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"]))' \
    > "$kit/build-requirements.txt"
python3 -m pip download -q --only-binary=:all: -d "$kit/build" -r "$kit/build-requirements.txt"  # with their own requirements
rm "$kit/binary.txt"

arch_lib=/usr/lib/x86_64-linux-gnu
cp -L "$arch_lib/libturbojpeg.so.0" "$arch_lib/libjpeg.so.62" "$kit/lib/"
cp /usr/include/jpeglib.h /usr/include/jerror.h /usr/include/jmorecfg.h \
    /usr/include/x86_64-linux-gnu/jconfig.h "$kit/include/"

if [ $# -ge 1 ]; then
    # A subset: the whole 1,000-image sample (107 MB) is over what a carry may take. (sed, not
    # head: head exits early, sort then dies of SIGPIPE, and pipefail ends the script with 141.)
    find "$1" -maxdepth 1 -type f \( -iname '*.jpeg' -o -iname '*.jpg' \) | sort \
        | sed -n "1,${2:-200}p" | xargs -r cp -t "$kit/images/"
fi
ls -l "$kit/whl"
echo "$(find "$kit/images" -type f | wc -l) images; kit size: $(du -sm "$kit" | cut -f1) MiB" \
    "(working tree: $(git ls-files -z | du -cm --files0-from=- | tail -n 1 | cut -f1) MiB; 64 MiB in all)"
echo "carry $kit, then run: bash scripts/gpu_check.sh --budget 480"
