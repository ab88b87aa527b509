#!/usr/bin/env bash
# Run the whole test suite in the project's virtualenv (created by scripts/setup_venv.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
export VLLM_ENABLE_V1_MULTIPROCESSING="${VLLM_ENABLE_V1_MULTIPROCESSING:-0}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# stock vLLM started by the benchmark smoke tests: skip inductor's per-process ISA probes, as causalboard's
# CPU engine does (engine_ext/engine/runtime.py: ~5 s of every engine start)
export TORCHINDUCTOR_VEC_ISA_OK="${TORCHINDUCTOR_VEC_ISA_OK:-1}"
OUTDIR="${CAUSALBOARD_TEST_OUT:-test-output}"
mkdir -p "$OUTDIR"
# the linter first: pyflakes-class errors fail the run before any test starts
"$VENV/bin/ruff" check --quiet . || { echo "run_tests: ruff found errors (see above)" >&2; exit 1; }
exec "$VENV/bin/python" -m pytest -p no:cacheprovider --junitxml="$OUTDIR/junit.xml" "$@"
