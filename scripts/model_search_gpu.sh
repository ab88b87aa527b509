#!/usr/bin/env bash
# Exploration (not shipped): train bundled-model variants on the GPU, causal-trace each with HF on CPU.
# On the GPU host (device tool; no vLLM bundle needed), one "name:training flags" per variant, all in parallel:
#   timeout 540 bash scripts/model_search_gpu.sh "l8h2:--layers 8 --heads 2 --kv-heads 1 --steps 2500"
# Writes $OUT/<name>/{train_log.json,eval.txt,trace.json,trace.txt}; models stay in /tmp on the host.
# Results so far: docs/bundled-model.md, "What we tried".
set -uo pipefail
OUT="${OUT:-/tmp/msearch}"; WORK=/tmp/msearch_models
run_one() {
  local name="$1"; shift
  local dir="$WORK/$name"; mkdir -p "$dir" "$OUT/$name"
  OMP_NUM_THREADS=4 python3 -m training.train --device cuda --threads 4 --out-dir "$dir/model" --log "$OUT/$name/train_log.json" "$@" > "$OUT/$name/train.txt" 2>&1
  OMP_NUM_THREADS=4 python3 -m training.evaluate --model-dir "$dir/model" > "$OUT/$name/eval.txt" 2>&1
  OMP_NUM_THREADS=4 python3 -m training.causal_trace_hf --model-dir "$dir/model" --out "$OUT/$name/trace.json" --figure "$OUT/$name/trace.png" > "$OUT/$name/trace.txt" 2>&1
}
for spec in "$@"; do
  name="${spec%%:*}"; args="${spec#*:}"
  run_one "$name" $args &
done
wait
for d in "$OUT"/*/; do echo "=== $d"; tail -2 "$d/eval.txt"; grep -A8 "^\[all\]" "$d/trace.txt"; done
