"""Where P3's capture time goes with the engine core in its own process (vLLM's default on a GPU):
the stack sampler (`stack_sampler.py`) on every thread of this process and of the engine-core
process while capture repetitions run, plus the per-repetition times with and without capture.

    python3 benchmarks/diag/p3_stacks.py --model DIR [--device cuda] [--n 1000] [--reps 3] --dir OUT_DIR
    python3 benchmarks/diag/p3_stacks.py --model DIR --device cpu --multiprocess ...   # the core in its own process on a CPU

Samples one window of repetitions per variant (no capture, then capture): writes
OUT_DIR/stack-<pid>-<variant>.json (engine core) and OUT_DIR/client-<variant>.json; prints JSON lines.
"""
import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.diag.stack_sampler import arm_children, arm_spawned_child, sampled_window  # noqa: E402

arm_spawned_child()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--multiprocess", action="store_true",
                    help="on the CPU: vLLM's engine core in its own process, as on a GPU")
    args = ap.parse_args()
    flag = os.path.join(args.dir, "sampling")
    arm_children(args.dir, flag)
    from engine_ext import Engine, GenerationParams
    from engine_ext.specs import Capture, Interventions

    kw = dict(enforce_eager=False, max_model_len=4096, gpu_memory_utilization=0.8, batch_invariant=False) \
        if args.device == "cuda" else {}
    if args.multiprocess:
        kw["multiprocess"] = True
    eng = Engine(model=args.model, device=args.device, **kw).start()
    L = eng.info.num_layers
    hi = min(eng.info.vocab_size - 1, 128000)
    rng = random.Random(7)
    prompts = [[rng.randrange(4, hi) for _ in range(args.prompt_tokens)] for _ in range(args.n)]
    cap = Interventions(capture=Capture.make([f"L{layer}.post_block" for layer in range(L)], "last_prompt"))
    one = GenerationParams(max_tokens=1)
    eng.generate(prompts[:64], one, None)
    eng.generate(prompts[:64], one, cap)
    for _ in range(args.reps):
        for name, spec in (("vanilla", None), ("capture", cap)):
            t = time.perf_counter()
            eng.generate(prompts, one, spec)
            print(json.dumps({"bench": "p3", "variant": name, "seconds": round(time.perf_counter() - t, 4)}), flush=True)
    for name, spec in (("vanilla", None), ("capture", cap)):  # one sampled window per variant
        sampled_window(args.dir, flag, name, lambda spec=spec: eng.generate(prompts, one, spec), args.reps,
                       "p3_sampled")
    rings = [w.get("capture_ring") for w in eng.intervention_status()["workers"]]
    print(json.dumps({"bench": "p3_ring", "rings": rings}), flush=True)
    eng.close()


if __name__ == "__main__":
    main()
