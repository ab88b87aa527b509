"""Where P1's time goes, stock vLLM against causalboard, with the engine core in its own process
(vLLM's default on a GPU): the stack sampler (`stack_sampler.py`) on every thread of this process
and of the engine-core process, and the core's step timeline (`core_timeline.py`), while the P1
workload of `benchmarks/compare/` runs: 768 one-token requests on one 16-token prompt (random ids,
seed 0), scoring ids 1000 / 2000.

    python3 benchmarks/diag/p1_stacks.py --engine stock --model DIR --dir OUT_DIR [--reps 3]
    python3 benchmarks/diag/p1_stacks.py --engine cb --model DIR --dir OUT_DIR [--reps 3] [--device cpu]

`stock`: vLLM's `LLM` as `benchmarks/compare/vllm_bench.py p1` builds it (dummy weights, no
tokenizer, `logprob_token_ids`), variant `stock`. `cb`: causalboard's `Engine`, variants `nospec`
(no spec), `scored` (`score_token_ids` only) and `patched` (each cell patches one (layer, hook,
position) of 16 x 3 x 16 from a stored clean run, as `cb_bench.py p1`), and with `--http` `sweep_http`
(the same cells as one `POST /v1/patch_sweep`, as `cb_bench.py p1http`; `--wake-ab` adds
`sweep_http_nowake`, the same with the engine loop's thread never woken for a command,
`--entry-ab` adds `sweep_http_noentry`, the sweep with every layer run (no layer skipping),
`--chunk-ab` adds `<variant>_onemsg`, each batch in one message to the core instead of
`seam.BATCH_CHUNKS`, `--sweep-groups 256,768` adds `sweep_http_g256`, ..., the sweep's fan-out in groups of that many
cells, `--compilation-config JSON` passes vLLM's `compilation_config` to either engine (CUDA-graph
sizes for the large prefill steps of P1), `--multiprocess` (cb on the CPU) runs vLLM's engine core in its own
process as on a GPU, so its stacks and step timeline are recorded there too, `--variants a,b` runs only those, and `--interleave` times them round-robin, one repetition of
each in turn, for A/B comparisons on a noisy machine). Per variant: `--reps`
timed calls (`p1` lines), then one sampled window of `--reps` calls (`p1_sampled` lines; reports
OUT_DIR/client-<variant>.json, causalboard's with the client's `client_events`, and
OUT_DIR/stack-<pid>-<variant>.json, the engine core's with its `core_events`; both timelines in
seconds from the window's start). One engine per process.
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
A_ID, B_ID = 1000, 2000


def stock_variants(args, prompt):
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    import torch
    from vllm import LLM, SamplingParams

    gpu = torch.cuda.is_available()
    kw = dict(model=args.model, load_format="dummy", dtype="bfloat16" if gpu else "float32", skip_tokenizer_init=True,
              attention_backend="TRITON_ATTN" if gpu else "CPU_ATTN", enforce_eager=not gpu, enable_prefix_caching=True,
              seed=0, **({"gpu_memory_utilization": 0.8} if gpu else {}))
    if args.compilation_config:
        kw["compilation_config"] = json.loads(args.compilation_config)
    llm = LLM(**kw)
    reqs = [{"prompt_token_ids": list(prompt)} for _ in range(768)]
    sp = SamplingParams(max_tokens=1, temperature=0.0, logprob_token_ids=[A_ID, B_ID], detokenize=False)
    return {"stock": lambda: llm.generate(reqs, sp, use_tqdm=False)}, llm.llm_engine.engine_core.shutdown, None


def cb_variants(args, prompt):
    from engine_ext import Engine, GenerationParams
    from engine_ext.specs import Interventions, Patch, RunSource

    kw = dict(enforce_eager=False, max_model_len=4096, gpu_memory_utilization=0.8, batch_invariant=False) \
        if args.device == "cuda" else {}
    if args.multiprocess:
        kw["multiprocess"] = True
    if args.compilation_config:
        kw["engine_kwargs"] = {"compilation_config": json.loads(args.compilation_config)}
    eng = Engine(model=args.model, device=args.device, **kw).start()
    from benchmarks.diag import core_timeline

    core_timeline.install_client(eng)  # the client's steps, adds, result waits and preparation, timed
    L = eng.info.num_layers
    hooks = ("pre_attn", "post_attn", "post_block")
    cells = [(layer, h, p) for layer in range(L) for h in hooks for p in range(len(prompt))]
    eng.capture(prompt, [f"L{layer}.{h}" for layer in range(L) for h in hooks], "all_prompt", keep_as="clean",
                return_values=False)
    corrupt = list(prompt)
    corrupt[3:6] = [9001 % eng.info.vocab_size, 9002 % eng.info.vocab_size, 9003 % eng.info.vocab_size]
    one = GenerationParams(max_tokens=1, detokenize=False)  # like stock's (no text, no token strings decoded)
    score = (A_ID, B_ID)
    patched = [Interventions(patch=(Patch.make(f"L{layer}.{h}", [p], RunSource("clean", (p,))),), score_token_ids=score)
               for layer, h, p in cells]
    scored = [Interventions(score_token_ids=score)] * len(cells)
    prompts = [corrupt] * len(cells)
    variants = {name: (lambda specs=specs: eng.generate(prompts, one, specs))
                for name, specs in (("nospec", None), ("scored", scored), ("patched", patched))}
    if eng.segment_layout(len(corrupt)) is not None:  # the same cells as the segments of shared requests
        import asyncio

        cell_specs = [Interventions(patch=s.patch) for s in patched]

        async def _cells():
            async for _, res in eng.agenerate_cells(corrupt, cell_specs, score, segmented=True):
                if isinstance(res, Exception):
                    raise res
        variants["cells_seg"] = lambda: asyncio.run(_cells())
    if args.chunk_ab:  # each variant also with every batch in one message (the eleventh session's submission)
        from engine_ext.worker import seam

        variants.update({f"{k}_onemsg": _with_attributes(v, seam, BATCH_CHUNKS=(1 << 30,)) for k, v in list(variants.items())})
    close = eng.close
    if args.http:
        sweep, stop = _http_sweep(eng, prompt, corrupt, hooks)
        variants["sweep_http"] = sweep
        if args.wake_ab:  # the same sweep with the loop thread never woken for a command
            variants["sweep_http_nowake"] = _with_attributes(sweep, eng._loop, _wakeable=False)
        if args.sweep_groups:  # the fan-out's groups of g cells (the service's constants, set for the call)
            from app.sweep import service

            for g in (int(x) for x in args.sweep_groups.split(",") if x):
                variants[f"sweep_http_g{g}"] = _with_attributes(sweep, service, GROUP_MAX=g, GROUPS_PER_WINDOW=1,
                                                                 SEGMENTED_GROUP_MAX=g)
        if args.seg_ab:  # the same sweep with every cell its own request (no segments)
            from app.sweep import service

            variants["sweep_http_noseg"] = _with_attributes(sweep, service, segments_default=lambda *a, **k: False)
        if args.entry_ab:  # the same sweep with every layer run (no layer skipping)
            variants["sweep_http_noentry"] = _with_attributes(sweep, type(eng), layer_entry_offered=False)
        if args.chunk_ab:
            variants["sweep_http_onemsg"] = _with_attributes(sweep, seam, BATCH_CHUNKS=(1 << 30,))

        def close():
            stop()
            eng.close()
    return variants, close, lambda since: {"client_events": core_timeline.client_events(since)}


def _with_attributes(run, owner, **values):
    """`run` with `owner`'s attributes set to `values` for each call (restored after it)."""
    def wrapped():
        saved = {name: getattr(owner, name) for name in values}
        for name, value in values.items():
            setattr(owner, name, value)
        try:
            return run()
        finally:
            for name, value in saved.items():
                setattr(owner, name, value)
    return wrapped


