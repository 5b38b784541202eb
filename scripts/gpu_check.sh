#!/usr/bin/env bash
# Every GPU check of batchwire in one command, for a machine with one NVIDIA GPU, its driver and a
# normal Python 3.10+ (any distribution, no root):
#
#   bash scripts/gpu_check.sh          # on the GPU machine; the log, JSON and table go to $OUT
#   bash scripts/gpu_check.sh --cpu    # the same steps without a GPU: checks the script here
#
# 1. environment: a venv (GPU_VENV, default .venv-gpu, with the system's site-packages so a
#    preinstalled CUDA torch is kept) gets torch + torchvision from the package index if torch is
#    missing, then batchwire with its `dev` extra and the DALI extra matching torch's CUDA major
#    (`dali-cuda13` or `dali`), every install constrained to the torch found, and
#    compute-sanitizer (nvidia-cuda-sanitizer-api) where the toolkit has none. Without an index,
#    a .gpukit packed by scripts/gpu_kit.sh is used without root (LD_LIBRARY_PATH, CPATH);
#    whatever is then missing shows below as skipped tests, i.e. failures;
# 2. the native op built with CUDA (BATCHWIRE_CUDA=1), and its launch probe on this GPU;
# 3. the CUDA tests (`-m cuda`): a SKIPPED CUDA TEST IS A FAILURE here (no torchvision, no DALI,
#    no CUDA build: each would otherwise pass by not running); counted from pytest's JUnit XML;
# 4. compute-sanitizer memcheck, racecheck, synccheck and initcheck over the op's CUDA tests,
#    batchwire's kernels instrumented (memcheck and initcheck with torch's caching allocator off,
#    so each buffer has its own bounds and no recycled block looks initialised); a sanitizer that
#    is missing or cannot run on this GPU is a failure, with its output;
# 5. GPU against CPU reference: every GPU decoder's pixels against the CPU decoder's, the fused
#    op against the float64 reference (bench/gpu_check.py compare), with each decoder's
#    fallbacks (images it sent to the CPU decoder) printed and left out of the comparison;
# 6. the whole suite (unit tier, then end to end);
# 7. the fused kernel alone: images/s and GB/s against the card's memory bandwidth (NVML);
# 8. pipeline-bench: images/s of a real server decoding on the GPU (--decoder auto) and on the
#    CPU, each with the server's decode fallbacks (from its stats), so a "GPU decode" figure that
#    was the CPU's shows as such;
# 9. one table of what ran and its figures. Exits 1 when any step failed (every step runs).
#
# --cpu (no GPU; .venv's Python, nothing installed): steps 2-5 and 7-8 run what has a CPU form
# (the CPU build, DALI's CPU backend against the CPU decoder, the CPU op against the reference);
# CUDA tests are reported as skipped, not passed, and the table says this was not a GPU run.
set -uo pipefail
cd "$(dirname "$0")/.."
cpu=0
[ "${1:-}" = --cpu ] && cpu=1
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
exec > >(tee "$out/gpu-check.log") 2>&1
export PYTHONUNBUFFERED=1
results=$out/results.tsv
: > "$results"
kit=.gpukit
failed=0

step() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }
record() { printf '%s\t%s\t%s\n' "$1" "$2" "${3:-}" >> "$results"; [ "$2" = FAIL ] && failed=1; true; }
# check NAME CMD...: runs CMD, records PASS or FAIL under NAME.
check() {
    local name=$1; shift
    if "$@"; then record "$name" PASS; return 0; fi
    local rc=$?
    echo "FAILED ($rc): $*"
    record "$name" FAIL "exit $rc"
    return "$rc"
}
# strict_pytest NAME ARGS...: pytest with JUnit XML; on a GPU run any skipped test fails NAME.
strict_pytest() {
    local name=$1; shift
    local xml="$out/junit-${name// /_}.xml"
    "$py" -m pytest -q -rs -p no:cacheprovider --junitxml="$xml" "$@"
    local rc=$?
    local counts
    counts=$("$py" - "$xml" <<'EOF'
import sys
import xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError):
    print("0 0 0 0")
    raise SystemExit
suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
t = sum(int(s.get(k, 0)) for s in suites for k in ("tests",))
f = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
sk = sum(int(s.get("skipped", 0)) for s in suites)
print(t, f, sk, t - f - sk)
EOF
)
    read -r total fails skipped passed <<< "$counts"
    local figures="$passed passed, $fails failed, $skipped skipped of $total"
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then
        record "$name" FAIL "$figures"
    elif [ "$total" = 0 ]; then
        record "$name" FAIL "no test ran"
    elif [ "$skipped" != 0 ] && [ $cpu = 0 ]; then
        echo "FAILED: $skipped skipped test(s) in a GPU run (their reasons are listed above)"
        record "$name" FAIL "$figures: a skipped test is a failure on a GPU host"
    elif [ "$skipped" != 0 ]; then
        record "$name" "SKIPPED" "$figures (--cpu: not a GPU run)"
    else
        record "$name" PASS "$figures"
    fi
}

# ------------------------------------------------------------------------------ 1. environment
step "1. environment"
if [ $cpu = 1 ]; then
    py=${PYTHON:-.venv/bin/python}
    [ -x "$py" ] || py=python3
    echo "--cpu: $py as it is; nothing installed"
    record "environment" PASS "--cpu: $("$py" -c 'import torch; print("torch", torch.__version__)')"
