"""Sweep throughput over HTTP (issue #13, P1 over `POST /v1/patch_sweep`), on the CPU with the
bundled model by default: serve the API in-process (uvicorn in a thread, the engine in-process),
run the same sweep several times, print cells/s.

    PYTHONPATH=. python3 benchmarks/diag/sweep_http.py [--model DIR] [--device cpu|cuda] [--reps 5]
        [--pair K] [--hooks pre_attn,post_attn,post_block] [--max-concurrency N] [--words N]

The sweep: the K-th equal-length clean/corrupt pair of the model's `tasks.json`, padded in front
with `--words` filler words (so the prompt is about 16 tokens, as in the GPU workload), every layer x
every prompt position x the hooks, metric logprob, non-streaming (the whole summary is the
response). One warm-up sweep, then `--reps` timed ones; each timed sweep's wall time is the HTTP
round trip (plan, clean capture, baselines, the cells, summary), as in `cb_bench.py p1http`.

The CPU's speed is bimodal per process (the same decode runs at ~50 tok/s in some processes and
~1,000+ tok/s in others; docs/performance.md): before the sweeps, a short decode probe (8 x 48
tokens) reports `decode_tok_s` and the process's `mode` (`fast` above 300 tok/s, else `slow`).
Compare only processes of the same mode.

To compare two trees, run this file from one tree against the other's code
(`PYTHONPATH=/tmp/old-tree python3 benchmarks/diag/sweep_http.py`): it uses only the HTTP API
and `Engine`, which both sides have. Output: JSON lines (`probe`, `sweep` per repetition, `summary`).
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import threading
import time


def emit(tag: str, **kw) -> None:
    print(json.dumps({"bench": tag, **kw}, default=str), flush=True)


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
    args = ap.parse_args()

    import httpx
    import uvicorn

    import engine_ext
    from app.api.app import create_app
    from engine_ext import BUNDLED_MODEL_PATH, Engine, GenerationParams

    t0 = time.perf_counter()
    eng = Engine(model=args.model, device=args.device).start()
    code = os.path.dirname(os.path.dirname(os.path.abspath(engine_ext.__file__)))
    common = {"label": args.label, "code": code, "commit": git_head(code), "load_avg": os.getloadavg()[0]}
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

    with open(os.path.join(args.model or str(BUNDLED_MODEL_PATH), "tasks.json")) as f:
        tasks = json.load(f)
    pair = [p for p in tasks["pairs"] if p["equal_length"]][args.pair]
    filler = " ".join(["and then"] * (args.words // 2)) + " "
    body = {"prompt": filler + pair["corrupt_prompt"], "clean_prompt": filler + pair["clean_prompt"],
            "answer_token_id": pair["answer_id"], "foil_token_id": pair["foil_id"], "metric": "logprob",
            "hooks": args.hooks.split(",")}
    if args.max_concurrency:
        body["max_concurrency"] = args.max_concurrency

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(eng), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as c:
            def sweep() -> dict:
                r = c.post("/v1/patch_sweep", json=body)
                r.raise_for_status()
                return r.json()

            first = sweep()  # warm-up
            times, cells = [], first["cells_done"]
            for rep in range(args.reps):
                t = time.perf_counter()
                r = sweep()
                times.append(time.perf_counter() - t)
                assert r["cells_done"] == cells and not r["cancelled"], r.get("notes")
                emit("sweep", rep=rep, cells=cells, seconds=round(times[-1], 4), cells_per_s=round(cells / times[-1], 1),
                     server_elapsed_s=r.get("elapsed_s"), **common)
            m = statistics.median(times)
            emit("summary", cells=cells, prompt_tokens=len(first["prompt_token_ids"]), mode=mode,
                 decode_tok_s=round(tok_s, 1), median_s=round(m, 4), cells_per_s=round(cells / m, 1),
                 reps_s=[round(x, 4) for x in times], max_concurrency=args.max_concurrency, **common)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        eng.close()


if __name__ == "__main__":
    main()
