#!/usr/bin/env python3
"""causalboard's engine on the workloads of vllm_bench.py (same model folder, same
prompts), one engine per process. Every result line starts with {"bench": ...}.

Run by run_compare.sh (see docs/performance.md) with the project's root first on PYTHONPATH:

    python3 cb_bench.py --model DIR --tasks p2,p1,p3,p1http [--batch-invariant on|off]

p2  decode: batch 1 and 32, distinct random 16-token prompts (seed 100+batch), 256 tokens,
    ignore_eos; vanilla (no spec), every request steered at L8.post_block, every request steered
    at all 16 layers' post_block. Interleaved per repetition; 1 warm-up + 3 timed (`--p2-reps N`: N).
p1  the P1 sweep workload through the engine API (no HTTP): the same 16-token prompt
    (random ids, seed 0) as vllm_bench p1; clean run captured once; 768 one-token requests, each
    patching one (layer, hook, position) of 16 x 3 x 16 from the clean run, scoring ids 1000/2000;
    one Engine.generate call per repetition; and the same 768 requests with no spec (vanilla
    through the engine). 1 warm-up + 5 timed.
p1http  the same sweep through POST /v1/patch_sweep (uvicorn in-process), layers 0-15,
    positions all_prompt, hooks pre_attn/post_attn/post_block, metric logprob: cells/s.
p3  capture all 16 layers post_block at last_prompt for 1000 distinct 16-token prompts
    (max_tokens 1) vs the same 1000 prompts with no spec. 1 warm-up + 3 timed (`--p2-reps N`: N), interleaved.
"""
import argparse
import json
import random
import statistics
import time

A_ID, B_ID = 1000, 2000


def emit(tag, **kw):
    print(json.dumps({"bench": tag, **kw}, default=str), flush=True)


