#!/bin/sh
# Makes the CUDA compiler that PyPI wheels installed (`pip install "cuda-toolkit[nvcc,cccl]==X"`:
# nvcc, its headers and libcudart in site-packages/nvidia/cu13) a CUDA_HOME that torch's extension
# builds accept: adds the `lib64` and `libcudart.so` links that torch's link line expects and the
# wheels lack, and links LINK (default /usr/local/cuda, where torch looks when CUDA_HOME is unset)
# to it. Used by docker/Dockerfile.server for its CUDA image.
#
#   sh docker/cuda_home.sh [SITE_PACKAGES [LINK]]
#
# CUDA 13 wheels only: they put the whole toolkit in one folder (nvidia/cu13); CUDA 12's wheels
# (nvidia-cuda-nvcc-cu12 ...) spread it over one folder per package, which is no CUDA_HOME.
set -eu
site=${1:-$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')}
link=${2:-/usr/local/cuda}
nvcc=$(ls "$site"/nvidia/cu*/bin/nvcc 2>/dev/null | head -n 1 || true)
if [ -z "$nvcc" ]; then
    echo "cuda_home.sh: no nvcc under $site/nvidia/cu*/bin: pip install \"cuda-toolkit[nvcc,cccl]==<torch's CUDA>\"" >&2
    exit 1
fi
home=$(dirname "$(dirname "$nvcc")")
[ -e "$home/lib64" ] || ln -s lib "$home/lib64"
if [ ! -e "$home/lib/libcudart.so" ]; then
    cudart=$(ls "$home"/lib/libcudart.so.* 2>/dev/null | head -n 1 || true)
    [ -n "$cudart" ] || { echo "cuda_home.sh: no libcudart.so.* in $home/lib" >&2; exit 1; }
    ln -s "$(basename "$cudart")" "$home/lib/libcudart.so"
fi
[ -f "$home/include/cuda_runtime.h" ] || { echo "cuda_home.sh: no cuda_runtime.h in $home/include" >&2; exit 1; }
ln -sfn "$home" "$link"
echo "CUDA_HOME $link -> $home: $("$link/bin/nvcc" --version | grep release)"
