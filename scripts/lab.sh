#!/usr/bin/env bash
# `make lab`: JupyterLab (pinned in requirements/) on notebooks/ with the project's kernel.
#
#   LAB_HOST=127.0.0.1   interface to listen on (loopback by default)
#   LAB_PORT=8888        port (JupyterLab moves to the next free one if it is taken, and prints the URL)
#   LAB_ROOT=notebooks   folder JupyterLab opens
#   LAB_OPEN=auto|1|0    open a browser: auto = only when a display is there ($DISPLAY / $WAYLAND_DISPLAY)
#   JUPYTER_TOKEN        the access token (default: a random one, printed in the URL)
#   CAUSALBOARD_URL      the server the notebooks use (default http://127.0.0.1:8000, `make run`); when
#                        nothing answers there they start their own (app.client.notebook.connect)
#
# The kernel is registered as `causalboard` inside the virtualenv (share/jupyter/kernels), pointing at
# the venv's python, and is the default for new notebooks. The kernels import this checkout's code
# (PYTHONPATH), also when the virtualenv is shared with other checkouts.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$(pwd -P)"
VENV="${VENV:-.venv}"
VENV_ABS="$(cd "$VENV" && pwd -P)"   # the real folder: a symlinked .venv still gives a lasting path
LAB_HOST="${LAB_HOST:-127.0.0.1}"
LAB_PORT="${LAB_PORT:-8888}"
LAB_ROOT="${LAB_ROOT:-notebooks}"
LAB_OPEN="${LAB_OPEN:-auto}"
if [[ "$LAB_OPEN" == auto ]]; then
  if [[ -n "${DISPLAY:-}${WAYLAND_DISPLAY:-}" ]]; then LAB_OPEN=1; else LAB_OPEN=0; fi
fi
if [[ "$LAB_OPEN" == 1 ]]; then OPEN=--ServerApp.open_browser=True; else OPEN=--ServerApp.open_browser=False; fi
ROOT_OK=--ServerApp.allow_root=False
if [[ $(id -u) == 0 ]]; then ROOT_OK=--ServerApp.allow_root=True; fi   # containers and CI run as root

"$VENV_ABS/bin/python" -m ipykernel install --prefix "$VENV_ABS" --name causalboard \
  --display-name "Python 3.12 (causalboard)" >/dev/null
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
echo "lab: JupyterLab on $LAB_ROOT/ at http://$LAB_HOST:$LAB_PORT (kernel 'causalboard'); the notebooks use" \
     "${CAUSALBOARD_URL:-http://127.0.0.1:8000} or start a server of their own"
exec "$VENV_ABS/bin/python" -m jupyterlab --ServerApp.root_dir="$LAB_ROOT" --ServerApp.ip="$LAB_HOST" \
  --ServerApp.port="$LAB_PORT" --MappingKernelManager.default_kernel_name=causalboard "$OPEN" "$ROOT_OK" "$@"