def timed(fn, reps):
    fn()  # warm-up
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tasks", default="p2,p1,p3,p1http")
    ap.add_argument("--batch-invariant", choices=["on", "off"], default="off")
    ap.add_argument("--tag", default="cb")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--p3-prompts", type=int, default=None, help="P3's prompt count (default: 1000, 50 on a smoke model)")
    ap.add_argument("--multiprocess", action="store_true",
                    help="CPU: vLLM's engine core in a process of its own, as on a GPU (the CPU default is in-process)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--p2-reps", type=int, default=None,
                    help="timed repetitions of p2 and p3 (default: 3 on the anchor model, --reps on a smoke model)")
    args = ap.parse_args()

    import numpy as np
    from engine_ext import Engine, GenerationParams
    from engine_ext.specs import Capture, Interventions, Patch, RunSource, Steer

    t0 = time.perf_counter()
    if args.device == "cuda":
        eng = Engine(model=args.model, device="cuda", enforce_eager=False, max_model_len=4096,
                     gpu_memory_utilization=0.8, batch_invariant=(args.batch_invariant == "on")).start()
    else:
        eng = Engine(model=args.model, multiprocess=args.multiprocess).start()
    info = eng.info
    emit(f"{args.tag}_start", seconds=round(time.perf_counter() - t0, 1), info=str(info))
    L, H = info.num_layers, info.hidden_size
    tasks = args.tasks.split(",")
    global A_ID, B_ID
    big = info.vocab_size > 128000  # the anchor model; a small vocab only for a CPU smoke run
    reps3 = args.p2_reps or (3 if big else args.reps)  # 3 timed repetitions unless asked, shortened for a smoke run
    lo, hi = (1000, 128000) if big else (4, info.vocab_size - 1)
    if not big:
        A_ID, B_ID = 10, 20
    ntok, n3 = (256, 1000) if big else (8, 50)
    n3 = args.p3_prompts or n3

    if "p2" in tasks:
        v = (np.random.default_rng(0).standard_normal(H) * 0.01).astype(np.float32)
        specs = {"vanilla": None,
                 "steer_1site": Interventions(steer=(Steer.make([f"L{L // 2}.post_block"], v),)),
                 "steer_all_layers": Interventions(steer=(Steer.make([f"L{l}.post_block" for l in range(L)], v),))}
        params = GenerationParams(max_tokens=ntok, ignore_eos=True)
        for batch in (32, 1):
            rng = random.Random(100 + batch)
            prompts = [[rng.randrange(lo, hi) for _ in range(16)] for _ in range(batch)]
            times = {k: [] for k in specs}
            for k, s in specs.items():  # warm-up
                eng.generate(prompts, GenerationParams(max_tokens=8, ignore_eos=True), s)
            for _ in range(reps3):
                for k, s in specs.items():
                    t = time.perf_counter()
                    gens = eng.generate(prompts, params, s)
                    times[k].append(time.perf_counter() - t)
                    assert sum(len(g.token_ids) for g in gens) == batch * ntok
            for k, ts in times.items():
                emit(f"{args.tag}_p2", batch=batch, variant=k, tok_s=round(batch * ntok / statistics.median(ts), 1),
                     reps_s=[round(x, 4) for x in ts])

    rng = random.Random(0)
    prompt = [rng.randrange(lo, hi) for _ in range(16)]
    hooks = ("pre_attn", "post_attn", "post_block")
    cells = [(l, h, p) for l in range(L) for h in hooks for p in range(16)]

    if "p1" in tasks:
        eng.capture(prompt, [f"L{l}.{h}" for l in range(L) for h in hooks], "all_prompt", keep_as="clean",
                    return_values=False)
        corrupt = list(prompt)
        corrupt[3:6] = [rng.randrange(lo, hi) for _ in range(3)]
        # like stock's P1 (`vllm_bench.py`: `detokenize=False`): scores read, no text decoded
        one = GenerationParams(max_tokens=1, detokenize=False)
        score = (A_ID, B_ID)
        patched = [Interventions(patch=(Patch.make(f"L{l}.{h}", [p], RunSource("clean", (p,))),), score_token_ids=score)
                   for l, h, p in cells]
        plain = [Interventions(score_token_ids=score)] * len(cells)
        res = {}

        def run(specs_):
            gens = eng.generate([corrupt] * len(cells), one, specs_)
            res["last"] = gens

        for name, sp in (("engine_patched_768", patched), ("engine_scored_only_768", plain), ("engine_nospec_768", None)):
            ts = timed(lambda: run(sp), args.reps)
            m = statistics.median(ts)
            extra = {}
            if name == "engine_patched_768":
                g = res["last"]
                vals = np.array([x.scores[0][A_ID] for x in g])
                extra = {"status_counts": {s: sum(1 for x in g if x.intervention and x.intervention.status == s)
                                           for s in {x.intervention.status for x in g if x.intervention}},
                         "metric_spread": float(vals.max() - vals.min())}
            emit(f"{args.tag}_p1", variant=name, cells_per_s=round(len(cells) / m, 1), median_s=round(m, 4),
                 reps_s=[round(x, 4) for x in ts], **extra)

    if "p3" in tasks:
        prng = random.Random(7)
        prompts = [[prng.randrange(lo, hi) for _ in range(16)] for _ in range(n3)]
        cap = Interventions(capture=Capture.make([f"L{l}.post_block" for l in range(L)], "last_prompt"))
        one = GenerationParams(max_tokens=1)
        times = {"vanilla": [], "capture_all_layers_last": []}
        eng.generate(prompts[:64], one, None)
        eng.generate(prompts[:64], one, cap)
        for _ in range(reps3):
            for k, s in (("vanilla", None), ("capture_all_layers_last", cap)):
                t = time.perf_counter()
                gens = eng.generate(prompts, one, s)
                times[k].append(time.perf_counter() - t)
                if s is not None:
                    assert all(len(g.intervention.captures) == L for g in gens), "missing captures"
        for k, ts in times.items():
            emit(f"{args.tag}_p3", variant=k, prompts_per_s=round(n3 / statistics.median(ts), 1),
                 reps_s=[round(x, 4) for x in ts])

    if "p1http" in tasks or "p1chttp" in tasks:
        import httpx

        from benchmarks.serve_api import serve_in_thread

        url, server, _ = serve_in_thread(eng)
        words = lambda ids: " ".join(f"t{i}" for i in ids)  # noqa: E731 (synthetic word-level tokenizer)
        corrupt = list(prompt)
        corrupt[3:6] = [9001, 9002, 9003]
        body = {"prompt": words(corrupt), "clean_prompt": words(prompt),
                "answer_token_id": A_ID, "foil_token_id": B_ID, "metric": "logprob",
                "hooks": list(hooks), "max_concurrency": 1024}
        rng5 = random.Random(5)
        long_clean = [rng5.randrange(lo, hi) for _ in range(128)]
        long_corrupt = list(long_clean)
        long_corrupt[40:43] = [9001, 9002, 9003]
        bodies = []
        if "p1http" in tasks:
            bodies.append(("p1http", body))
        if "p1chttp" in tasks and big:
            bodies.append(("p1chttp", {**body, "prompt": words(long_corrupt), "clean_prompt": words(long_clean),
                                       "hooks": ["post_block"]}))
        with httpx.Client(base_url=url, timeout=600) as c:
            for tag, bd in bodies:
                def sweep():
                    r = c.post("/v1/patch_sweep", json=bd)
                    r.raise_for_status()
                    return r.json()
                sweep()
                ts = []
                for _ in range(reps3):
                    t = time.perf_counter()
                    r = sweep()
                    ts.append(time.perf_counter() - t)
                m = statistics.median(ts)
                emit(f"{args.tag}_{tag}", cells=r.get("cells_done"), prompt_tokens=len(r.get("prompt_token_ids") or []),
                     cells_per_s=round(r["cells_done"] / m, 1), median_s=round(m, 4), reps_s=[round(x, 4) for x in ts],
                     noise_floor=r.get("noise_floor"))
        server.should_exit = True
    eng.close()


if __name__ == "__main__":
    main()
