#!/usr/bin/env bash
# Every GPU check of batchwire in one run, on a machine with a CUDA GPU, torch and torchvision
# (the team's lent H100/H200), after scripts/gpu_kit.sh packed .gpukit here. Writes the log and
# the benchmark JSON to $OUT (or /tmp/gpu-check).
#
#   bash scripts/gpu_check.sh          # on the GPU machine
#   bash scripts/gpu_check.sh --cpu    # the same steps without a GPU (e.g. here, before carrying)
#
# 1. installs the kit (pyzmq, PyTurboJPEG, libturbojpeg, libjpeg headers) and batchwire itself
#    (editable, no dependencies fetched);
# 2. builds the native extension with CUDA (BATCHWIRE_CUDA=1);
# 3. runs the CUDA tests (among them: contrast output bit-identical between runs);
# 4. runs the native CUDA tests again under compute-sanitizer (memcheck: out-of-bounds and
#    misaligned accesses, with torch's caching allocator off so every buffer has its own bounds;
#    racecheck: shared-memory hazards), checking batchwire's kernels; skipped with a message
#    where compute-sanitizer is missing or cannot run on this GPU (gVisor: "Device not supported");
# 5. runs the whole suite;
# 6. measures the fused kernel alone (images/s and its share of a device copy's bandwidth);
# 7. prepares the kit's images with pipeline-prepare and runs pipeline-bench --device cuda on them
#    and on the prepared copy (else on the embedded dataset alone).
# Exits non-zero naming the steps that failed (every step runs regardless).
#
# --cpu: for a machine without a GPU (checks the script itself): PYTHON defaults to .venv's; the
# kit is not installed (no system libraries are touched) and the CUDA build is not forced; the
# native tests stand in for the whole suite; the sanitizer and pipeline-bench steps say they
# are skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
cpu=0
[ "${1:-}" = --cpu ] && cpu=1
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
exec > >(tee "$out/gpu-check.log") 2>&1
export PYTHONUNBUFFERED=1
kit=.gpukit
if [ $cpu = 1 ] && [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then
    python=.venv/bin/python
else
    python=${PYTHON:-python3}
fi
failed=()

step() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }
# Runs a command; a failure is recorded and reported at the end (and returned).
check() {
    "$@" && return 0
    local rc=$?
    echo "FAILED ($rc): $*"
    failed+=("$*")
    return "$rc"
}

step "install the kit"
if [ $cpu = 1 ]; then
    echo "--cpu: kit not installed; this machine's packages and libraries are used"
