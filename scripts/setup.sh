#!/usr/bin/env bash
# Sets up a local .venv with batchwire and the extras asked for. Idempotent: a second run
# reuses what the first installed (a stamp file records the pyproject, torch and extras it
# installed; a venv holding more extras than asked is kept as it is).
#   BATCHWIRE_EXTRAS=           runtime dependencies only (`make demo`, `make setup-runtime`)
#   BATCHWIRE_EXTRAS=dev,dali,bench   the default: the test tools, DALI and the chart (`make test`)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
EXTRAS=${BATCHWIRE_EXTRAS-dev,dali,bench}  # bench: matplotlib, so the chart test runs too
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

# Azurite: Microsoft's Azure Storage emulator, the real Azure Blob API of the az:// tests
# (tests/azurite.py), from npm into .cache/azurite (ignored) with the machine's Node. With the
# dev extra only, and optional: without node/npm the Azure tests skip, saying so. npm runs
# beside pip (about 15 s of a fresh clone's setup, mostly waiting), and the script waits for it
# before it exits, whichever way.
AZURITE_VERSION=3.37.0
azurite_dir=.cache/azurite
trap 'wait' EXIT
case ",$EXTRAS," in *,dev,*)
  if ! grep -qs "\"version\": \"$AZURITE_VERSION\"" "$azurite_dir/node_modules/azurite/package.json"; then
    if command -v node >/dev/null && command -v npm >/dev/null; then
      echo "setup: installing Azurite $AZURITE_VERSION into $azurite_dir (npm, in the background)"
      npm install --prefix "$azurite_dir" --save-exact --no-audit --no-fund --loglevel=error \
        "azurite@$AZURITE_VERSION" >/dev/null \
        || echo "setup: Azurite not installed (npm failed); the Azure tests will skip" >&2 &
    else
      echo "setup: Azurite not installed (no node/npm on PATH); the Azure tests will skip" >&2
    fi
  fi ;;
esac

stamp="$VENV/.batchwire-installed"
base="$(sha1sum pyproject.toml | cut -c1-40) $TORCH_SPEC"
if [ -f "$stamp" ]; then
  read -r have_pyproject have_torch have_extras < "$stamp" || true
  if [ "$have_pyproject $have_torch" = "$base" ]; then
    missing_extra=""
    for extra in ${EXTRAS//,/ }; do
      case ",${have_extras:-}," in *",$extra,"*) ;; *) missing_extra=1 ;; esac
    done
    [ -z "$missing_extra" ] && exit 0
  fi
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
py="$VENV/bin/python"
# pip chooses torch's wheel, pinned, from its own configuration (index, find-links, constraints:
# the CPU build where this machine provides one); an unpinned resolve would pull several GB of
# CUDA wheels. uv installs that wheel and resolves the rest in one go: 31 s with a cold cache
# (~/.cache/uv) for what took pip 48 s here, the same packages and versions.
$py -m pip install -q uv
torch_wheel=$($py -m pip install -q --dry-run --no-deps --ignore-installed --report - "$TORCH_SPEC" \
  | $py -c 'import json, sys; print(json.load(sys.stdin)["install"][0]["download_info"]["url"])')
target=.
[ -n "$EXTRAS" ] && target=".[$EXTRAS]"
# pip, setuptools and wheel upgraded as before (tests/e2e/test_packaging.py builds a wheel with
# this venv's setuptools, no build isolation). --compile-bytecode: the .pyc files pip writes at
# install and uv does not; without them, where PYTHONDONTWRITEBYTECODE is set, every process
# compiles what it imports from source (3 s of CPU for each process importing Lightning).
"$VENV/bin/uv" pip install -q --python "$py" --compile-bytecode --upgrade-package pip \
  --upgrade-package setuptools --upgrade-package wheel pip setuptools wheel \
  "torch @ $torch_wheel" -e "$target"
echo "$base $EXTRAS" > "$stamp"
echo "setup: $VENV ready"
