#!/usr/bin/env bash
# `make test-cuda-build`: the real CUDA build of the native op, on a machine WITHOUT a GPU.
#
# In its own venv (.venv-cuda, git-ignored; a second run reuses it) this installs a CUDA build of
# torch (torch==2.14.1, CUDA 13.0: about 5.5 GB with its nvidia-* wheels; pinned, never resolved),
# batchwire (editable, no dependencies) and the few packages the native tests import, then:
#   1. checks that nvcc's CUDA major matches torch.version.cuda (the build gate's rule);
#   2. builds the extension with CUDA forced (BATCHWIRE_CUDA=1 python -m batchwire.native build),
#      for the architectures in TORCH_CUDA_ARCH_LIST (default 8.0;9.0+PTX: A100, H100, and PTX
#      for newer GPUs), and checks that the library holds that PTX;
#   3. loads it and checks that the CUDA kernel registered (a CUDA dispatch key for
#      batchwire::augment_batch) next to the CPU one;
#   4. runs the native CPU tests (tests/e2e/test_native*.py, tests/unit/test_native*.py) in that
#      venv, so every CPU kernel call
#      goes through the library that also holds the CUDA code.
#
# What it proves: the .cu and the torch binding compile with nvcc and the host compiler against a
# CUDA torch's headers, link against libtorch_cuda/libcudart, the library loads (every symbol
# resolves) and registers both kernels, and its CPU half still gives the reference's results.
# What it cannot prove: that the CUDA kernels run or compute the right values (no GPU here; the
# `-m cuda` tests skip). For that run scripts/gpu_check.sh on a GPU machine.
#
# Knobs: CUDA_VENV (.venv-cuda), CUDA_TORCH (torch==2.14.1), CUDA_HOME (/usr/local/cuda when it
# has the toolkit: the nvcc on PATH may be a wrapper outside the toolkit), TORCH_CUDA_ARCH_LIST.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${CUDA_VENV:-.venv-cuda}
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${CUDA_TORCH:-torch==2.14.1}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-8.0;9.0+PTX}
export PYTHONUNBUFFERED=1

step() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }

case "$TORCH_SPEC" in
  torch==*) ;;
  *) echo "test-cuda-build: CUDA_TORCH must pin torch (torch==X.Y.Z), got '$TORCH_SPEC'" >&2; exit 2 ;;
esac

# The toolkit: CUDA_HOME, else /usr/local/cuda, else the folder above nvcc on PATH. torch's own
# guess from PATH (the folder above `which nvcc`) is wrong when nvcc is a wrapper script.
if [ -z "${CUDA_HOME:-}" ]; then
  if [ -f /usr/local/cuda/include/cuda_runtime.h ]; then
    CUDA_HOME=/usr/local/cuda
  elif command -v nvcc > /dev/null; then
    CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
  else
    echo "test-cuda-build: no CUDA toolkit (nvcc) here: install one, or set CUDA_HOME" >&2
    exit 1
  fi
fi
export CUDA_HOME
[ -x "$CUDA_HOME/bin/nvcc" ] || { echo "test-cuda-build: no nvcc in CUDA_HOME=$CUDA_HOME" >&2; exit 1; }

step "venv $VENV with $TORCH_SPEC"
py="$VENV/bin/python"
stamp="$VENV/.batchwire-cuda-installed"
want="$(sha1sum pyproject.toml | cut -c1-40) $TORCH_SPEC"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$py" ]; then
  echo "reusing $VENV ($(cat "$stamp"))"
else
  [ -x "$py" ] || "$PYTHON" -m venv "$VENV"
  pins=$(mktemp)
  trap 'rm -f "$pins"' EXIT
  echo "$TORCH_SPEC" > "$pins"  # every install below keeps this torch
  pip=("$py" -m pip)
  "${pip[@]}" install -q --upgrade pip setuptools wheel
  "${pip[@]}" install -q -c "$pins" "$TORCH_SPEC"
  "${pip[@]}" install -q -c "$pins" --no-deps -e .
  # What the native tests and the build import (conftest imports zmq); no torch resolve.
  "${pip[@]}" install -q -c "$pins" "numpy>=1.24" "pyzmq>=26.4" "msgpack>=1.0" "ninja>=1.11" \
      "pytest>=8" "pytest-timeout>=2.3" "pillow>=10"
  echo "$want" > "$stamp"
fi

step "toolchain"
nvcc_release=$("$CUDA_HOME/bin/nvcc" --version | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p')
torch_cuda=$("$py" -c 'import torch; print(torch.version.cuda)')
"$py" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda,
"devices", torch.cuda.device_count())' 2>&1 | grep -v 'No CUDA runtime'
echo "nvcc: CUDA $nvcc_release at $CUDA_HOME; TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST"
if [ "$torch_cuda" = None ]; then
  echo "test-cuda-build: $TORCH_SPEC in $VENV is a CPU-only build" >&2
  exit 1
fi
if [ "${nvcc_release%%.*}" != "${torch_cuda%%.*}" ]; then
  echo "test-cuda-build: nvcc is CUDA $nvcc_release but torch was built for CUDA $torch_cuda:" \
       "the majors must match (point CUDA_HOME at a CUDA ${torch_cuda%%.*}.x toolkit)" >&2
  exit 1
fi

step "build with BATCHWIRE_CUDA=1"
export BATCHWIRE_CUDA=1
"$py" -m batchwire.native build
"$py" -m batchwire.native info

step "load: both kernels registered"
"$py" - <<'EOF'
import torch
from batchwire import native

ops = native.load()
plan = ops.build.plan
assert ops.with_cuda, plan.cuda_reason
has = torch._C._dispatch_has_kernel_for_dispatch_key
for key in ("CPU", "CUDA", "Meta"):
    assert has("batchwire::augment_batch", key), f"no {key} kernel registered"
print(f"loaded {plan.library} ({plan.kind}, archs {plan.arch_list}): CPU, CUDA and Meta kernels")
assert plan.arch_list == __import__("os").environ["TORCH_CUDA_ARCH_LIST"], plan.arch_list
assert f"archs={plan.arch_list}" in plan.toolchain.flags, "the key must name the architectures"
EOF

if [[ "$TORCH_CUDA_ARCH_LIST" == *+PTX* ]]; then
  step "the library carries PTX (newer GPUs JIT-compile it)"
  lib=$("$py" -c 'from batchwire.native.build import make_plan; print(make_plan().library)')
  cuobjdump=$CUDA_HOME/bin/cuobjdump
  if [ ! -x "$cuobjdump" ]; then  # a toolkit without it: the same major's wheel, in the venv
    "$py" -m pip install -q "nvidia-cuda-cuobjdump>=${torch_cuda%%.*},<$((${torch_cuda%%.*} + 1))" \
      && cuobjdump=$(find "$VENV" -name cuobjdump -type f -perm -u+x | head -n 1)
  fi
  if [ -x "${cuobjdump:-}" ]; then
    "$cuobjdump" --list-ptx "$lib" | tee /dev/stderr | grep -q "ptx" \
      || { echo "test-cuda-build: no PTX in $lib" >&2; exit 1; }
  else
    echo "not checked: no cuobjdump (the PTX is asked for by the arch list)"
  fi
fi

step "native CPU tests through the CUDA build"
"$py" -m pytest -q -x -rs -p no:cacheprovider \
    tests/e2e/test_native.py tests/e2e/test_native_build.py tests/unit/test_native_pil.py \
    tests/unit/test_native_arch.py tests/unit/test_native_probe.py
step "done: compiled, linked and loaded with CUDA; the CUDA kernels did not run (no GPU)"
