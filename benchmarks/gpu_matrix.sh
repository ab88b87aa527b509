#!/usr/bin/env bash
# Run on the GPU host from the repo root: the validation matrix and the foundation check.
#   source .vbundle/gpu_env.sh && bash benchmarks/gpu_matrix.sh [bundled|llama-1b] [checks|foundation|throughput]
# CB_PARALLEL=1: the four check configurations run at once (fixed KV caches)
# CB_LABEL=x: result names end in -x (two matrices in one call, e.g. CAUSALBOARD_MERGED_SITES=1 CB_LABEL=merged)
# Results: $OUT/<name>.json, logs $OUT/<name>.log
set -uo pipefail
MODEL="${1:-bundled}"; WHAT="${2:-checks}"
OUT="${OUT:-/tmp/cb-out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CB_SCRATCH="${CB_SCRATCH:-/tmp}"
run() {  # name, args...
  local name=$1; shift
  local t0=$SECONDS
  timeout "${CB_RUN_TIMEOUT:-170}" python3 "$@" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s $(tail -1 "$OUT/$name.log" | cut -c1-400)"
}
case "$WHAT" in
  checks)
    if [ -n "${CB_PARALLEL:-}" ]; then  # the four configurations at once, each with a fixed 4 GiB KV cache
      for mode in eager graphs; do for runner in v2 v1; do
        run "val-$MODEL-$mode-$runner${CB_LABEL:+-$CB_LABEL}" benchmarks/gpu_validate.py --model "$MODEL" --mode $mode --runner $runner --kv-gib 4 &
        sleep 10
      done; done; wait
    else
      for mode in eager graphs; do for runner in v2 v1; do
        run "val-$MODEL-$mode-$runner${CB_LABEL:+-$CB_LABEL}" benchmarks/gpu_validate.py --model "$MODEL" --mode $mode --runner $runner
      done; done
    fi ;;
  foundation)
    for mode in eager graphs; do run "found-$MODEL-$mode" benchmarks/gpu_check.py --model "$MODEL" --mode $mode; done ;;
  throughput)
    run "tp-$MODEL" benchmarks/gpu_validate.py --throughput --model "$MODEL" ;;
esac
# the device returns a limited number of files: everything in one archive too
tar -czf "$OUT/matrix-results.tgz" -C "$OUT" $(cd "$OUT" && ls ./*.json ./*.log 2>/dev/null) 2>/dev/null || true
