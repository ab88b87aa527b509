"""Does a steered decode repeat its held plan (write, compare and send nothing) on this host? Runs
batch-1 and batch-32 decodes steered at one site and at all layers, and prints, per run, the
workers' step counters from `Engine.intervention_status()` (`steps`, `steady_steps`: steps that
repeated the last step's plan, `held_steps`: of those, the ones the device's tables held already,
`uploads_skipped`). With the step-times recorder (`benchmarks/diag/steptimes`) on, the planner's
time per step as well.

    python3 benchmarks/diag/steady_steps.py --model /tmp/llama-1b [--device cuda] [--tokens 256]
"""
from __future__ import annotations

import argparse
import json

import numpy as np

from engine_ext import Engine, GenerationParams
from engine_ext.specs import Interventions, Steer

COUNTERS = ("steps", "steps_with_interventions", "steady_steps", "held_steps", "uploads_skipped")

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args()
    kw = dict(device="cuda", enforce_eager=False, max_model_len=4096, gpu_memory_utilization=0.3) if args.device == "cuda" else {}
    eng = Engine(model=args.model, **kw).start() if args.model else Engine(**kw).start()
    H, L = eng.info.hidden_size, eng.info.num_layers
    v = (np.random.default_rng(0).standard_normal(H) * 0.01).astype(np.float32)
    specs = {"one_site": Interventions(steer=(Steer.make([f"L{L // 2}.post_block"], v),)),
             "all_layers": Interventions(steer=(Steer.make([f"L{l}.post_block" for l in range(L)], v),))}
    params = GenerationParams(max_tokens=args.tokens, ignore_eos=True)
    for batch in (1, 32):
        for name, spec in specs.items():
            s0 = eng.intervention_status()["workers"]
            eng.generate([[5 + i, 6, 7, 8] for i in range(batch)], params, spec)
            s1 = eng.intervention_status()["workers"]
            delta = [{k: b.get(k, 0) - a.get(k, 0) for k in COUNTERS} for a, b in zip(s0, s1)]
            print(json.dumps({"bench": "steady_steps", "batch": batch, "variant": name, "workers": delta}), flush=True)
    eng.close()
