"""Where the capture workload's extra time goes (issue #13, P3): 1000 distinct 16-token prompts,
capture of every layer's post_block at the last prompt token vs no capture, on an IN-PROCESS
engine so that cProfile sees the worker and the client in one process: `multiprocess=False`, and on
a GPU also `VLLM_ENABLE_V1_MULTIPROCESSING=0` in the environment (vLLM's default, on, wins over
`multiprocess=False`).

    python3 benchmarks/diag/p3_profile.py --model DIR [--device cuda] [--out FILE.txt]

Prints the timings (JSON lines) and the cProfile of one capture repetition (top functions by
cumulative and by own time). A diagnosis aid, not a benchmark: profiling slows Python down.
`host_work.py` (same folder) reports the per-request functions of this profile (and of P1's
patched cells) as ms per 1000 requests, one JSON line per repetition, to compare two versions.
"""
import argparse
import cProfile
import io
import json
import pstats
import random
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from engine_ext import Engine, GenerationParams
    from engine_ext.specs import Capture, Interventions

    kw = dict(enforce_eager=False, max_model_len=4096, gpu_memory_utilization=0.8, batch_invariant=False) if args.device == "cuda" else {}
    eng = Engine(model=args.model, device=args.device, multiprocess=False, **kw).start()
    L = eng.info.num_layers
    hi = min(eng.info.vocab_size - 1, 128000)
    prng = random.Random(7)
    prompts = [[prng.randrange(4, hi) for _ in range(16)] for _ in range(args.n)]
    cap = Interventions(capture=Capture.make([f"L{layer}.post_block" for layer in range(L)], "last_prompt"))
    one = GenerationParams(max_tokens=1)
    eng.generate(prompts[:64], one, None)
    eng.generate(prompts[:64], one, cap)
    for _ in range(3):
        for name, spec in (("vanilla", None), ("capture", cap)):
            t = time.perf_counter()
            eng.generate(prompts, one, spec)
            print(json.dumps({"bench": "p3_inproc", "variant": name, "seconds": round(time.perf_counter() - t, 4)}), flush=True)
    prof = cProfile.Profile()
    prof.enable()
    eng.generate(prompts, one, cap)
    prof.disable()
    text = io.StringIO()
    st = pstats.Stats(prof, stream=text)
    st.sort_stats("cumulative").print_stats(45)
    st.sort_stats("tottime").print_stats(30)
    print(text.getvalue())
    if args.out:
        with open(args.out, "w") as f:
            f.write(text.getvalue())
    eng.close()


if __name__ == "__main__":
    main()
