#!/usr/bin/env bash
# batchwire's GPU checks in one command, for a machine with one NVIDIA GPU (the team's lent
# H100/H200: CPython 3.12 with torch and torchvision, no package index; carry a kit packed by
# scripts/gpu_kit.sh). The log, JSON and table land in $OUT (default /tmp/gpu-check).
#
#   bash scripts/gpu_check.sh [--budget SECONDS]          # on the GPU machine (default 480 s)
#   bash scripts/gpu_check.sh --cpu [--budget SECONDS]    # no GPU: rehearses the steps here
#   bash scripts/gpu_check.sh --only 'CUDA tests,sanitizer initcheck'   # a rerun of some steps
#
# --only NAMES (comma-separated, as the table names them): the install and the op's build always
# run; the other steps not named are NOT RUN ("not selected"), so a short lease can re-check what failed.
#
# Without a visible GPU (no nvidia-smi, no device it lists, or torch.cuda.is_available() false)
# and without --cpu it exits 2 at once, saying so. Run it under a call limit of the budget + 60 s.
#
# The steps run in order of what they prove, each under its own cap (`timeout`), while the budget
# lasts; a step with no time left is reported NOT RUN, never passed. Each claim is PASS or FAIL;
# with --cpu the steps that need a GPU run their CPU form as REHEARSED (nothing about a GPU is
# proven) or are NOT RUN. Python steps are scripts/gpu_steps.py's (it says what each checks).
#   1. environment: the kit (GPU_KIT, default .gpukit) and batchwire installed with
#      `pip install --no-index` into an overlay site (no venv: the image's python3 is itself a
#      venv, whose packages a venv made from it would not see); every runtime dependency imports;
#   2. the CUDA build of the op for the GPU found (its sm_XY code and PTX, by cuobjdump);
#   3. its launch probe on this GPU;
#   4. the CUDA tests (-m cuda): a skip is a failure, except DALI's absence (NOT RUN);
#   5. GPU pixels against the CPU reference: nvJPEG (and DALI) against libjpeg-turbo, max and
#      mean absolute difference within stated tolerances, fallbacks listed; the op against float64;
#   6. one real pipeline-server --device cuda feeding RemoteLoader(device="cuda"), timed: images/s,
#      data-wait, the server's decode fallbacks, GPU memory;
#   7. compute-sanitizer memcheck/racecheck/synccheck/initcheck over the op's CUDA tests
#      ("Device not supported": NOT RUN, not available);
#   8. the fused kernel alone against the card's memory bandwidth;
#   9. a study, not a claim: nvJPEG's decode alone from 1 and 3 threads, then the served rate by
#      configuration (nvJPEG or the CPU decoder on the GPU server, the CPU alone, more producers, two
#      nvJPEG servers), each with the server's stage times and CPU per image.
# The CPU suite is not a step (CI runs it). Exit: 0 every step ran with no failure, 1 a failure,
# 2 no GPU, 3 no failure but a step had no time (the check is incomplete).
set -uo pipefail
cd "$(dirname "$0")/.."
cpu=0
budget=480
only=
while [ $# -gt 0 ]; do
    case $1 in
        --cpu) cpu=1 ;;
        --budget) budget=${2:?--budget needs SECONDS}; shift ;;
        --budget=*) budget=${1#*=} ;;
        --only) only=${2:?--only needs step names}; shift ;;
        --only=*) only=${1#*=} ;;
        *) echo "gpu_check.sh: unknown argument $1 (--cpu, --budget SECONDS, --only NAMES)" >&2; exit 64 ;;
    esac
    shift
done
[[ $budget =~ ^[0-9]+$ ]] || { echo "gpu_check.sh: --budget takes whole seconds, got $budget" >&2; exit 64; }
# trim NAME: without leading and trailing spaces.
trim() { local w=$1; w=${w#"${w%%[! ]*}"}; printf '%s' "${w%"${w##*[! ]}"}"; }
# --only's names, each a step or a row of the table: a typo would check nothing and exit 0.
if [ -n "$only" ]; then
    IFS=',' read -ra wanted <<< "$only"
    for w in "${wanted[@]}"; do
        case $(trim "$w") in
            "install (kit, batchwire)" | environment | "CUDA build of the op" | "launch probe" \
                | "CUDA tests" | "CUDA tests: DALI" | "GPU vs CPU reference" | "nvjpeg vs libjpeg-turbo" \
                | "dali vs libjpeg-turbo" | "op vs float64 reference" | "server -> RemoteLoader" \
                | sanitizers | "sanitizer memcheck" | "sanitizer racecheck" | "sanitizer synccheck" \
                | "sanitizer initcheck" | "kernel alone" | "kernel uint8" | "kernel float32" \
                | "serve study" | "serve study: "*) ;;
            *) echo "gpu_check.sh: --only: no step or row is named '$(trim "$w")'" >&2; exit 64 ;;
        esac
    done
