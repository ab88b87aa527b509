"""Where the host time of a dynamic-steering decode step goes (issue 15): cProfile around one
batch-32 decode per variant of `benchmarks/dynamic_variants.py`, in an IN-PROCESS engine (the
worker's Python runs in this process), printing per variant the functions with the most own time,
in microseconds per decode step.

    PYTHONPATH=. python3 benchmarks/diag/dynamic_profile.py [--model DIR] [--device cuda] [--tokens 128] [--top 30]

cProfile slows Python calls down (several times for small functions), so the figures rank the
host work; they are not its time without the profiler (that is `dynamic_host.py`).
"""
import argparse
import cProfile
import json
import os
import pstats


os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # profile the worker in this process


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--variants", default="vanilla,threshold_on,proportional")
    args = ap.parse_args()

    from benchmarks.dynamic_variants import in_process_engine, workload
    from engine_ext import GenerationParams

    eng = in_process_engine(args.model, args.device)
    variants, _, prompts = workload(eng, 32, 132)
    params = GenerationParams(max_tokens=args.tokens, ignore_eos=True)
    for name in args.variants.split(","):
        dyn = variants[name]
        eng.generate(prompts, GenerationParams(max_tokens=8, ignore_eos=True), dynamic=dyn)  # warm-up
        pr = cProfile.Profile()
        pr.enable()
        eng.generate(prompts, params, dynamic=dyn)
        pr.disable()
        st = pstats.Stats(pr)
        rows = []
        for (file, line, fn), (cc, nc, tt, ct, _) in st.stats.items():
            rows.append((tt, ct, nc, f"{os.path.basename(os.path.dirname(file))}/{os.path.basename(file)}:{line}({fn})",
                         "engine_ext" in file))
        rows.sort(reverse=True)
        total = sum(r[0] for r in rows)
        print(json.dumps({"bench": "dyn_profile", "variant": name, "steps": args.tokens,
                          "total_us_per_step": round(total * 1e6 / args.tokens, 1)}), flush=True)
        for tt, ct, nc, where, _ in rows[: args.top]:
            print(f"  {tt * 1e6 / args.tokens:9.1f} own {ct * 1e6 / args.tokens:9.1f} cum {nc / args.tokens:7.1f} calls  {where}")
        ours = sorted((r for r in rows if r[4]), key=lambda r: -r[1])[:25]
        print("  -- causalboard functions by cumulative time --")
        for tt, ct, nc, where, _ in ours:
            print(f"  {tt * 1e6 / args.tokens:9.1f} own {ct * 1e6 / args.tokens:9.1f} cum {nc / args.tokens:7.1f} calls  {where}")
    eng.close()


if __name__ == "__main__":
    main()
