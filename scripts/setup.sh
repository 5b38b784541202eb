#!/usr/bin/env bash
# Sets up a local .venv with batchwire and its test tools. Idempotent: a second run
# reuses what the first installed (a stamp file records the pyproject it installed from).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
EXTRAS=${BATCHWIRE_EXTRAS:-dev,dali,bench}  # bench: matplotlib, so the chart test runs too
TORCH_SPEC=${BATCHWIRE_TORCH:-torch==2.13.0}

# System libraries: libjpeg-turbo's TurboJPEG API (PyTurboJPEG < 2 needs libturbojpeg 2.x), and
# libjpeg's headers for our region-of-interest JPEG decoder (optional: without them whole images
# are decoded).
missing=()
ldconfig -p 2>/dev/null | grep -q 'libturbojpeg\.so' || missing+=(libturbojpeg0)
[ -f /usr/include/jpeglib.h ] || [ -f /usr/include/x86_64-linux-gnu/jpeglib.h ] || missing+=(libjpeg62-turbo-dev)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "setup: installing ${missing[*]} (apt-get)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "setup: missing system packages; run:  sudo apt-get update && sudo apt-get install -y ${missing[*]}" >&2
    exit 1
  fi
fi

# jpegtran: the tests' independent reference for restart-marker files (batchwire never runs it).
# Optional: its tests skip, saying so, where it cannot be installed.
if ! command -v jpegtran >/dev/null && [ "$(id -u)" = 0 ]; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libjpeg-turbo-progs >/dev/null 2>&1 \
    || echo "setup: jpegtran (libjpeg-turbo-progs) not installed; its tests will skip" >&2
fi

# dnsmasq: the real DNS server of the dns+tcp:// discovery tests (tests/e2e/test_discovery.py;
# the binary only, no system service). Optional: those tests skip, saying so, without it.
if ! command -v dnsmasq >/dev/null && [ ! -x /usr/sbin/dnsmasq ] && [ "$(id -u)" = 0 ]; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dnsmasq-base >/dev/null 2>&1 \
    || echo "setup: dnsmasq (dnsmasq-base) not installed; the DNS discovery tests will skip" >&2
fi

stamp="$VENV/.batchwire-installed"
want="$(sha1sum pyproject.toml | cut -c1-40) $EXTRAS $TORCH_SPEC"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip="$VENV/bin/python -m pip"
$pip install -q --upgrade pip setuptools wheel
# torch first and pinned: an unpinned resolve would pull several GB of CUDA wheels.
$pip install -q "$TORCH_SPEC"
$pip install -q -e ".[$EXTRAS]"
echo "$want" > "$stamp"
echo "setup: $VENV ready"
