"""Sweep cells as the segments of shared requests against one request per cell (issue 13's sweeps;
docs/segmented-cells.md): `Engine.agenerate_cells` with `segmented=True` and `False` on the same
cells, alternating, in one process; the scores compared bit for bit.

    PYTHONPATH=. python3 benchmarks/diag/segment_cells.py [--model DIR] [--device cpu|cuda] [--reps 5]

The cells: P1's, 16 layers (the model's) x 3 hooks x every position of a 16-token corrupt prompt
(random ids; three positions differ from the clean prompt, whose run is stored first), each
patching one (layer, hook, position) from the clean run, scored at two ids. Without `--model`, the
bundled model and its first equal-length clean/corrupt pair. On a GPU, vLLM's V1 runner
(`VLLM_USE_V2_MODEL_RUNNER=0`) offers segments; its V2 runner (the default) only with
`CAUSALBOARD_SEGMENTS=1` (docs/segmented-cells.md). One JSON line: the seconds of each repetition, the speed-up
(median / median), whether every cell's scores were equal and, where not, how many and which.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time


def p1_pair(eng, random_prompt: bool, tokens: int = 16) -> tuple[list[int], list[int], tuple[int, int]]:
    """(clean, corrupt, score ids) of these benchmarks: on a model folder of the benchmark
    (`random_prompt`), a random `tokens`-token prompt (seed 7) whose positions 3-5 differ in the
    corrupt one, scored at ids 1000 and 2000; else the model's first equal-length pair of `tasks.json`."""
    if random_prompt:
        rng = random.Random(7)
        hi = min(eng.info.vocab_size - 1, 16000)
        clean = [rng.randrange(4, hi) for _ in range(tokens)]
        corrupt = list(clean)
        corrupt[3:6] = [rng.randrange(4, hi) for _ in range(3)]
        return clean, corrupt, (1000 % hi, 2000 % hi)
    from pathlib import Path

    pair = next(p for p in json.loads((Path(eng.model_path) / "tasks.json").read_text())["pairs"] if p["equal_length"])
    return eng.tokenize(pair["clean_prompt"]), eng.tokenize(pair["corrupt_prompt"]), (pair["answer_id"], pair["foil_id"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--block-size", type=int, default=None, help="vLLM's KV block size (default: the engine's)")
    ap.add_argument("--batch-invariant", action="store_true", help="GPU: vLLM's batch-invariant kernels (off by default here)")
    ap.add_argument("--kv-gib", type=float, default=None, help="GPU: a fixed KV cache of this size (beside other engines)")
    args = ap.parse_args()
    from engine_ext import Engine
    from engine_ext.specs import Interventions, Patch, RunSource

    kw = dict(enforce_eager=False, max_model_len=4096, gpu_memory_utilization=0.8, batch_invariant=args.batch_invariant) \
        if args.device == "cuda" else {}
    if args.model:
        kw["model"] = args.model
        kw.setdefault("max_model_len", 4096)
    if args.kv_gib and args.device == "cuda":
        from benchmarks.gpu_validate import engine_memory

        mem = engine_memory(args.kv_gib, args.device, 0.8)
        kw["gpu_memory_utilization"] = mem["gpu_memory_utilization"]
        kw["engine_kwargs"] = dict(mem["engine_kwargs"])
    if args.block_size:
        kw["engine_kwargs"] = {**kw.get("engine_kwargs", {}), "block_size": args.block_size}
    eng = Engine(device=args.device, **kw).start()
    L, hooks = eng.info.num_layers, ("pre_attn", "post_attn", "post_block")
    clean, corrupt, score_ids = p1_pair(eng, args.model is not None)
    eng.capture(clean, [f"L{layer}.{h}" for layer in range(L) for h in hooks], "all_prompt", keep_as="seg-bench",
                return_values=False)
    cells = [Interventions(patch=(Patch.make(f"L{layer}.{h}", [p], RunSource("seg-bench")),))
             for layer in range(L) for h in hooks for p in range(len(corrupt))]

    async def run(segmented: bool) -> dict:
        out = {}
        async for i, res in eng.agenerate_cells(corrupt, cells, score_ids, segmented=segmented):
            if isinstance(res, Exception):
                raise res
            out[i] = res.scores[0]
        return out

    ref, got = asyncio.run(run(False)), asyncio.run(run(True))
    times: dict[str, list[float]] = {"alone": [], "segmented": []}
    for _ in range(args.reps):
        for name, seg in (("alone", False), ("segmented", True)):
            t = time.perf_counter()
            asyncio.run(run(seg))
            times[name].append(round(time.perf_counter() - t, 4))
    from engine_ext.engine.cells import segments_per_request

    differ = [i for i in ref if ref[i] != got[i]]
    names = [f"L{layer}.{h}@{p}" for layer in range(L) for h in hooks for p in range(len(corrupt))]
    # where the differing cells sit: their hook, and their segment's index in its request (as packed)
    from collections import Counter

    from engine_ext.engine import cells as packing

    seg_len, per = eng.segment_layout(len(corrupt)) or segments_per_request(
        len(corrupt), eng.segment_block or 16, eng.info.max_model_len, eng._segments_step_tokens)
    slot = {i: j for car in packing.pack(corrupt, cells, score_ids, seg_len, per, corrupt[-1]) for j, i in enumerate(car.cells)}
    by_hook = Counter(names[i].split(".")[1].split("@")[0] for i in differ)
    by_segment = Counter("first" if slot[i] == 0 else "later" for i in differ)

    length, k = segments_per_request(len(corrupt), eng.segment_block or 16, eng.info.max_model_len,
                                     eng._segments_step_tokens)
    print(json.dumps({"bench": "segment_cells", "model": args.model or "bundled", "device": args.device,
                      "block_size": eng.segment_block,
                      "cells": len(cells), "prompt_tokens": len(corrupt), "segment_len": length, "cells_per_request": k,
                      "equal_scores": all(ref[i] == got[i] for i in ref),
                      "max_abs_diff": max(abs(ref[i][t] - got[i][t]) for i in ref for t in ref[i]),
                      "cells_differing": len(differ), "first_differing": [names[i] for i in differ[:8]],
                      "differing_by_hook": dict(by_hook), "differing_by_segment": dict(by_segment),
                      "batch_invariant": args.batch_invariant, "alone_s": times["alone"],
                      "segmented_s": times["segmented"],
                      "speedup": round(statistics.median(times["alone"]) / statistics.median(times["segmented"]), 3),
                      "alone_cells_per_s": round(len(cells) / statistics.median(times["alone"]), 1),
                      "segmented_cells_per_s": round(len(cells) / statistics.median(times["segmented"]), 1)}), flush=True)
    eng.close()


if __name__ == "__main__":
    main()
