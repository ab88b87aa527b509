#!/usr/bin/env bash
# Create (if missing) and fill the project's virtualenv. Idempotent: a stamp records the hash of the
# requirement files, so a second call with nothing changed returns in well under a second.
#
#   VENV=.venv                       where the virtualenv lives (default: .venv in the checkout)
#   CAUSALBOARD_CACHE=~/.cache/causalboard   wheel cache shared by all checkouts (warm CI runs)
#   CAUSALBOARD_DEVICE=auto|cpu|gpu  gpu installs requirements/gpu.txt (auto: gpu when nvidia-smi
#                                    sees a GPU); cpu installs the --no-deps lock requirements/cpu.txt
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${VENV:-.venv}"
CACHE="${CAUSALBOARD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/causalboard}"
DEVICE="${CAUSALBOARD_DEVICE:-auto}"
if [[ "$DEVICE" == auto ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then DEVICE=gpu; else DEVICE=cpu; fi
fi
REQ="requirements/$DEVICE.txt"
[[ -f "$REQ" ]] || { echo "setup: no requirement file $REQ (CAUSALBOARD_DEVICE=$DEVICE)" >&2; exit 2; }

find_python312() {
  # 1) python3.12 on PATH that actually runs (a pyenv shim exists even when 3.12 is not selected)
  if command -v python3.12 >/dev/null 2>&1 && python3.12 -c 'import sys; assert sys.version_info[:2]==(3,12)' 2>/dev/null; then
    command -v python3.12; return
  fi
  # 2) a pyenv-managed 3.12.x
  if command -v pyenv >/dev/null 2>&1; then
    local v
    for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.[0-9]+)?$' | sort -V -r); do
      local p; p="$(pyenv root)/versions/$v/bin/python3.12"
      if [[ -x "$p" ]]; then echo "$p"; return; fi
    done
  fi
  # 3) common install locations
  local p
  for p in /usr/bin/python3.12 /usr/local/bin/python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
    if [[ -x "$p" ]]; then echo "$p"; return; fi
  done
  return 1
}

STAMP="$VENV/.causalboard-setup"
WANT="$DEVICE $(cat "$REQ" pyproject.toml scripts/setup_venv.sh | sha256sum | cut -c1-16)"
if [[ -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
  exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
  PY="$(find_python312)" || {
    echo "setup: causalboard needs Python 3.12 (Panel 1.10 and the pinned stack require it)." >&2
    echo "       None was found on PATH, under pyenv ('pyenv versions'), or in /usr/bin." >&2
    echo "       Install one (e.g. 'pyenv install 3.12') and run this again." >&2
    exit 2
  }
  echo "setup: creating $VENV with $PY ($("$PY" --version))"
  "$PY" -m venv "$VENV"
fi

PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
export PIP_CACHE_DIR="$CACHE/pip"
t0=$SECONDS
if [[ "$DEVICE" == cpu ]]; then
  # Download into a wheel cache outside the checkout (already-present wheels are not fetched
  # again), then install offline from it with --no-deps: see requirements/cpu.txt for why.
  WHEELS="$CACHE/wheels-cp312"
  mkdir -p "$WHEELS"
  if "$VENV/bin/python" scripts/wheels_present.py "$REQ" "$WHEELS"; then
    echo "setup: every pinned wheel is already in $WHEELS"
  else
    echo "setup: fetching wheels into $WHEELS (cached across checkouts)"
    "${PIP[@]}" download -q --no-deps --only-binary=:all: -d "$WHEELS" -r "$REQ" 2>&1 | grep -v 'is ignored: it is neither' || true
  fi
  echo "setup: installing $REQ (--no-deps)"
  # uv (pinned in $REQ) installs the same wheels several times faster than pip (in parallel, from
  # its cache of unpacked wheels under $CACHE/uv); pip does it where uv cannot be installed or
  # fails. --compile-bytecode as pip does: with PYTHONDONTWRITEBYTECODE set (as on the CI hosts)
  # nothing else would ever write the .pyc files, and every process would compile torch and vLLM
  # from source at import (a test run took over 40 minutes instead of ~27 that way)
  UV_PIN="$(grep -E '^uv==' "$REQ" || true)"
  if [[ -n "$UV_PIN" ]] && "${PIP[@]}" install -q --no-deps --no-index --find-links "$WHEELS" "$UV_PIN" \
      && UV_CACHE_DIR="$CACHE/uv" "$VENV/bin/uv" pip install -q --python "$VENV/bin/python" --no-deps --offline --compile-bytecode \
           --no-index --find-links "$WHEELS" -r "$REQ"; then
    :
  else
    echo "setup: uv did not install $REQ; pip does"
    "${PIP[@]}" install -q --no-deps --no-index --find-links "$WHEELS" -r "$REQ"
  fi
else
  "${PIP[@]}" install -q -r "$REQ"
fi
"${PIP[@]}" install -q --no-deps --no-build-isolation -e .
if [[ "$DEVICE" == cpu && ! -x /usr/bin/chromium && "${CAUSALBOARD_SKIP_BROWSER:-0}" != 1 ]]; then
  # The browser tests drive Debian's Chromium through Playwright (`playwright install` cannot
  # download its own build on these machines).
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    echo "setup: installing Debian's chromium for the browser tests"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null; } \
      || { echo "setup: could not install chromium (apt-get failed)" >&2; exit 1; }
  else
    echo "setup: /usr/bin/chromium is missing; install Debian's 'chromium' package (root needed) for the browser tests" >&2
  fi
fi
"$VENV/bin/python" -c 'import vllm, torch, transformers, fastapi, panel' 2>/dev/null \
  || { echo "setup: the environment does not import (vllm/torch/transformers/fastapi/panel)" >&2; exit 1; }
echo "$WANT" > "$STAMP"
echo "setup: done in $((SECONDS - t0)) s ($VENV, $DEVICE)"