elif [ -d "$kit" ]; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --target /tmp/bw-site \
        "$kit"/whl/*.whl || exit 1
    export PYTHONPATH="/tmp/bw-site:$PWD/$kit/py${PYTHONPATH:+:$PYTHONPATH}"
    lib=/usr/lib/x86_64-linux-gnu
    cp "$kit"/lib/* "$lib/" && ln -sf libturbojpeg.so.0 "$lib/libturbojpeg.so" \
        && ln -sf libjpeg.so.62 "$lib/libjpeg.so" && cp "$kit"/include/* /usr/include/ && ldconfig
else
    echo "no $kit here: pyzmq and PyTurboJPEG must already be importable"
fi
"$python" -m pip install -q --no-deps --no-build-isolation -e . || exit 1
if [ $cpu = 1 ]; then
    "$python" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
else
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    "$python" -c 'import torch, torchvision; print("torch", torch.__version__, "torchvision",
torchvision.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'
fi

if [ $cpu = 1 ]; then
    step "native extension (--cpu: CUDA as the build gate decides)"
    check "$python" -m batchwire.native build
else
    step "native extension with CUDA"
    export BATCHWIRE_CUDA=1
    check "$python" -m batchwire.native build
fi
"$python" -m batchwire.native info

step "CUDA tests"
check "$python" -m pytest -q -m cuda -rs -p no:cacheprovider tests

step "compute-sanitizer: memcheck and racecheck of batchwire's kernels"
sanitizer=$(command -v compute-sanitizer || true)
for home in "${CUDA_HOME:-}" /usr/local/cuda; do
    if [ -z "$sanitizer" ] && [ -n "$home" ] && [ -x "$home/bin/compute-sanitizer" ]; then
        sanitizer=$home/bin/compute-sanitizer
    fi
done
if [ $cpu = 1 ]; then
    echo "--cpu: skipped (no GPU)"
elif [ -z "$sanitizer" ]; then
    echo "skipped: compute-sanitizer not found (it comes with the CUDA toolkit; or set CUDA_HOME)"
elif ! "$sanitizer" --tool memcheck --error-exitcode 1 "$python" -c \
        'import torch; assert torch.ones(64, device="cuda").sum().item() == 64' \
        > "$out/sanitizer-probe.log" 2>&1; then
    echo "skipped: compute-sanitizer cannot check this GPU here (its probe failed; e.g. gVisor"
    echo "answers 'Device not supported'). The probe's output:"
    tail -n 8 "$out/sanitizer-probe.log"
else
    "$sanitizer" --version | tail -n 1
    # Only batchwire's kernels are instrumented (kns: a substring of the kernel's name), so the
    # run stays short and every report is ours; the op's checks and launches run as usual.
    for tool in memcheck racecheck; do
        echo "--- $tool"
        caching=()
        [ $tool = memcheck ] && caching=(env PYTORCH_NO_CUDA_MEMORY_CACHING=1)
        check "${caching[@]}" "$sanitizer" --tool "$tool" --kernel-name kns=batchwire \
            --error-exitcode 1 --print-limit 20 \
            "$python" -m pytest -q -m cuda -p no:cacheprovider tests/test_native.py
    done
fi

if [ $cpu = 1 ]; then
    step "native tests (--cpu: instead of the whole suite)"
    check "$python" -m pytest -q -rs -p no:cacheprovider tests/test_native.py \
        tests/test_native_build.py tests/test_native_pil.py
else
    step "whole suite"
    check "$python" -m pytest -q -rs tests
fi

# The kit's real photos where it has them; else one class folder of the embedded dataset.
if compgen -G "$kit/images/*" > /dev/null; then
    images=$kit/images
    data=(--data "$images")
else
    images=$("$python" -c 'from batchwire.pipeline.synthetic import default_dataset
print(sorted(p for p in default_dataset().train_root.iterdir() if p.is_dir())[0])')
    data=()
fi

step "fused kernel alone"
if [ $cpu = 1 ]; then
    check "$python" -m batchwire.bench.bench_augment --data "$images" --dtype uint8 --repeats 1
else
    for dtype in uint8 float16 float32; do
        check "$python" -m batchwire.bench.bench_augment --data "$images" --dtype "$dtype" \
            --repeats 5
    done
fi

# A pipeline-prepared copy of the kit's photos (restart markers: GPU decoders get only the
# crop's restart intervals), so that pipeline-bench measures both side by side.
prepared=()
if [ ${#data[@]} -gt 0 ]; then
    step "pipeline-prepare the kit's images"
    rm -rf "$out/prepared"
    if check "$python" -m batchwire.prepare.cli "$images" "$out/prepared" --quiet; then
        prepared=(--prepared "$out/prepared")
    fi
fi

step "pipeline-bench --device cuda"
if [ $cpu = 1 ]; then
    echo "--cpu: skipped (no GPU)"
else
    check "$python" -m batchwire.bench.cli "${data[@]}" "${prepared[@]}" --device cuda --repeat 3 \
        --images 8192 --json "$out/bench-cuda.json"
    check "$python" -m batchwire.bench.cli "${data[@]}" "${prepared[@]}" --device cuda \
        --decoder cpu --rows batchwire --repeat 2 --images 8192 \
        --json "$out/bench-cuda-cpu-decode.json"
fi

if [ ${#failed[@]} -gt 0 ]; then
    step "done with ${#failed[@]} failed step(s): $out"
    printf '  failed: %s\n' "${failed[@]}"
    exit 1
fi
step "done, every step passed: $out"
