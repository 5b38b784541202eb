#!/usr/bin/env bash
# Rehearses a lent GPU machine's check here, without a GPU: does the kit hold everything the
# image lacks? (issue 30). About 3 minutes the first time (venv, wheels), 1-2 minutes after.
#
#   bash scripts/gpu_rehearsal.sh
#
# 1. a clean venv standing in for the image's python3 (.cache/gpu-rehearsal/image; kept for the
#    next run): of the image's packages (scripts/gpu_image_packages.txt) those batchwire and the
#    check need, at the image's versions where known and installable here (`gpu_steps.py
#    rehearsal-requirements` says which stand in: this host is CPython 3.11 with CPU torch), and
#    nothing else: `gpu_steps.py image-subset` fails the rehearsal on any package the image lacks;
# 2. a kit packed by scripts/gpu_kit.sh exactly as for the GPU machine, for CPython 3.11, with 64
#    sample images (REHEARSAL_IMAGES, default ../shared/imagenet-sample);
# 3. `gpu_check.sh --cpu --budget 300` with that venv's python and that kit: the kit is installed
#    with `pip install --no-index`; every step must run and none fail, and its environment step
#    must find nothing missing.
# The log, JSON and table land in .cache/gpu-rehearsal/out.
set -euo pipefail
cd "$(dirname "$0")/.."
base=.cache/gpu-rehearsal
venv=$base/image
images=${REHEARSAL_IMAGES:-../shared/imagenet-sample}
tool=.venv/bin/python
[ -x "$tool" ] || tool=python3
export PYTHONUNBUFFERED=1

echo "=== 1. $venv: the image's packages only"
mkdir -p "$base"
"$tool" scripts/gpu_steps.py rehearsal-requirements > "$base/requirements.txt"
want=$(sha1sum "$base/requirements.txt" | cut -c1-40)
if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.rehearsal" 2> /dev/null)" = "$want" ]; then
    echo "reusing $venv"
else
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$base/requirements.txt"
    echo "$want" > "$venv/.rehearsal"
fi
"$venv/bin/python" -m pip list --disable-pip-version-check 2> /dev/null \
    | grep -iE '^(torch|torchvision|numpy|opencv-python-headless|pytest) ' || true
"$venv/bin/python" scripts/gpu_steps.py image-subset

echo "=== 2. the kit, for CPython 3.11"
GPU_KIT=$base/kit KIT_PYTHON=3.11 bash scripts/gpu_kit.sh "$images" 64

echo "=== 3. gpu_check.sh --cpu --budget 300 with that venv and kit"
set +e
PYTHON=$venv/bin/python GPU_KIT=$base/kit OUT=$base/out GPU_CHECK_WORK=$base/work \
    bash scripts/gpu_check.sh --cpu --budget 300
code=$?
set -e
"$tool" - "$base/out/gpu-check.json" <<'EOF'
import json
import sys

result = json.load(open(sys.argv[1]))
rows = {r["step"]: r for r in result["steps"]}
env = rows.get("environment", {"status": "absent", "figures": ""})
assert env["status"] == "PASS", f"the kit left something missing: {env}"
failed = [r["step"] for r in result["steps"] if r["status"] == "FAIL"]
assert not failed, f"failed: {failed}"
print("rehearsal: nothing missing;", ", ".join(f"{k} {v}" for k, v in result["counts"].items()))
EOF
exit $code
