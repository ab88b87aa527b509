#!/usr/bin/env bash
# Exploration (not shipped): train bundled-model variants on the GPU, causal-trace each with HF on CPU.
# On the GPU host (device tool; no vLLM bundle needed), one "name:[VAR=value ...] training flags" per variant, all in parallel:
#   timeout 540 bash scripts/model_search_gpu.sh "l8h2:--layers 8 --heads 2 --kv-heads 1 --steps 2500"
# Leading VAR=value words are exported for that variant. The corpus knobs used in the 2026-11-24 search
# (CB_GAZ, CB_LISTS, CB_SUBJECTS, CB_PROFILES) exist only at commit 71ae4dc; at later commits the corpus is fixed.
# Writes $OUT/summary.txt and $OUT/all.json (per variant: train log, accuracy, trace without per-prompt rows);
# models and raw outputs stay in /tmp on the host.  Results so far: docs/bundled-model.md, "What we tried".
set -uo pipefail
OUT="${OUT:-/tmp/msearch}"; WORK=/tmp/msearch_models; RAW=/tmp/msearch_raw
run_one() {
  local name="$1"; shift
  while [[ $# -gt 0 && "$1" == *=* && "$1" != --* ]]; do export "$1"; shift; done
  local dir="$WORK/$name" raw="$RAW/$name"; mkdir -p "$dir" "$raw"
  OMP_NUM_THREADS=4 python3 -m training.train --device cuda --threads 4 --out-dir "$dir/model" --log "$raw/train_log.json" "$@" > "$raw/train.txt" 2>&1
  OMP_NUM_THREADS=4 python3 -m training.evaluate --model-dir "$dir/model" --out "$raw/eval.json" > "$raw/eval.txt" 2>&1
  OMP_NUM_THREADS=4 python3 -m training.causal_trace_hf --model-dir "$dir/model" --out "$raw/trace.json" --figure "$raw/trace.png" --device cuda > "$raw/trace.txt" 2>&1
}
for spec in "$@"; do
  name="${spec%%:*}"; args="${spec#*:}"
  (run_one "$name" $args) &
done
wait
mkdir -p "$OUT"
for d in "$RAW"/*/; do echo "=== $d"; tail -1 "$d/eval.txt"; sed -n '/^\[all\]/,$p' "$d/trace.txt"; done > "$OUT/summary.txt"
python3 - "$RAW" "$OUT/all.json" <<'PY'
import json, sys, pathlib
out = {}
for d in sorted(pathlib.Path(sys.argv[1]).iterdir()):
    row = {}
    for f, key in (("train_log.json", "train"), ("trace.json", "trace")):
        try:
            row[key] = json.loads((d / f).read_text())
        except Exception as e:  # noqa: BLE001 - report what is missing
            row[key] = f"missing: {e}"
    if isinstance(row["trace"], dict):
        row["trace"].pop("prompts", None)
    row["eval_tail"] = (d / "eval.txt").read_text()[-600:] if (d / "eval.txt").exists() else ""
    out[d.name] = row
pathlib.Path(sys.argv[2]).write_text(json.dumps(out, indent=1))
PY
cat "$OUT/summary.txt" | grep -v "^\s*[0-9]" | head -40
