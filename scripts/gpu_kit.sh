#!/usr/bin/env bash
# Packs .gpukit/ (git-ignored): what a bare GPU machine with torch, torchvision, msgpack, numpy,
# OpenCV and pytest still lacks to run batchwire, for a machine that cannot reach a package index
# (the team's lent H100/H200: Python 3.12). Run it here, carry .gpukit to the GPU machine, and
# run scripts/gpu_check.sh there.
#
#   scripts/gpu_kit.sh [IMAGES_DIR [N]]   # optionally N (default 300) JPEGs of IMAGES_DIR too
#
# Contents: the pyzmq wheel for CPython 3.12, PyTurboJPEG's module, libturbojpeg and libjpeg with
# the libjpeg headers (the region decoder compiles against them), and the sample images.
set -euo pipefail
cd "$(dirname "$0")/.."
kit=.gpukit
rm -rf "$kit"
mkdir -p "$kit/whl" "$kit/py" "$kit/lib" "$kit/include" "$kit/images"

python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$kit/whl" pyzmq

python=.venv/bin/python
[ -x "$python" ] || python=python3
cp "$("$python" -c 'import turbojpeg; print(turbojpeg.__file__)')" "$kit/py/"

arch_lib=/usr/lib/x86_64-linux-gnu
cp -L "$arch_lib/libturbojpeg.so.0" "$arch_lib/libjpeg.so.62" "$kit/lib/"
cp /usr/include/jpeglib.h /usr/include/jerror.h /usr/include/jmorecfg.h \
    /usr/include/x86_64-linux-gnu/jconfig.h "$kit/include/"

if [ $# -ge 1 ]; then
    # A subset: the whole 1,000-image sample is over the 64 MiB a carry may take.
    find "$1" -maxdepth 1 -type f \( -iname '*.jpeg' -o -iname '*.jpg' \) | sort | head -n "${2:-300}" | xargs -r cp -t "$kit/images/"
fi
du -sh "$kit"
echo "carry .gpukit, then run: bash scripts/gpu_check.sh"