fi
py=${PYTHON:-python3}
mode=()
[ $cpu = 1 ] && mode=(--cpu)
[ $cpu = 1 ] && [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && py=.venv/bin/python

no_gpu() {
    echo "gpu_check.sh: no GPU here ($1): nothing was checked." >&2
    echo "  Run it on a machine with an NVIDIA GPU, or 'bash scripts/gpu_check.sh --cpu' to rehearse its steps on the CPU." >&2
    exit 2
}
if [ $cpu = 0 ]; then
    command -v nvidia-smi > /dev/null || no_gpu "no nvidia-smi"
    timeout 8 nvidia-smi -L 2> /dev/null | grep -q '^GPU ' || no_gpu "nvidia-smi lists no GPU"
    timeout 60 "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
        2> /dev/null || no_gpu "torch.cuda.is_available() is false for $py"
fi

out=${OUT:-/tmp/gpu-check}
work=${GPU_CHECK_WORK:-${TMPDIR:-/tmp}/gpu-check-work}  # scratch: $OUT keeps 3 small files
mkdir -p "$out"
rm -rf "$work"
mkdir -p "$work"
exec > >(tee "$out/gpu-check.log") 2>&1
export PYTHONUNBUFFERED=1 GPU_CHECK_WORK=$work
results=$work/results.tsv
verdict=$work/verdict.tsv
: > "$results"
start=$SECONDS
deadline=$((SECONDS + budget))
kit=${GPU_KIT:-.gpukit}

# selected NAME: true without --only, or when NAME (or, for "sanitizers", one of its tools'
# rows) is among --only's names.
selected() {
    [ -z "$only" ] && return 0
    case $1 in "install (kit, batchwire)" | "CUDA build of the op") return 0 ;; esac  # needed first
    local want w
    IFS=',' read -ra want <<< "$only"
    for w in "${want[@]}"; do
        w=$(trim "$w")
        [ "$w" = "$1" ] && return 0
        [ "$1" = sanitizers ] && [[ $w == sanitizer* ]] && return 0
        [ "$1" = "kernel alone" ] && [[ $w == "kernel "* ]] && return 0
        [ "$1" = "serve study" ] && [[ $w == "serve study"* ]] && return 0
        [ "$1" = "GPU vs CPU reference" ] && [[ $w == *" vs "* ]] && return 0
    done
    return 1
}
record() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "${4:-}" >> "$results"; }
# run_step NAME CAP NEED CMD...: CMD under `timeout` for min(CAP, what is left of the budget);
# NOT RUN when less than NEED seconds are left. Its rows come from the verdict file, else from
# its exit code.
run_step() {
    local name=$1 cap=$2 need=$3
    shift 3
    local left=$((deadline - SECONDS))
    if ! selected "$name"; then
        record "$name" "NOT RUN" 0 "not selected (--only)"
        return
    fi
    if [ "$left" -lt "$need" ]; then
        echo "=== $name: NOT RUN (no time: ${left} s of the budget left, it needs ${need} s)"
        record "$name" "NOT RUN" 0 "no time left in --budget $budget (${left} s left, needs ~${need} s)"
        return
    fi
    [ "$cap" -gt "$left" ] && cap=$left
    echo; echo "=== $name (cap ${cap} s; $(date -u +%H:%M:%S))"
    : > "$verdict"
    local t0=$SECONDS rc
    GPU_CHECK_VERDICT=$verdict GPU_STEP_SECONDS=$cap timeout --kill-after=10 "$cap" "$@"
    rc=$?
    local took=$((SECONDS - t0))
    while IFS=$'\t' read -r row status figures; do
        record "$row" "$status" "$took" "$figures"
    done < "$verdict"
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
        record "$name" FAIL "$took" "ran past its cap of ${cap} s"
    elif [ ! -s "$verdict" ]; then
        if [ "$rc" = 0 ]; then record "$name" PASS "$took"; else record "$name" FAIL "$took" "exit $rc"; fi
    fi
}