else
    venv=${GPU_VENV:-.venv-gpu}
    [ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv --system-site-packages "$venv"
    py=$venv/bin/python
    pip=("$py" -m pip install -q)
    installed=1
    if ! "$py" -c 'import torch' 2> /dev/null; then
        echo "no torch: installing torch and torchvision (the package index's default CUDA build)"
        "${pip[@]}" torch torchvision || installed=0
    fi
    "$py" -m pip freeze 2> /dev/null | grep -iE '^(torch|torchvision)==' > "$out/pins.txt"
    if ! "$py" -c 'import torchvision' 2> /dev/null; then
        "${pip[@]}" -c "$out/pins.txt" torchvision || installed=0
        "$py" -m pip freeze | grep -iE '^(torch|torchvision)==' > "$out/pins.txt"
    fi
    major=$("$py" -c 'import torch; print((torch.version.cuda or "none").split(".")[0])' 2> /dev/null)
    case "$major" in
        13) extra=dali-cuda13 ;;
        12) extra=dali ;;
        *) extra=""; echo "torch is not a CUDA 12/13 build (CUDA: $major): no DALI extra" ;;
    esac
    "${pip[@]}" -c "$out/pins.txt" -e ".[dev${extra:+,$extra}]" || installed=0
    if [ $installed = 0 ] && [ -d "$kit" ]; then
        echo "the package index is not reachable: using $kit (no root: libraries by environment)"
        "${pip[@]}" --no-index --no-deps "$kit"/whl/*.whl
        "${pip[@]}" --no-deps --no-build-isolation -e .
        ln -sf libturbojpeg.so.0 "$kit/lib/libturbojpeg.so"
        ln -sf libjpeg.so.62 "$kit/lib/libjpeg.so"
        export PYTHONPATH="$PWD/$kit/py${PYTHONPATH:+:$PYTHONPATH}"
        export LD_LIBRARY_PATH="$PWD/$kit/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        export LIBRARY_PATH="$PWD/$kit/lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
        export CPATH="$PWD/$kit/include${CPATH:+:$CPATH}"
    fi
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    versions=$("$py" -c 'import torch
v = [f"torch {torch.__version__} (CUDA {torch.version.cuda})"]
for name in ("torchvision", "nvidia.dali"):
    try:
        v.append(f"{name} {__import__(name, fromlist=["x"]).__version__}")
    except ImportError:
        v.append(f"{name} MISSING")
print(", ".join(v), "|", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO GPU")')
    echo "$versions"
    if [ $installed = 1 ] && [[ "$versions" != *MISSING* ]] && [[ "$versions" != *"NO GPU"* ]]; then
        record "environment" PASS "$versions"
    else
        record "environment" FAIL "$versions"
    fi
fi
gpu_name=$("$py" -c 'import torch; print(torch.cuda.get_device_name(0))' 2> /dev/null || echo none)

# --------------------------------------------------------------------------- 2. native build
step "2. native op"
if [ $cpu = 0 ]; then export BATCHWIRE_CUDA=1; fi
check "native build" "$py" -m batchwire.native build
"$py" -m batchwire.native info
if [ $cpu = 0 ]; then
    check "launch probe on $gpu_name" "$py" -c 'import torch
from batchwire import native
dev = torch.device("cuda", 0)
fn = native.augment_impl(dev)
assert fn is not native.augment_batch_reference, "the compiled op failed its launch probe"
print("the compiled op launched on", torch.cuda.get_device_name(0))'
else
    record "launch probe" SKIPPED "--cpu: no GPU"
fi

# ----------------------------------------------------------------------------- 3. CUDA tests
step "3. CUDA tests (-m cuda; a skip is a failure on a GPU host)"
strict_pytest "CUDA tests" -m cuda tests

# -------------------------------------------------------------------------- 4. sanitizers
step "4. compute-sanitizer: memcheck, racecheck, synccheck, initcheck of batchwire's kernels"
sanitizer=$(command -v compute-sanitizer || true)
for home in "${CUDA_HOME:-}" /usr/local/cuda; do
    if [ -z "$sanitizer" ] && [ -n "$home" ] && [ -x "$home/bin/compute-sanitizer" ]; then
        sanitizer=$home/bin/compute-sanitizer
    fi
done
if [ $cpu = 1 ]; then
    for tool in memcheck racecheck synccheck initcheck; do record "sanitizer $tool" SKIPPED "--cpu"; done
else
    if [ -z "$sanitizer" ]; then
        case "$major" in 13) pkg="nvidia-cuda-sanitizer-api>=13,<14" ;; *) pkg="nvidia-cuda-sanitizer-api-cu12" ;; esac
        "${pip[@]}" "$pkg" && sanitizer=$(find "$("$py" -c 'import site; print(site.getsitepackages()[0])')" \
            -name compute-sanitizer -type f -perm -u+x 2> /dev/null | head -n 1)
    fi
    if [ -z "$sanitizer" ]; then
        for tool in memcheck racecheck synccheck initcheck; do
            record "sanitizer $tool" FAIL "compute-sanitizer not found (CUDA toolkit or pip $pkg)"
        done
    elif ! "$sanitizer" --tool memcheck --error-exitcode 1 "$py" -c \
            'import torch; assert torch.ones(64, device="cuda").sum().item() == 64' \
            > "$out/sanitizer-probe.log" 2>&1; then
        tail -n 8 "$out/sanitizer-probe.log"
        for tool in memcheck racecheck synccheck initcheck; do
            record "sanitizer $tool" FAIL "compute-sanitizer cannot run on this GPU here (log above)"
        done
    else
        "$sanitizer" --version | tail -n 1
        for tool in memcheck racecheck synccheck initcheck; do
            echo "--- $tool"
            caching=()
            case $tool in memcheck | initcheck) caching=(env PYTORCH_NO_CUDA_MEMORY_CACHING=1) ;; esac
            # kns: only kernels whose name holds "batchwire" are instrumented: short, and ours.
            check "sanitizer $tool" "${caching[@]}" "$sanitizer" --tool "$tool" \
                --kernel-name kns=batchwire --error-exitcode 1 --print-limit 20 \
                "$py" -m pytest -q -x -m cuda -p no:cacheprovider tests/e2e/test_native.py \
                tests/unit/test_native_probe.py
        done
    fi
fi

# ------------------------------------------------------------------ 5. GPU against the CPU
# The kit's real photos where it has them; else one class folder of the embedded dataset.
if compgen -G "$kit/images/*" > /dev/null; then
    images=$kit/images
    data=(--data "$images")
else
    images=$("$py" -c 'from batchwire.pipeline.synthetic import default_dataset
print(sorted(p for p in default_dataset().train_root.iterdir() if p.is_dir())[0])')
    data=()
fi
step "5. GPU results against the CPU reference (decode and augment), fallbacks"
if [ $cpu = 1 ]; then device=cpu; require=(dali); else device=cuda:0; require=(nvjpeg dali); fi
if "$py" -m batchwire.bench.gpu_check compare --device "$device" --data "$images" \
        --require "${require[@]}" --json "$out/compare.json"; then
    verdict=PASS
else
    verdict=FAIL
fi
figures=$("$py" -m batchwire.bench.gpu_check describe compare "$out/compare.json" 2> /dev/null \
    || echo "no result")
record "GPU vs CPU reference ($device)" "$verdict" "$figures"

# ---------------------------------------------------------------------------- 6. the suite
if [ $cpu = 1 ]; then
    step "6. the suite (--cpu: the native, decode and GPU-path unit tests only)"
    strict_pytest "tests (subset)" tests/e2e/test_native.py tests/e2e/test_native_build.py \
        tests/unit/test_native_arch.py tests/unit/test_native_probe.py \
        tests/unit/test_decode_dali.py tests/unit/test_decode_dali_probe.py \
        tests/unit/test_decode_nvjpeg.py tests/unit/test_server_workers.py tests/unit/test_buffers.py
else
    step "6. the whole suite"
    strict_pytest "unit tests" tests/unit
    strict_pytest "e2e tests" -n 4 --dist loadfile tests/e2e
fi

# ------------------------------------------------------------------------- 7. fused kernel
step "7. fused kernel alone"
if [ $cpu = 1 ]; then
    check "kernel (CPU op)" "$py" -m batchwire.bench.bench_augment --data "$images" --dtype uint8 \
        --repeats 1
else
    card=$("$py" -m batchwire.bench.gpu_check bandwidth)
    for dtype in uint8 float32; do
        if "$py" -m batchwire.bench.bench_augment --data "$images" --dtype "$dtype" --repeats 5 \
                | tee "$out/kernel-$dtype.log"; then
            line=$(grep -E "op cuda( bandwidth)?:" "$out/kernel-$dtype.log" | tr -s ' ' | paste -sd ';')
            record "kernel $dtype" PASS "${line:-no CUDA figure} | card: $card"
            grep -q "op cuda:" "$out/kernel-$dtype.log" \
                || record "kernel $dtype on the GPU" FAIL "the op did not run on the GPU"
        else
            record "kernel $dtype" FAIL
        fi
    done
fi

# ----------------------------------------------------------------------- 8. pipeline-bench
prepared=()
if [ ${#data[@]} -gt 0 ]; then
    rm -rf "$out/prepared"
    "$py" -m batchwire.prepare.cli "$images" "$out/prepared" --quiet && prepared=(--prepared "$out/prepared")
fi
step "8. pipeline-bench: a server decoding on the GPU, and on the CPU"
if [ $cpu = 1 ]; then
    record "server bench" SKIPPED "--cpu: no GPU"
else
    for decoder in auto cpu; do
        json=$out/bench-cuda-$decoder.json
        if "$py" -m batchwire.bench.cli "${data[@]}" "${prepared[@]}" --device cuda \
                --decoder "$decoder" --rows batchwire --repeat 2 --images 8192 --json "$json"; then
            record "server, --decoder $decoder" PASS \
                "$("$py" -m batchwire.bench.gpu_check describe bench "$json")"
        else
            record "server, --decoder $decoder" FAIL
        fi
    done
fi

# --------------------------------------------------------------------------------- 9. table
step "9. what ran (GPU: $gpu_name; log and JSON in $out)"
"$py" -m batchwire.bench.gpu_check table "$results" | tee "$out/table.txt"
if [ $failed = 1 ]; then
    echo; echo "FAILED: see the table above"
    exit 1
fi
if [ $cpu = 1 ]; then
    echo; echo "--cpu: the non-GPU steps passed; the GPU steps did not run (this is not a GPU check)"
    exit 0
fi
echo; echo "every step passed on $gpu_name"
