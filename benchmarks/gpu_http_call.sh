#!/usr/bin/env bash
# One device call: P1 and P2 over HTTP, `vllm serve` against `causalboard serve` (the same aiohttp
# client, one server after the other: benchmarks/compare/http_bench.py, with each server process's
# CPU per P1 request), then, in the time left, dynamic steering's batch-32 decode with decisions on
# the device and on the host (benchmarks/dynamic_bench.py --ab-device; DYN_VARIANTS to choose).
# From the repo root on the GPU host, with the bundle and the server fallbacks carried:
#   source .vbundle/gpu_env.sh; export PYTHONPATH=$PWD:$PWD/.gpu_extra:$PYTHONPATH
#   bash benchmarks/gpu_http_call.sh          # carry .vbundle .gpu_extra .gpu_server
#   TASKS=p1 CB_ENVS="default CAUSALBOARD_WAKE_LOOP=0" bash benchmarks/gpu_http_call.sh   # an A/B of causalboard's switches
# Results: every step's .out / .err in $OUT/http-call.tgz; $OUT keeps only it, steps.txt and smi.txt.
#   MATRIX=1 ...                              # the correctness matrix first (after an engine change)
#   CB_START_BEFORE=S ...                     # a causalboard variant starts only before S seconds into the call
#   ROUNDS=2 TASKS=p2 ...                     # stock, cb, stock, cb: two processes of each server
source benchmarks/device_call_lib.sh  # $OUT, $M (the 1B model), step
[ -n "${MATRIX:-}" ] && CB_PARALLEL=1 CB_RUN_TIMEOUT="${MATRIX_LIMIT:-200}" step matrix "$(( ${MATRIX_LIMIT:-200} + 20 ))" \
  bash benchmarks/gpu_matrix.sh bundled checks
# ROUNDS=N: stock and every causalboard variant N times, alternated (a decode figure depends on the
# server process more than on its repetitions: docs/performance.md, "Twenty-second session");
# http_summary.py then compares the medians over each server's processes.
for r in $(seq "${ROUNDS:-1}"); do
  sfx=$([ "${ROUNDS:-1}" -gt 1 ] && echo "-r$r")
  [ "$r" -gt 1 ] && [ "$SECONDS" -gt "${CB_START_BEFORE:-100000}" ] && { echo "stock$sfx: skipped (at ${SECONDS}s)" | tee -a "$OUT/steps.txt"; continue; }
  step "http-stock$sfx" "${HTTP_LIMIT:-260}" python3 benchmarks/compare/http_bench.py --server stock --model "$M" \
    --reps "${REPS:-5}" --tasks "${TASKS:-p1,p2}" --fallback-wheels .gpu_server
  # CB_ENVS: causalboard once per space-separated entry, `default` or VAR=VALUE[,VAR=VALUE] set for its
  # server (an A/B of engine switches, e.g. CB_ENVS="default CAUSALBOARD_WAKE_LOOP=0")
  for v in ${CB_ENVS:-default}; do
    [ "$SECONDS" -gt "${CB_START_BEFORE:-100000}" ] && { echo "cb $v$sfx: skipped (at ${SECONDS}s)" | tee -a "$OUT/steps.txt"; continue; }
    name=http-cb; vars=()
    if [ "$v" != default ]; then name="http-cb-$(echo "$v" | tr ',=' '__')"; IFS=, read -r -a vars <<< "$v"; fi
    step "$name$sfx" "${HTTP_LIMIT:-260}" env "${vars[@]}" python3 benchmarks/compare/http_bench.py --server cb --model "$M" \
      --reps "${REPS:-5}" --tasks "${TASKS:-p1,p2}" --fallback-wheels .gpu_server
  done
done
left=$(( ${CALL_BUDGET:-570} - SECONDS ))
[ "$left" -gt 200 ] && step dyn-bench "$left" python3 benchmarks/dynamic_bench.py --model "$M" --device cuda --reps 5 \
  --ab-device --variants "${DYN_VARIANTS:-threshold_on,proportional}"
tar -czf "$OUT/http-call.tgz" -C "$OUT" $(cd "$OUT" && ls | grep -v '\.tgz$') 2>/dev/null
cat "$OUT/steps.txt"
for f in "$OUT"/http-*.out "$OUT"/dyn-bench.out; do [ -f "$f" ] && grep -h '"bench"' "$f" | grep -v warmup | tail -10 | sed "s/^/$(basename "$f" .out): /"; done
python3 benchmarks/compare/http_summary.py "$OUT"/http-*.out
[ -f "$OUT/matrix.out" ] && tail -6 "$OUT/matrix.out"
keep_only http-call.tgz
