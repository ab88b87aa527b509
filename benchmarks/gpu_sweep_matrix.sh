#!/usr/bin/env bash
# Sweep validation matrix on the GPU host (see benchmarks/gpu_sweep.py), from the repo root:
#   source .vbundle/gpu_env.sh && export PYTHONPATH="$PWD/.gpu_extra:$PYTHONPATH" && bash benchmarks/gpu_sweep_matrix.sh
set -uo pipefail
OUT="${OUT:-/tmp/cb-out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CB_SCRATCH="${CB_SCRATCH:-/tmp}"
if [[ -n "${CONFIGS:-}" ]]; then IFS=',' read -ra CFGS <<< "$CONFIGS"   # e.g. CONFIGS="bundled graphs v2,llama-1b eager v1"
else CFGS=("llama-1b graphs v2" "llama-1b eager v2" "llama-1b graphs v1" "llama-1b eager v1" "bundled graphs v2" "bundled eager v1"); fi
for cfg in "${CFGS[@]}"; do
  set -- $cfg   # model mode runner [bi]
  name="sweep-$1-$2-$3${4:+-$4}"; t0=$SECONDS
  timeout "${CB_RUN_TIMEOUT:-240}" python3 benchmarks/gpu_sweep.py --model "$1" --mode "$2" --runner "$3" ${4:+--batch-invariant} \
    --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? $((SECONDS - t0))s $(tail -1 "$OUT/$name.log" | cut -c1-300)"
done
