#!/usr/bin/env bash
# Every GPU check of batchwire in one run, on a machine with a CUDA GPU, torch and torchvision
# (the team's lent H100/H200), after scripts/gpu_kit.sh packed .gpukit here. Writes the log and
# the benchmark JSON to $OUT (or /tmp/gpu-check).
#
#   bash scripts/gpu_check.sh
#
# 1. installs the kit (pyzmq, PyTurboJPEG, libturbojpeg, libjpeg headers) and batchwire itself
#    (editable, no dependencies fetched);
# 2. builds the native extension with CUDA (BATCHWIRE_CUDA=1);
# 3. runs the CUDA tests, then the whole suite;
# 4. measures the fused kernel alone (images/s and its share of a device copy's bandwidth);
# 5. runs pipeline-bench --device cuda on the kit's images (else the embedded dataset).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
exec > >(tee "$out/gpu-check.log") 2>&1
export PYTHONUNBUFFERED=1
kit=.gpukit
python=${PYTHON:-python3}

step() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }

step "install the kit"
if [ -d "$kit" ]; then
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
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
"$python" -c 'import torch, torchvision; print("torch", torch.__version__, "torchvision",
torchvision.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'

step "native extension with CUDA"
BATCHWIRE_CUDA=1 "$python" -m batchwire.native build && "$python" -m batchwire.native info

step "CUDA tests"
"$python" -m pytest -q -m cuda -rs tests

step "whole suite"
"$python" -m pytest -q -rs tests

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
for dtype in uint8 float16 float32; do
    "$python" -m batchwire.bench.bench_augment --data "$images" --dtype "$dtype" --repeats 5
done

step "pipeline-bench --device cuda"
"$python" -m batchwire.bench.cli "${data[@]}" --device cuda --repeat 3 --images 8192 \
    --json "$out/bench-cuda.json"
"$python" -m batchwire.bench.cli "${data[@]}" --device cuda --decoder cpu --rows batchwire \
    --repeat 2 --images 8192 --json "$out/bench-cuda-cpu-decode.json"
step "done: $out"
