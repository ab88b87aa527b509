#!/usr/bin/env bash
# Device calls for segmented sweep cells (docs/segmented-cells.md) on one GPU, from the repo root,
# with the bundle (`source .vbundle/gpu_env.sh`; PYTHONPATH with .gpu_extra for the HTTP parts):
#   CALL=check bash benchmarks/gpu_segments_call.sh
#       at once: the correctness matrix (four configurations), benchmarks/dynamic_gpu_check.py and
#       segment_cells.py with batch invariance on (segmented vs one request per cell, bit for bit);
#       then segment_cells.py without batch invariance (alone on the GPU: the speed).
#   CALL=p1 bash benchmarks/gpu_segments_call.sh
#       one after another: stock vLLM's P1 (768 one-token requests), causalboard's P1 variants
#       (`Engine.generate` per cell, `agenerate_cells` segmented, the HTTP sweep with and without
#       segments, interleaved; `sweep_http_g256`: the segmented sweep's fan-out in groups of 256 as
#       before SEGMENTED_GROUP_MAX), and batched Hugging Face hooks, on the same model folder.
#   CALL=sweep bash benchmarks/gpu_segments_call.sh
#       the matrix alone, then the HTTP sweep against the same in groups of 256 (its path before the
#       cells were prepared during the clean run) and `agenerate_cells`, interleaved, then batched HF.
#   CALL=entry bash benchmarks/gpu_segments_call.sh
#       layer skipping on the GPU: the matrix alone (its layer_skipping_bit_exact check, four
#       configurations), then benchmarks/diag/layer_entry.py on eager engines (skipping needs an
#       eager forward), V2 and V1 runners with batch invariance on (every variant's scores equal
#       bit for bit), then V2 without it.
#   CALL=entry-stacks bash benchmarks/gpu_segments_call.sh
#       layer_entry.py (V2, batch invariance off) with the engine core sampled (stack_sampler.py and
#       its step timeline): an eager engine (segmented vs entering) and a compiled one (segmented vs
#       one call per layer), for where a step's fixed time goes.
#   CALL=cgsizes SEG_V2=1 bash benchmarks/gpu_segments_call.sh
#       segmented cells (`agenerate_cells`) and the HTTP sweep with vLLM's default CUDA-graph sizes
#       (to 512 tokens: the cells' one big step runs without a graph), then with sizes to 16,384.
#   CALL=phases bash benchmarks/gpu_segments_call.sh
#       benchmarks/diag/sweep_phases.py: a one-cell sweep (its setup and teardown), then the 768-cell
#       sweep, each phase and engine call timed (the sweep service without HTTP).
# segment_cells.py and p1_stacks.py run vLLM's V1 runner, or (SEG_V2=1) the V2 runner (a GPU's default);
# both offer segments (docs/segmented-cells.md).
# Results: every step's .out / .err in $OUT/segments-call.tgz; $OUT keeps only it, steps.txt and smi.txt.
source benchmarks/device_call_lib.sh  # $OUT, $M (the 1B model), step
SEG=(env VLLM_USE_V2_MODEL_RUNNER=$([ -n "${SEG_V2:-}" ] && echo 1 || echo 0))  # V1; SEG_V2=1: V2
case "${CALL:-check}" in
  check)
    CB_PARALLEL=1 CB_RUN_TIMEOUT="${MATRIX_LIMIT:-300}" step matrix "$(( ${MATRIX_LIMIT:-300} + 20 ))" \
      bash benchmarks/gpu_matrix.sh bundled checks &
    sleep 40; step dyn-check "${CHECK_LIMIT:-280}" python3 benchmarks/dynamic_gpu_check.py &
    sleep 20; step seg-bi "${SEG_LIMIT:-300}" "${SEG[@]}" python3 benchmarks/diag/segment_cells.py --model "$M" --device cuda \
      --reps 3 --batch-invariant --kv-gib 8 &
    wait
    left=$(( ${CALL_BUDGET:-570} - SECONDS ))
    [ "$left" -gt 60 ] && step seg-nobi "$left" "${SEG[@]}" python3 benchmarks/diag/segment_cells.py --model "$M" --device cuda --reps 5
    ;;
  p1)
    step p1-stock "${STOCK_LIMIT:-170}" python3 benchmarks/diag/p1_stacks.py --engine stock --model "$M" --reps 5 --dir "$OUT/p1-stock"
    step p1-cb "${CB_LIMIT:-260}" "${SEG[@]}" python3 benchmarks/diag/p1_stacks.py --engine cb --http --seg-ab --interleave --sweep-groups 256 \
      --variants nospec,patched,cells_seg,sweep_http,sweep_http_g256,sweep_http_noseg --model "$M" --reps 5 --dir "$OUT/p1-cb"
    left=$(( ${CALL_BUDGET:-570} - SECONDS ))
    [ "$left" -gt 30 ] && step hf "$left" python3 benchmarks/compare/hf_patch.py --model "$M" --reps 3 --chunks 256 --variants batched
    ;;
  sweep)  # after an engine change: the matrix alone, then the HTTP sweep A/B and HF, one after another
    CB_PARALLEL=1 CB_RUN_TIMEOUT="${MATRIX_LIMIT:-240}" step matrix "$(( ${MATRIX_LIMIT:-240} + 20 ))" \
      bash benchmarks/gpu_matrix.sh bundled checks
    step p1-cb "${CB_LIMIT:-230}" "${SEG[@]}" python3 benchmarks/diag/p1_stacks.py --engine cb --http --interleave --sweep-groups 256 \
      --variants cells_seg,sweep_http,sweep_http_g256 --model "$M" --reps 5 --dir "$OUT/p1-cb"
    left=$(( ${CALL_BUDGET:-570} - SECONDS ))
    [ "$left" -gt 30 ] && step hf "$left" python3 benchmarks/compare/hf_patch.py --model "$M" --reps 5 --chunks 256 --variants batched
    ;;
  entry)
    CB_PARALLEL=1 CB_RUN_TIMEOUT="${MATRIX_LIMIT:-240}" step matrix "$(( ${MATRIX_LIMIT:-240} + 20 ))" \
      bash benchmarks/gpu_matrix.sh bundled checks
    for r in v2 v1; do  # layer skipping needs an eager forward (compiled engines run every layer)
      step "entry-eager-$r" "${ENTRY_LIMIT:-120}" env VLLM_USE_V2_MODEL_RUNNER=$([ $r = v2 ] && echo 1 || echo 0) \
        python3 benchmarks/diag/layer_entry.py --model "$M" --device cuda --reps 5 --bands 2,4 --eager
    done
    left=$(( ${CALL_BUDGET:-570} - SECONDS ))
    [ "$left" -gt 60 ] && step entry-eager-v2-nobi "$left" env VLLM_USE_V2_MODEL_RUNNER=1 \
      python3 benchmarks/diag/layer_entry.py --model "$M" --device cuda --reps 5 --bands 2,4 --eager --no-batch-invariant
    ;;
  entry-stacks)  # where a step of segmented cells spends its time: eager (entering) and compiled, sampled
    step entry-stacks-eager "${ENTRY_LIMIT:-150}" env VLLM_USE_V2_MODEL_RUNNER=1 python3 benchmarks/diag/layer_entry.py \
      --model "$M" --device cuda --reps 3 --bands 4 --eager --no-batch-invariant --stacks "$OUT/stacks-eager"
    left=$(( ${CALL_BUDGET:-570} - SECONDS ))
    [ "$left" -gt 60 ] && step entry-stacks-graphs "$left" env VLLM_USE_V2_MODEL_RUNNER=1 python3 benchmarks/diag/layer_entry.py \
      --model "$M" --device cuda --reps 3 --bands 4 --no-batch-invariant --stacks "$OUT/stacks-graphs" \
      --stack-variants segmented,waves
    ;;
  cgsizes)  # the segmented cells' big steps with CUDA graphs of their size: default sizes, then up to 16,384 tokens
    CS=$(python3 -c "import json; print(json.dumps({'cudagraph_capture_sizes': [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, 513, 16)) + [768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384]}))")
    step cg-default "${CG_LIMIT:-150}" "${SEG[@]}" python3 benchmarks/diag/p1_stacks.py --engine cb --http --interleave \
      --variants cells_seg,sweep_http --model "$M" --reps 7 --dir "$OUT/cg-default"
    left=$(( ${CALL_BUDGET:-570} - SECONDS ))
    [ "$left" -gt 60 ] && step cg-large "$left" "${SEG[@]}" python3 benchmarks/diag/p1_stacks.py --engine cb --http --interleave \
      --variants cells_seg,sweep_http --model "$M" --reps 7 --dir "$OUT/cg-large" --compilation-config "$CS"
    ;;
  phases)  # the sweep's fixed costs, phase by phase (sweep_phases.py): one cell, then the 768-cell sweep
    step phases-1 "${PH1_LIMIT:-150}" "${SEG[@]}" python3 benchmarks/diag/sweep_phases.py --device cuda --model "$M" --reps 25 --timeline
    left=$(( ${CALL_BUDGET:-570} - SECONDS ))
    [ "$left" -gt 60 ] && step phases-768 "$left" "${SEG[@]}" python3 benchmarks/diag/sweep_phases.py --device cuda --model "$M" \
      --layers null --positions '"all_prompt"' --hooks pre_attn,post_attn,post_block --reps 9 --timeline
    ;;
esac
tar -czf "$OUT/segments-call.tgz" -C "$OUT" $(cd "$OUT" && ls | grep -v '\.tgz$') 2>/dev/null
cat "$OUT/steps.txt"
for f in "$OUT"/seg-*.out "$OUT"/entry-*.out "$OUT"/cg-*.out "$OUT"/p1-*.out "$OUT"/phases-*.out "$OUT"/hf.out "$OUT"/dyn-check.out; do [ -f "$f" ] && grep -h '"bench"\|passed\|failed' "$f" | tail -12 | sed "s/^/$(basename "$f" .out): /"; done
tail -6 "$OUT/matrix.out" 2>/dev/null
keep_only segments-call.tgz
