#!/usr/bin/env bash
# Multi-GPU validation on a two-GPU host (see benchmarks/gpu_multirank.py), from the repo root:
#   source .vbundle/gpu_env.sh && export PYTHONPATH=$PWD/.gpu_extra:$PYTHONPATH
#   bash benchmarks/gpu_multirank.sh [llama-1b|bundled] [checks|throughput|all]
# checks: TP=1, TP=2, PP=2 (CUDA graphs, V2 runner), TP=2 eager and TP=2 without the plugin entry
# point, at once (fixed KV caches),
# then each against TP=1; throughput: TP=1, TP=2, PP=2 one after the other (nothing else running).
# Results: $OUT/mr-*.json, logs $OUT/mr-*.log
set -uo pipefail
MODEL="${1:-llama-1b}"; WHAT="${2:-all}"
OUT="${OUT:-/tmp/cb-out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CB_SCRATCH="${CB_SCRATCH:-/tmp}"
# NVLink multicast stays off (the host's rule; set here too for processes vLLM starts)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# The GPU host runs the source tree from PYTHONPATH: no installed entry point, so vLLM's engine core
# (which hosts no worker with several ranks) would not load causalboard's plugin and the engine
# would fall back to salting whole intervened requests (kv_isolation "requests"). Give it the
# entry point `pip install -e .` writes, so the checks run the per-block salting users get.
BASE_PYTHONPATH="${PYTHONPATH:-}"
if [ -z "${CB_NO_PLUGIN_METADATA:-}" ]; then
  META=/tmp/cb-plugin-meta; mkdir -p "$META/causalboard-0.1.0.dist-info"
  printf 'Metadata-Version: 2.1\nName: causalboard\nVersion: 0.1.0\n' > "$META/causalboard-0.1.0.dist-info/METADATA"
  printf '[vllm.general_plugins]\ncausalboard = engine_ext.worker.seam:register_plugin\n' > "$META/causalboard-0.1.0.dist-info/entry_points.txt"
  export PYTHONPATH="$META:$PYTHONPATH"
fi
mr() {  # name, args... (background-safe)
  local name=$1; shift
  local t0=$SECONDS
  timeout "${CB_RUN_TIMEOUT:-400}" python3 benchmarks/gpu_multirank.py --model "$MODEL" "$@" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? $((SECONDS - t0))s $(tail -1 "$OUT/$name.log" | cut -c1-300)"
}
if [ "$WHAT" != throughput ]; then
  # the oracle's random model folder is built once, before the parallel runs
  python3 -c "from benchmarks.gpu_validate import _model_path; _model_path('$MODEL', '$CB_SCRATCH')"
  mr mr-tp1 --tp 1 & sleep 20
  mr mr-tp2 --tp 2 & sleep 20
  mr mr-pp2 --pp 2 & sleep 20
  mr mr-tp2-eager --tp 2 --mode eager & sleep 20
  # the same without the entry point: whole intervened requests salted (kv_isolation "requests")
  PYTHONPATH="$BASE_PYTHONPATH" mr mr-tp2-noplugin --tp 2 &
  wait
  python3 benchmarks/gpu_multirank.py --compare "$OUT/mr-tp1.json" "$OUT/mr-tp2.json" "$OUT/mr-pp2.json" "$OUT/mr-tp2-eager.json" \
    "$OUT/mr-tp2-noplugin.json" --out "$OUT/mr-compare.json" > "$OUT/mr-compare.log" 2>&1; echo "compare rc=$? $(tail -1 "$OUT/mr-compare.log")"
fi
if [ "$WHAT" != checks ]; then
  for cfg in "tp1 --tp 1" "tp2 --tp 2" "pp2 --pp 2"; do
    set -- $cfg; name=$1; shift
    CB_RUN_TIMEOUT=${CB_TPUT_TIMEOUT:-200} mr "mr-$name-tput" "$@" --throughput --kv-gib 20
  done
fi
# the device returns a limited number of files: everything in one archive too
tar -czf "$OUT/mr-results.tgz" -C "$OUT" $(cd "$OUT" && ls mr-*.json mr-*.log 2>/dev/null) 2>/dev/null || true
