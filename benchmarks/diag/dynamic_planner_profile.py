"""cProfile of dynamic steering's per-step worker host work (`benchmarks/dynamic_planner_bench.py`'s
batch-32 steps: `WorkerState.plan_step` + `after_forward`, no forward), one variant at a time, on
the worker's device (`--device cuda` on a GPU host: the host time of the torch launches as the
engine pays it). Prints, per variant, the functions by their own time and the torch/numpy calls
by count, per step.

    PYTHONPATH=. python3 benchmarks/diag/dynamic_planner_profile.py --device cuda [--steps 300]
        [--variants threshold_on,proportional@device,proportional@host]
"""
import argparse
import cProfile
import io
import pstats

import numpy as np

from benchmarks import dynamic_planner_bench as bench


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--top", type=int, default=35)
    ap.add_argument("--variants", default="monitor_only,threshold_on,proportional@device,proportional@host")
    args = ap.parse_args()
    v = (np.random.default_rng(1).standard_normal(bench.H) * 0.01).astype(np.float32)
    all_variants = bench.variants(v)
    for spec in args.variants.split(","):
        name, _, where = spec.partition("@")
        decisions = {"": "auto", "device": True, "host": False}[where]
        dyn = all_variants[name]
        bench.run(dyn, 20, device=args.device, decisions=decisions)  # warm-up (kernels compiled)
        pr = cProfile.Profile()
        pr.enable()
        out = bench.run(dyn, args.steps, device=args.device, decisions=decisions)
        pr.disable()
        s = io.StringIO()
        st = pstats.Stats(pr, stream=s)
        st.sort_stats("tottime").print_stats(args.top)
        print(f"===== {spec} ({args.device}, {args.steps} steps): {out}")
        print(s.getvalue())


if __name__ == "__main__":
    main()
