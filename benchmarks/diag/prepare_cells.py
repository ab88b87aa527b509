"""What preparing a sweep's cells costs on the host (`Engine.prepare_cells`: validation, packing,
the vLLM requests), with and without layer skipping's entry patches (docs/segmented-cells.md):
P1's cells (every layer x 3 hooks x every position of a `--prompt-tokens` prompt, each patching
one site from a stored run), `--reps` preparations of each, alternating. Nothing is run: the
stored runs need not exist. One JSON line with the medians and the patches per preparation.

    PYTHONPATH=<tree> python3 benchmarks/diag/prepare_cells.py [--model DIR] [--reps 9]

To compare two trees, run it against each (`PYTHONPATH=/tmp/old-tree`) in alternating processes.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="model folder (default: the bundled model)")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    from engine_ext import Engine
    from engine_ext.specs import Interventions, Patch, RunSource

    eng = Engine(**({"model": args.model} if args.model else {}), device="cpu").start()
    L = eng.info.num_layers
    rng = random.Random(0)
    prompt = [rng.randrange(4, eng.info.vocab_size - 1) for _ in range(args.prompt_tokens)]
    cells = [Interventions(patch=(Patch.make(f"L{layer}.{h}", [p], RunSource("clean")),))
             for layer in range(L) for h in ("pre_attn", "post_attn", "post_block") for p in range(len(prompt))]
    times: dict[str, list[float]] = {"plain": [], "entry": []}
    patches = {}
    for _ in range(args.reps + 1):  # the first round warms up
        for name, kw in (("plain", {}), ("entry", {"entry_run": "corrupt"})):
            t = time.perf_counter()
            prepared = eng.prepare_cells(prompt, cells, (1, 2), segmented=True, **kw)
            times[name].append(time.perf_counter() - t)
            patches[name] = sum(len(what.spec.patch) for _, _, what, _ in prepared.requests if hasattr(what, "spec"))
    print(json.dumps({"bench": "prepare_cells", "label": args.label, "model": args.model or "bundled", "layers": L,
                      "cells": len(cells), "layer_entry_offered": eng.layer_entry_offered,
                      **{f"{k}_ms": round(1000 * statistics.median(v[1:]), 2) for k, v in times.items()},
                      **{f"{k}_patches": v for k, v in patches.items()}}), flush=True)
    eng.close()


if __name__ == "__main__":
    main()
