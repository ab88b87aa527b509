#!/usr/bin/env bash
# Same-host A/B of causalboard's engine code: GPU hosts differ from call to call (engine start-ups
# 20-30 % apart, host-limited variants with them), so a comparison of two commits is only
# meaningful inside one device call. Two steps:
#
#   bash benchmarks/ab_trees.sh prepare COMMIT        # here: the commit's engine_ext (no bundled
#                                                     # model) into .ab/COMMIT (~0.5 MB: the tree
#                                                     # plus carried paths must stay under 64 MiB)
#   # device call, carry [".vbundle", ".gpu_extra", ".ab"]:
#   source .vbundle/gpu_env.sh; export PYTHONPATH=$PWD:$PWD/.gpu_extra:$PYTHONPATH
#   bash benchmarks/ab_trees.sh run COMMIT -- python3 benchmarks/dynamic_bench.py --model /tmp/llama-1b \
#        --device cuda --reps 5 --tokens 128 --variants threshold_on,monitor_only
#
# `run` makes the random Llama-3.2-1B-shaped model at /tmp/llama-1b, then runs the command ROUNDS
# times (default 2) from the working tree with its own engine_ext and with .ab/COMMIT's first on
# PYTHONPATH, alternately (HEAD first: its engine compiles the model; the other may reuse vLLM's
# compile cache), each in a fresh process; the benchmark scripts are the working tree's (give a
# script path: `python3 -c` would put the working directory, and its engine_ext, first). Output:
# $OUT/ab-<round>-<head|COMMIT>.out/.err, and the lines with "dyn_decode" or "bench" on stdout.
set -uo pipefail
what=${1:?prepare|run}; commit=${2:?commit}; shift 2
case "$what" in
  prepare)
    rm -rf ".ab/$commit" && mkdir -p ".ab/$commit"
    git archive "$commit" engine_ext | tar -x -C ".ab/$commit" --exclude engine_ext/bundled/causalboard-tiny
    du -sh ".ab/$commit" ;;
  run)
    [ "${1:-}" = "--" ] && shift
    OUT="${OUT:-/tmp/cb-out}"; mkdir -p "$OUT"
    [ -d /tmp/llama-1b ] || python3 benchmarks/compare/make_model.py /tmp/llama-1b > "$OUT/ab-make-model.log" 2>&1
    here=$PWD
    for round in $(seq 1 "${ROUNDS:-2}"); do
      for tree in head "$commit"; do
        if [ "$tree" = head ]; then pp=${PYTHONPATH:-}; else pp=$here/.ab/$commit${PYTHONPATH:+:$PYTHONPATH}; fi
        (PYTHONPATH=$pp timeout "${AB_LIMIT:-240}" "$@") > "$OUT/ab-$round-$tree.out" 2> "$OUT/ab-$round-$tree.err"
        echo "round $round $tree rc=$?"
        grep -h '"bench"' "$OUT/ab-$round-$tree.out" | grep -v dyn_start | cut -c1-200
      done
    done ;;
esac
