#!/usr/bin/env bash
# One device call after a change to the dynamic-steering engine path (run on the GPU host from the
# repo root, with the bundle: `source .vbundle/gpu_env.sh`):
#   1. the correctness matrix (four configurations at once),
#   2. benchmarks/dynamic_gpu_check.py (dynamic steering on the GPU vs its CPU-defined contract),
#   3. benchmarks/dynamic_bench.py (batch-32 decode, every dynamic variant vs none, 5 repetitions),
#   4. benchmarks/diag/dynamic_host.py (host time per step inside the engine, on the GPU host).
# STEPTIMES=1 runs the bench under the engine-core step-times recorder (benchmarks/diag/steptimes:
# per run the step period, the engine loop's wait for the GPU, the worker's calls, the slowest steps).
# Everything lands in $OUT/dyn-call.tgz (the device returns few files).
source benchmarks/device_call_lib.sh  # $OUT, $M (the 1B model), step
[ -z "${SKIP_MATRIX:-}" ] && CB_PARALLEL=1 step matrix 230 bash benchmarks/gpu_matrix.sh bundled checks
# the bench first (its engine compiles the model: ~130 s cold), then the dynamic check (bundled model)
RECORDER=()
[ -n "${STEPTIMES:-}" ] && RECORDER=(env "CB_STEP_TIMES=$OUT/steptimes" "PYTHONPATH=$PWD/benchmarks/diag/steptimes:$PYTHONPATH")
step dyn-bench "${BENCH_LIMIT:-280}" "${RECORDER[@]}" python3 benchmarks/dynamic_bench.py --model "$M" --device cuda --reps "${REPS:-5}" ${BENCH_ARGS:-}
[ -z "${SKIP_CHECK:-}" ] && step dyn-check "${CHECK_LIMIT:-200}" python3 benchmarks/dynamic_gpu_check.py
[ -z "${SKIP_HOST:-}" ] && step dyn-host "${HOST_LIMIT:-90}" python3 benchmarks/diag/dynamic_host.py --model "$M" --device cuda --reps 2
tar -czf "$OUT/dyn-call.tgz" -C "$OUT" $(cd "$OUT" && ls | grep -v '\.tgz$') 2>/dev/null
cat "$OUT/steps.txt"; tail -3 "$OUT/matrix.out" 2>/dev/null; tail -8 "$OUT/dyn-bench.out"
keep_only dyn-call.tgz
