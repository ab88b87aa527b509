"""Sweep throughput over HTTP (issue #13, P1 over `POST /v1/patch_sweep`), on the CPU with the
bundled model by default: serve the API in-process (uvicorn in a thread, the engine in-process),
run the same sweep several times, print cells/s.

    PYTHONPATH=. python3 benchmarks/diag/sweep_http.py [--model DIR] [--device cpu|cuda] [--reps 5]
        [--pair K] [--hooks pre_attn,post_attn,post_block] [--max-concurrency N] [--words N]
        [--prompt-tokens N] [--prefix-reuse default|on|off|both] [--cpu-threads N]
        [--batch-invariant default|on|off] [--stack-dir DIR] [--multiprocess]
        [--switch-interval S] [--layers JSON] [--positions JSON]

The sweep: the K-th equal-length clean/corrupt pair of the model's `tasks.json`, padded in front
with `--words` filler words (8: 13 tokens with the bundled model; 27: 32 tokens, i.e. 768 cells
over its 8 layers and 3 hooks, the GPU workload's cell count); a model folder without
`tasks.json` (the benchmark model of `benchmarks/compare/`) gets `cb_bench.py p1http`'s 16-token
word prompts and answer/foil ids (`--prompt-tokens 128`: P1c's prompt length). Every layer x every prompt position x the hooks, metric
logprob, non-streaming (the whole summary is the response). One warm-up sweep, then `--reps`
timed ones; each timed sweep's wall time is the HTTP round trip (plan, clean capture, baselines,
the cells, summary), as in `cb_bench.py p1http`.

The CPU's speed is bimodal per process (the same decode runs at ~50 tok/s in some processes and
~1,000+ tok/s in others; docs/performance.md): before the sweeps, a short decode probe (8 x 48
tokens) reports `decode_tok_s` and the process's `mode` (`fast` above 300 tok/s, else `slow`).
Compare only processes of the same mode.

Wall time on a shared machine moves with the other processes' load, so each sweep also reports
the CPU time (utime + stime from `/proc/self/task/TID/stat`, 10 ms ticks) of the thread that
runs the API's event loop (`api_cpu_s`: HTTP, the sweep service, the client side of every
request), of the engine-loop thread (`engine_cpu_s`: vLLM's scheduler and, on a CPU, the
forward's main thread) and of the whole process (`process_cpu_s`, OpenMP workers included): the
API thread's CPU per cell is the cost the per-cell asyncio path puts on the host, and it is far
less sensitive to the load than wall time.

`--prefix-reuse` sets the request's `prefix_reuse` (`default`: leave it to the server); `both`
runs every repetition twice in the same process, reuse on then off (same CPU mode, same load),
reports a summary per variant and checks that the two sweeps' grids are bit-identical
(`grids_equal` on each `sweep` line of the second variant): the exactness claim of prefix reuse,
measured where the speed is.

To compare two trees, run this file from one tree against the other's code
(`PYTHONPATH=/tmp/old-tree python3 benchmarks/diag/sweep_http.py`): it uses only the HTTP API
and `Engine`, which both sides have. Output: JSON lines (`probe`, `sweep` per repetition, `summary`).
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import time


def sweep_pair_body(model_dir: str, pair: int = 0, words: int = 0, prompt_tokens: int = 16) -> dict:
    """A sweep's prompts and scored ids: the `pair`-th equal-length pair of the model folder's
    `tasks.json`, padded in front with `words` filler words; without `tasks.json` (the benchmark
    model of benchmarks/compare, word-level tokenizer "t<id>"), cb_bench.py p1http's
    `prompt_tokens`-long word prompts and answer/foil ids. (Also used by sweep_phases.py.)"""
    tasks_path = os.path.join(model_dir, "tasks.json")
    if os.path.exists(tasks_path):
        with open(tasks_path) as f:
            chosen = [p for p in json.load(f)["pairs"] if p["equal_length"]][pair]
        filler = "".join(("and ", "then ")[k % 2] for k in range(words))
        return {"prompt": filler + chosen["corrupt_prompt"], "clean_prompt": filler + chosen["clean_prompt"],
                "answer_token_id": chosen["answer_id"], "foil_token_id": chosen["foil_id"]}
    rng = random.Random(0)
    clean = [rng.randrange(1000, 128000) for _ in range(prompt_tokens)]
    corrupt = list(clean)
    corrupt[3:6] = [9001, 9002, 9003]
    return {"prompt": " ".join(f"t{i}" for i in corrupt), "clean_prompt": " ".join(f"t{i}" for i in clean),
            "answer_token_id": 1000, "foil_token_id": 2000}


def emit(tag: str, **kw) -> None:
    print(json.dumps({"bench": tag, **kw}, default=str), flush=True)


def thread_cpu_s(native_id: int) -> float:
    """CPU seconds (user + system) a thread of this process has used so far."""
    with open(f"/proc/self/task/{native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_snapshot(api_tid: int, engine_tid: int) -> tuple[float, float, float]:
    t = os.times()
    return thread_cpu_s(api_tid), thread_cpu_s(engine_tid), t.user + t.system


def git_head(path: str) -> str:
    try:
        return subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except Exception:
        return "?"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--pair", type=int, default=0)
    ap.add_argument("--hooks", default="pre_attn,post_attn,post_block")
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--words", type=int, default=8, help="filler words put in front of both prompts")
    ap.add_argument("--label", default="", help="a free label copied into every line (e.g. old/new)")
    ap.add_argument("--prompt-tokens", type=int, default=16, help="prompt length for a model without tasks.json")
    ap.add_argument("--prefix-reuse", choices=["default", "on", "off", "both"], default="default")
    ap.add_argument("--cpu-threads", type=int, default=None, help="CPU: the engine's cpu_threads (default: its rule)")
    ap.add_argument("--stack-dir", default=None,
                    help="sample every thread's stack (this process and the engine-core process) during the timed "
                         "sweeps; reports to DIR/stack-<pid>.json (benchmarks/diag/stack_sampler.py)")
    ap.add_argument("--layers", default=None, help="the sweep's `layers` as JSON (e.g. [0]: with --positions [-1]"
                    " and one hook, a one-cell sweep, whose time is its setup and teardown)")
    ap.add_argument("--positions", default=None, help="the sweep's `positions` as JSON")
    ap.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval (s) for this process")
    ap.add_argument("--multiprocess", action="store_true", help="CPU: run vLLM's engine core in its own process, as on a GPU")
    ap.add_argument("--batch-invariant", choices=["default", "on", "off"], default="default",
                    help="the engine's batch_invariant (default: its rule, on for a GPU)")
    args = ap.parse_args()

    import httpx

    if args.switch_interval is not None:
        import sys

        sys.setswitchinterval(args.switch_interval)

    if args.stack_dir:  # before the engine starts, so that its engine-core process is armed too
        from benchmarks.diag.stack_sampler import StackSampler, arm_children

        from benchmarks.diag import core_timeline

        flag = os.path.join(args.stack_dir, "sampling")
        arm_children(args.stack_dir, flag)
        core_timeline.install()  # an in-process engine core (CPU) runs here

    import engine_ext
    from benchmarks.serve_api import serve_in_thread
    from engine_ext import BUNDLED_MODEL_PATH, Engine, GenerationParams

    t0 = time.perf_counter()
    if args.device == "cuda":  # cb_bench.py's GPU settings
        bi = {} if args.batch_invariant == "default" else {"batch_invariant": args.batch_invariant == "on"}
        eng = Engine(model=args.model, device="cuda", enforce_eager=False, max_model_len=4096,
                     gpu_memory_utilization=0.8, **bi).start()
    else:
        eng = Engine(model=args.model, device=args.device, cpu_threads=args.cpu_threads,
                     **({"multiprocess": True} if args.multiprocess else {})).start()
    code = os.path.dirname(os.path.dirname(os.path.abspath(engine_ext.__file__)))
    import torch

    common = {"label": args.label, "code": code, "commit": git_head(code), "load_avg": os.getloadavg()[0],
              "torch_threads": torch.get_num_threads(), "batch_invariant": eng.batch_invariant,
              "switch_interval": __import__("sys").getswitchinterval()}
    emit("start", seconds=round(time.perf_counter() - t0, 1), max_num_seqs=eng.info.max_num_seqs,
         layers=eng.info.num_layers, **common)

    # the bimodal-speed probe: a short decode (8 x 48 tokens), best of 2
    probe = []
    for _ in range(2):
        t = time.perf_counter()
        gens = eng.generate(["The capital of"] * 8, GenerationParams(max_tokens=48, ignore_eos=True))
        probe.append(sum(len(g.token_ids) for g in gens) / (time.perf_counter() - t))
    tok_s = max(probe)
    mode = "fast" if tok_s > 300 else "slow"
    emit("probe", decode_tok_s=round(tok_s, 1), mode=mode, **common)

    body = sweep_pair_body(args.model or str(BUNDLED_MODEL_PATH), args.pair, args.words, args.prompt_tokens)
    body.update(metric="logprob", hooks=args.hooks.split(","))
    if args.max_concurrency:
        body["max_concurrency"] = args.max_concurrency
    for key in ("layers", "positions"):
        if getattr(args, key) is not None:
            body[key] = json.loads(getattr(args, key))

    url, server, thread = serve_in_thread(eng)
    try:
        with httpx.Client(base_url=url, timeout=600) as c:
            def sweep(reuse: bool | None) -> dict:
                r = c.post("/v1/patch_sweep", json=body if reuse is None else {**body, "prefix_reuse": reuse})
                r.raise_for_status()
                return r.json()

            variants = {"default": [None], "on": [True], "off": [False], "both": [True, False]}[args.prefix_reuse]
            first = sweep(variants[0])  # warm-up
            cells = first["cells_done"]
            times: dict = {v: [] for v in variants}
            cpu: dict = {v: [] for v in variants}
            reused: dict = {v: [] for v in variants}
            api_tid, engine_tid = thread.native_id, eng._loop._thread.native_id
            if args.stack_dir:
                core_timeline.install_client(eng)
                open(flag, "w").close()
                sampler, since = StackSampler().start(), time.time()
            for rep in range(args.reps):
                grids = None
                for v in variants:
                    c0 = cpu_snapshot(api_tid, engine_tid)
                    wall0 = time.time()
                    t = time.perf_counter()
                    r = sweep(v)
                    times[v].append(time.perf_counter() - t)
                    cpu[v].append([b - a for a, b in zip(c0, cpu_snapshot(api_tid, engine_tid))])
                    reused[v].append(r.get("reused_prompt_tokens"))
                    assert r["cells_done"] == cells and not r["cancelled"], r.get("notes")
                    extra = {}
                    if len(variants) > 1:
                        g = [h["grid"] for h in r["hook_grids"]]
                        if grids is None:
                            grids = g
                        else:
                            extra["grids_equal"] = g == grids
                    emit("sweep", rep=rep, prefix_reuse=r.get("prefix_reuse"), cells=cells, seconds=round(times[v][-1], 4),
                         cells_per_s=round(cells / times[v][-1], 1), server_elapsed_s=r.get("elapsed_s"),
                         reused_prompt_tokens=r.get("reused_prompt_tokens"), api_cpu_s=round(cpu[v][-1][0], 3),
                         engine_cpu_s=round(cpu[v][-1][1], 3), process_cpu_s=round(cpu[v][-1][2], 3),
                         load_now=os.getloadavg()[0], wall=[round(wall0, 4), round(time.time(), 4)], **extra, **common)
            if args.stack_dir:
                report = sampler.stop(top=80)
                report["core_timeline"] = core_timeline.report(since, time.time())
                report["core_timeline"]["since"] = since
                report["client_events"] = core_timeline.client_events(since)
                with open(os.path.join(args.stack_dir, f"stack-{os.getpid()}.json"), "w") as f:
                    json.dump(report, f)
                os.remove(flag)
                time.sleep(0.5)  # the children write theirs
            for v in variants:
                m = statistics.median(times[v])
                api_ms = statistics.median(c[0] for c in cpu[v]) * 1000 / cells
                engine_ms = statistics.median(c[1] for c in cpu[v]) * 1000 / cells
                emit("summary", prefix_reuse=v, cells=cells, prompt_tokens=len(first["prompt_token_ids"]), mode=mode,
                     decode_tok_s=round(tok_s, 1), median_s=round(m, 4), cells_per_s=round(cells / m, 1),
                     reps_s=[round(x, 4) for x in times[v]], reused_prompt_tokens=reused[v][-1],
                     api_cpu_ms_per_cell=round(api_ms, 3), engine_cpu_ms_per_cell=round(engine_ms, 3),
                     max_concurrency=args.max_concurrency, **common)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        eng.close()


if __name__ == "__mp_main__":  # a spawned child (vLLM's engine core) of a --stack-dir run
    from benchmarks.diag.stack_sampler import arm_spawned_child

    arm_spawned_child()
if __name__ == "__main__":
    main()
