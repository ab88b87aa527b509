"""Layer skipping for sweep cells (docs/segmented-cells.md, "Layer skipping"): P1's cells (every
layer x 3 hooks x every position of a 16-token corrupt prompt, each patching one site from the
clean run), run as segmented requests three ways, alternating, in one process:

* `segmented`: all cells at once (`Engine.agenerate_cells`, the sweep's path today);
* `waves`: one `agenerate_cells` per patched layer, one after another (what the next variant
  needs, without skipping: the cost of the waves themselves);
* `entry`: the same waves with `entry_run` (the corrupt prompt's run, `pre_attn` at every layer
  and position): each wave's steps start at its layer;
* `entry_once`: all cells in one call with `entry_run` (the scheduler keeps each step to one entry
  layer: the path a sweep would take), and `entry_once_bandN` with `entry_band=N` (`--bands`).

Every cell's scores are compared with `segmented`'s, bit for bit. One JSON line.

    PYTHONPATH=. python3 benchmarks/diag/layer_entry.py [--model DIR] [--device cpu|cuda] [--reps 5]
        [--bands 2,4] [--no-batch-invariant] [--eager]

Without `--model`, the bundled model and its first equal-length clean/corrupt pair.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from segment_cells import p1_pair  # noqa: E402 (this file's sibling)

from benchmarks.diag.stack_sampler import arm_children, arm_spawned_child, sampled_window  # noqa: E402

arm_spawned_child()  # a spawned engine core (GPU) samples too when --stacks arms it


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--bands", type=lambda t: [int(x) for x in t.split(",") if x], default=[4],
                    help="entry bands to run as variants too (entry_once_bandN), comma-separated")
    ap.add_argument("--no-batch-invariant", action="store_true", help="cuda: vLLM's batch-invariant kernels off")
    ap.add_argument("--eager", action="store_true",
                    help="cuda: enforce_eager (layer skipping needs an eager forward; compiled engines run every layer)")
    ap.add_argument("--stacks", default="",
                    help="a folder: after the timed runs, one sampled window per --stack-variants variant "
                         "(stack_sampler.py: client-<variant>.json, the engine core's stack-<pid>-<variant>.json "
                         "with its step timeline)")
    ap.add_argument("--stack-variants", default="segmented,entry_once")
    args = ap.parse_args()
    flag = os.path.join(args.stacks, "sampling") if args.stacks else ""
    if args.stacks:
        arm_children(args.stacks, flag)
    from engine_ext import Engine
    from engine_ext.specs import Interventions, Patch, RunSource

    kw = dict(enforce_eager=args.eager, max_model_len=4096, gpu_memory_utilization=0.8,
              batch_invariant=not args.no_batch_invariant) \
        if args.device == "cuda" else {}
    if args.model:
        kw["model"] = args.model
    eng = Engine(device=args.device, **kw).start()
    L, hooks = eng.info.num_layers, ("pre_attn", "post_attn", "post_block")
    clean, corrupt, score_ids = p1_pair(eng, args.model is not None, args.prompt_tokens)
    eng.capture(clean, [f"L{layer}.{h}" for layer in range(L) for h in hooks], "all_prompt", keep_as="entry-clean",
                return_values=False)
    eng.capture(corrupt, [f"L{layer}.pre_attn" for layer in range(L)], "all_prompt", keep_as="entry-corrupt",
                return_values=False)
    n = len(corrupt)
    by_layer = [[Interventions(patch=(Patch.make(f"L{layer}.{h}", [p], RunSource("entry-clean")),))
                 for h in hooks for p in range(n)] for layer in range(L)]
    cells = [c for group in by_layer for c in group]

    async def run(group, entry_run=None, band=1) -> list:
        out = [None] * len(group)
        async for i, res in eng.agenerate_cells(corrupt, group, score_ids, segmented=True, entry_run=entry_run,
                                                entry_band=band):
            if isinstance(res, Exception):
                raise res
            out[i] = res.scores[0]
        return out

    async def waves(entry_run) -> list:
        out = []
        for group in by_layer:
            out += await run(group, entry_run)
        return out

    variants = {"segmented": lambda: run(cells), "waves": lambda: waves(None), "entry": lambda: waves("entry-corrupt"),
                "entry_once": lambda: run(cells, "entry-corrupt"),
                **{f"entry_once_band{b}": (lambda b=b: run(cells, "entry-corrupt", b)) for b in args.bands}}
    ref = asyncio.run(variants["segmented"]())
    equal = {name: asyncio.run(fn()) == ref for name, fn in variants.items()}
    before = eng.intervention_status()["workers"][0]
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.reps):
        for name, fn in variants.items():
            t = time.perf_counter()
            asyncio.run(fn())
            times[name].append(round(time.perf_counter() - t, 4))
    after = eng.intervention_status()["workers"][0]
    med = {k: statistics.median(v) for k, v in times.items()}
    print(json.dumps({"bench": "layer_entry", "model": args.model or "bundled", "device": args.device, "layers": L,
                      "runner": eng.info.runner, "batch_invariant": eng.info.batch_invariant,
                      "enforce_eager": eng.info.enforce_eager, "layer_entry_offered": eng.layer_entry_offered,
                      "cells": len(cells), "prompt_tokens": n, "equal_scores": equal,
                      "entered_steps": after["entered_steps"] - before["entered_steps"],
                      "layers_skipped": after["layers_skipped"] - before["layers_skipped"],
                      **{f"{k}_s": v for k, v in times.items()},
                      "entry_vs_waves": round(med["waves"] / med["entry"], 3),
                      **{f"{k}_vs_segmented": round(med["segmented"] / med[k], 3) for k in med if k.startswith("entry")}}),
          flush=True)
    for name in (v for v in args.stack_variants.split(",") if v and args.stacks):
        sampled_window(args.stacks, flag, name, lambda fn=variants[name]: asyncio.run(fn()), 3, "layer_entry_sampled")
    eng.close()


if __name__ == "__main__":
    main()