def _http_sweep(eng, clean, corrupt, hooks):
    """`POST /v1/patch_sweep` of the same cells (`cb_bench.py p1http`'s body): the API served
    in-process (uvicorn in a thread). Returns (one sweep, stop the server)."""
    import httpx

    from benchmarks.serve_api import serve_in_thread

    url, server, _ = serve_in_thread(eng)
    words = lambda ids: " ".join(f"t{i}" for i in ids)  # noqa: E731 (the benchmark model's word-level tokenizer)
    body = {"prompt": words(corrupt), "clean_prompt": words(clean), "answer_token_id": A_ID, "foil_token_id": B_ID,
            "metric": "logprob", "hooks": list(hooks), "max_concurrency": 1024}
    client = httpx.Client(base_url=url, timeout=600)

    def sweep():
        r = client.post("/v1/patch_sweep", json=body)
        r.raise_for_status()
        assert r.json()["cells_done"] > 0, r.json().get("notes")
        return {"segmented": r.json().get("segmented"), "cells": r.json()["cells_done"]}

    def stop():
        client.close()
        server.should_exit = True
    return sweep, stop


def main():
    global A_ID, B_ID
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=["stock", "cb"], required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--multiprocess", action="store_true",
                    help="cb on the CPU: vLLM's engine core in its own process, as on a GPU (its stacks and step timeline)")
    ap.add_argument("--http", action="store_true", help="cb: also the same cells as one sweep over HTTP (variant sweep_http)")
    ap.add_argument("--wake-ab", action="store_true",
                    help="cb --http: also the sweep with the engine loop never woken for a command (sweep_http_nowake)")
    ap.add_argument("--chunk-ab", action="store_true",
                    help="cb: also each variant with every batch sent to the core in one message (<variant>_onemsg)")
    ap.add_argument("--sweep-groups", default="",
                    help="cb --http: also the sweep with the fan-out's groups of each of these sizes (sweep_http_gN)")
    ap.add_argument("--seg-ab", action="store_true",
                    help="cb --http: also the sweep with every cell its own request (sweep_http_noseg; "
                         "segments where the engine runs them: docs/segmented-cells.md)")
    ap.add_argument("--entry-ab", action="store_true",
                    help="cb --http: also the sweep with every layer run (sweep_http_noentry; layer skipping "
                         "where the engine offers it: docs/segmented-cells.md)")
    ap.add_argument("--interleave", action="store_true",
                    help="timed repetitions round-robin over the variants (then the sampled windows)")
    ap.add_argument("--compilation-config", default="",
                    help="JSON: vLLM's compilation_config for either engine (e.g. more CUDA-graph sizes: "
                         '\'{"cudagraph_capture_sizes": [1, 2, 4, 8, ..., 4096, 8192]}\')')
    ap.add_argument("--variants", default="", help="comma-separated variants to run (default: all)")
    args = ap.parse_args()
    flag = os.path.join(args.dir, "sampling")
    arm_children(args.dir, flag)
    with open(os.path.join(args.model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    if vocab <= 128000:  # a small CPU smoke model
        A_ID, B_ID = 10, 20
    rng = random.Random(0)
    prompt = [rng.randrange(4, min(vocab - 1, 128000)) for _ in range(16)]
    variants, close, extra = (stock_variants if args.engine == "stock" else cb_variants)(args, prompt)
    if args.variants:
        keep = args.variants.split(",")
        variants = {k: v for k, v in variants.items() if k in keep}
    def timed(name, run):
        t = time.perf_counter()
        run()
        print(json.dumps({"bench": "p1", "engine": args.engine, "variant": name,
                          "seconds": round(time.perf_counter() - t, 4)}), flush=True)

    def warm(name, run):
        got = run()
        if isinstance(got, dict):  # a sweep: how its cells ran
            print(json.dumps({"bench": "p1_sweep_mode", "variant": name, **got}), flush=True)

    if args.interleave:  # A/B comparisons: the machine's slow phases hit every variant alike
        for name, run in variants.items():
            warm(name, run)
        for _ in range(args.reps):
            for name, run in variants.items():
                timed(name, run)
        for name, run in variants.items():
            sampled_window(args.dir, flag, name, run, args.reps, "p1_sampled", extra)
    else:
        for name, run in variants.items():
            warm(name, run)
            for _ in range(args.reps):
                timed(name, run)
            sampled_window(args.dir, flag, name, run, args.reps, "p1_sampled", extra)
    close()
    sys.stdout.flush()
    os._exit(0)  # stock's LLM: no slow interpreter shutdown


if __name__ == "__main__":
    main()
