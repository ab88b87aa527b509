# Sourced by the one-call device scripts (gpu_dynamic_call.sh, gpu_segments_call.sh), from the repo
# root on the GPU host: $OUT ready, the GPU named in $OUT/smi.txt, the random Llama-3.2-1B-shaped
# model built in $M, and `step NAME SECONDS COMMAND...` (stdout/stderr to $OUT/NAME.out/.err, its
# exit status and seconds appended to $OUT/steps.txt), and `keep_only ARCHIVE` at the end.
set -uo pipefail
OUT="${OUT:-/tmp/cb-out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
M=/tmp/llama-1b
nvidia-smi -L > "$OUT/smi.txt" 2>&1
python3 benchmarks/compare/make_model.py "$M" > "$OUT/make-model.log" 2>&1
step() {  # name, seconds, command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" > "$OUT/$name.out" 2> "$OUT/$name.err"
  echo "$name rc=$? $((SECONDS - t0))s (at ${SECONDS}s)" | tee -a "$OUT/steps.txt"
}
keep_only() {  # archive: leave only it, steps.txt and smi.txt under $OUT (the device returns at most 8 files)
  find "$OUT" -mindepth 1 ! -name "$1" ! -name steps.txt ! -name smi.txt -delete 2>/dev/null
}