# ------------------------------------------------------------------------------ 1. environment
# The kit's wheels and batchwire itself go to an overlay site on PYTHONPATH: nothing touches the
# interpreter's own packages, and with a kit no index is asked (--no-index). --no-deps: pip does
# not see the interpreter's packages from a --target install; what the wheels need beyond each
# other is the image's, and the environment step imports every one.
install_overlay() {
    local site=$work/site
    local pip=("$py" -m pip install -q --disable-pip-version-check --no-compile --no-deps
        --target "$site")
    if [ -d "$kit/whl" ]; then
        echo "kit $kit: $(ls "$kit/whl" | tr '\n' ' ')"
        "${pip[@]}" --no-index --find-links "$kit/whl" -r "$kit/requirements.txt" || return 1
        ln -sf libturbojpeg.so.0 "$kit/lib/libturbojpeg.so"
        ln -sf libjpeg.so.62 "$kit/lib/libjpeg.so"
    else
        echo "no kit at $kit: the runtime dependencies from the package index"
        "${pip[@]}" -r scripts/gpu_kit_requirements.txt || return 1
    fi
    if [ -d "$kit/build" ]; then  # built in isolation from the kit's setuptools and wheel
        "${pip[@]}" --no-index --find-links "$kit/build" . || return 1
    else
        "${pip[@]}" --no-index --no-build-isolation . || return 1
    fi
}
if [ -d "$kit/whl" ] || [ $cpu = 0 ]; then
    # PYTHONSAFEPATH: `python -m` puts no working directory first: the overlay's installed
    # batchwire is the one imported, whatever the checkout's root holds.
    export PYTHONPATH="$work/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONSAFEPATH=1
    if [ -d "$kit/lib" ]; then
        export LD_LIBRARY_PATH="$PWD/$kit/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        export LIBRARY_PATH="$PWD/$kit/lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
        export CPATH="$PWD/$kit/include${CPATH:+:$CPATH}"
    fi
    export -f install_overlay
    export py kit work
    run_step "install (kit, batchwire)" 120 20 bash -c install_overlay
else
    echo "--cpu without a kit: $py as it is, nothing installed"
fi
run_step "environment" 60 10 "$py" scripts/gpu_steps.py imports "${mode[@]}"
gpu_name=$("$py" -c 'import torch; print(torch.cuda.get_device_name(0))' 2> /dev/null || echo none)
[ $cpu = 1 ] && gpu_name="none (--cpu)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2> /dev/null

# The kit's real photos where it has them; else one class folder of the embedded dataset.
if compgen -G "$kit/images/*" > /dev/null; then
    images=$kit/images
else
    images=$("$py" -c 'from batchwire.pipeline.synthetic import default_dataset
print(sorted(p for p in default_dataset().train_root.iterdir() if p.is_dir())[0])')
fi
steps=scripts/gpu_steps.py

# ---------------------------------------------------------- 2-6. the claims nobody has seen
run_step "CUDA build of the op" 180 30 "$py" $steps build "${mode[@]}"
if [ $cpu = 0 ]; then
    run_step "launch probe" 60 10 "$py" $steps probe
else
    record "launch probe" "NOT RUN" 0 "--cpu: no GPU"
fi
run_step "CUDA tests" 150 30 "$py" $steps pytest "${mode[@]}" "CUDA tests" -- -m "cuda and not multi_gpu" \
    tests/e2e/test_native.py tests/e2e/test_server_cuda.py tests/e2e/test_remote_loader_cuda.py \
    tests/e2e/test_train_cuda.py \
    tests/unit/test_buffers.py tests/unit/test_cuda_events.py tests/unit/test_decode_dali.py \
    tests/unit/test_decode_dali_probe.py tests/unit/test_decode_nvjpeg.py \
    tests/unit/test_decode_upload.py tests/unit/test_decoder_select.py tests/unit/test_local.py \
    tests/unit/test_native_probe.py tests/unit/test_producer.py
run_step "GPU vs CPU reference" 90 20 "$py" $steps compare "${mode[@]}" --data "$images"
run_step "server -> RemoteLoader" 90 30 "$py" $steps serve "${mode[@]}" --data "$images"

# ------------------------------------------------------------------------- 7. sanitizers
if [ $cpu = 0 ]; then
    GPU_SANITIZERS=$only run_step "sanitizers" 240 40 "$py" $steps sanitize
else
    for tool in memcheck racecheck synccheck initcheck; do
        record "sanitizer $tool" "NOT RUN" 0 "--cpu: no GPU"
    done
fi

# ------------------------------------------------------------------------- 8. kernel alone
run_step "kernel alone" 90 20 "$py" $steps kernel "${mode[@]}" --data "$images"

# ------------------------------------------------------------------------- 9. serve study
run_step "serve study" 150 110 "$py" $steps study "${mode[@]}" --data "$images" --images 8192

# -------------------------------------------------------------------------------- report
echo
"$py" $steps report --results "$results" --json "$out/gpu-check.json" \
    --table "$out/gpu-check-table.txt" --gpu "$gpu_name" --budget "$budget" \
    --elapsed $((SECONDS - start)) "${mode[@]}"
code=$?
[ $cpu = 1 ] && echo "--cpu: a rehearsal; no GPU claim was checked"
exit $code
