#!/usr/bin/env bash
# Run the whole test suite in the project's virtualenv (created by scripts/setup_venv.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
export VLLM_ENABLE_V1_MULTIPROCESSING="${VLLM_ENABLE_V1_MULTIPROCESSING:-0}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
OUTDIR="${CAUSALBOARD_TEST_OUT:-test-output}"
mkdir -p "$OUTDIR"
exec "$VENV/bin/python" -m pytest -p no:cacheprovider --junitxml="$OUTDIR/junit.xml" "$@"
