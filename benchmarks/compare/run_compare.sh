#!/bin/bash
# Side by side on one GPU host, one call: stock vLLM 0.25.1 and causalboard's engine on the same
# random Llama-3.2-1B-shaped model folder and the same prompts, plus the HF hook baseline.
# Run from the project root on the GPU host (docs/performance.md has the device call):
#   PARTS=S,CB bash benchmarks/compare/run_compare.sh
# PROJ (default .) is the project root (its engine_ext/ and app/ are imported by cb_bench.py).
# Results: $OUT/results.jsonl (one {"bench": ...} line per figure) and $OUT/log_<part>.txt.
set -u
export PYTHONUNBUFFERED=1
B=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PROJ=$(cd "${PROJ:-.}" && pwd)
export SCRATCH=${SCRATCH:-$(mktemp -d)} CB_SCRATCH=${SCRATCH:-/tmp}
OUTD=${OUT:-$SCRATCH/out}; mkdir -p "$OUTD"
PARTS=${PARTS:-S,CB,HF}
RES="$OUTD/results.jsonl"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUTD/env.txt"
[ -n "${VBUNDLE:-}" ] && source "$VBUNDLE/gpu_env.sh" >> "$OUTD/env.txt" 2>&1
export PYTHONPATH="$PROJ:${GPU_EXTRA:+$GPU_EXTRA:}${PYTHONPATH:-}"
M=$SCRATCH/llama-1b
python3 "$B/make_model.py" "$M" 2>&1 | tail -1 | tee -a "$RES"
step() {  # step NAME TIMEOUT CMD...
  local name=$1 t=$2; shift 2
  case ",$PARTS," in *",$name,"*) ;; *) return 0 ;; esac
  echo "=== $name start $(date +%T)"; local t0=$SECONDS
  timeout -k 10 "$t" "$@" > "$OUTD/log_$name.txt" 2>&1; local rc=$?
  grep -h '^{"bench"' "$OUTD/log_$name.txt" | tee -a "$RES"
  echo "{\"bench\": \"driver\", \"step\": \"$name\", \"rc\": $rc, \"wall_s\": $((SECONDS - t0))}" | tee -a "$RES"
  [ $rc -ne 0 ] && tail -30 "$OUTD/log_$name.txt"
}
step S 200 python3 "$B/vllm_bench.py" --model "$M" --tag S_stock --prefix-caching on --tasks p1,p2
step DIAG 240 python3 "$B/stock_diag.py" --model "$M" --tasks "${DIAG_TASKS:-p2,p1,p1c}"
step CB "${CB_T:-330}" python3 "$B/cb_bench.py" --model "$M" --tag CB_bi_off --batch-invariant off --tasks "${CB_TASKS:-p2,p1,p3,p1http,p1chttp}"
step CBBI 240 python3 "$B/cb_bench.py" --model "$M" --tag CB_bi_on --batch-invariant on --tasks "${CBBI_TASKS:-p2,p1http}"
step HF 150 python3 "$B/hf_patch.py" --model "$M" --reps 3 ${HF_ARGS:---chunks 64,256}
echo "=== done $(date +%T)"
