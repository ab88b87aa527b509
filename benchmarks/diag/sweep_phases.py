"""Where a small sweep's time goes, phase by phase (issue #13: the sweep's fixed costs).

    PYTHONPATH=<tree> python3 benchmarks/diag/sweep_phases.py [--label old|new] [--reps 25]
        [--device cpu|cuda] [--model DIR] [--layers JSON] [--positions JSON] [--hooks a,b]
        [--words N] [--in-process] [--timeline] [--gc-threshold N]

Runs the sweep service (`app.sweep.service.SweepService`, no HTTP) on an engine whose core runs
in its own process (as on every GPU; `--in-process`: not), on the bundled model's first
equal-length pair (a model folder without `tasks.json`, the benchmark model of
`benchmarks/compare/`: `sweep_http.py`'s word prompts, `--prompt-tokens` long), by default a **one-cell** sweep (layer 0, the last position, `post_block`):
its time is the sweep's setup and teardown, not its cells. Each phase of the service and each
engine call it makes is timed (wrapped; the wrappers cost microseconds): the JSON line reports
the medians over `--reps` sweeps after 3 warm-ups of

* `total_ms`: `start` to the end of the fan-out task (the summary logged);
* `until_fan_out_ms`: `start` to the fan-out's start (plan, clean run, baselines, lease, checksum);
* `cleanup_to_end_ms`: from the cleanup (lease release / run drop) to the end (with the final
  checksum read);
* `loop_lag_max_ms`: the longest the event loop was unavailable during a sweep (how late a 1 ms
  sleep beside it woke): what every other request and stream of the API process waits for;
* `gc_ms`, `gc_collections`: the garbage collector's pauses in this process during a sweep (any
  thread's; `gc.callbacks`), their sum and their count per generation. `--gc-threshold N` sets the
  youngest generation's threshold (CPython's default 700) for an A/B.

`--timeline` also prints every timed call of the last sweep (name, start and end in ms since
`start`). To compare two trees, run this file against each (`PYTHONPATH=/tmp/old-tree`), in
alternating processes: it uses only `Engine`, `SweepService` and `PatchSweepRequest`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", default="")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default=None)
    ap.add_argument("--layers", default="[0]")
    ap.add_argument("--positions", default="[-1]")
    ap.add_argument("--hooks", default="post_block")
    ap.add_argument("--words", type=int, default=0, help="filler words in front of both prompts (27 and "
                    "--layers null --positions '\"all_prompt\"' --hooks pre_attn,post_attn,post_block: 768 cells)")
    ap.add_argument("--prompt-tokens", type=int, default=16, help="prompt length for a model without tasks.json "
                    "(the benchmark model: 16 tokens x 16 layers x 3 hooks = 768 cells)")
    ap.add_argument("--in-process", action="store_true")
    ap.add_argument("--timeline", action="store_true")
    ap.add_argument("--gc-threshold", type=int, default=None,
                    help="the youngest generation's collection threshold in this process (CPython's default: 700)")
    args = ap.parse_args()
    import gc

    if args.gc_threshold is not None:
        gc.set_threshold(args.gc_threshold, *gc.get_threshold()[1:])

    from app.sweep.schema import PatchSweepRequest
    from app.sweep.service import SweepService
    from engine_ext import BUNDLED_MODEL_PATH, Engine

    kw = {} if args.device == "cpu" else {"device": args.device, "enforce_eager": False, "max_model_len": 4096,
                                          "gpu_memory_utilization": 0.8}
    eng = Engine(model=args.model, multiprocess=not args.in_process, **kw).start()
    from sweep_http import sweep_pair_body  # this file's sibling (benchmarks/diag), whatever tree PYTHONPATH names

    body = sweep_pair_body(args.model or str(BUNDLED_MODEL_PATH), 0, args.words, args.prompt_tokens)
    body.update(metric="logprob", hooks=args.hooks.split(","), layers=json.loads(args.layers),
                positions=json.loads(args.positions))
    log: list[tuple[str, float, float]] = []
    t0 = [0.0]

    def timed(obj, name: str) -> None:
        orig = getattr(obj, name)

        def note(t: float) -> None:
            log.append((name, round((t - t0[0]) * 1e3, 2), round((time.perf_counter() - t0[0]) * 1e3, 2)))

        if asyncio.iscoroutinefunction(orig):
            async def wrapper(*a, **k):
                t = time.perf_counter()
                try:
                    return await orig(*a, **k)
                finally:
                    note(t)
        else:
            def wrapper(*a, **k):
                t = time.perf_counter()
                try:
                    return orig(*a, **k)
                finally:
                    note(t)
        setattr(obj, name, wrapper)

    svc = SweepService(eng)
    for name in ("_prepare_clean", "_score", "_prepare_group", "_cleanup", "_fan_out", "_read_checksum", "_emit_checksum"):
        if hasattr(svc, name):  # the older tree's name for the checksum read is _emit_checksum
            timed(svc, name)
    for name in ("intervention_status", "drop_source", "release_source", "lease_source", "agenerate", "arun_cells",
                 "agenerate_cells", "agenerate_many"):
        if hasattr(eng, name):
            timed(eng, name)

    lags: list[float] = []
    gc_now = {"ms": 0.0, "n": [0, 0, 0], "t": 0.0}

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_now["t"] = time.perf_counter()
        else:
            gc_now["ms"] += (time.perf_counter() - gc_now["t"]) * 1e3
            gc_now["n"][info["generation"]] += 1

    gc.callbacks.append(on_gc)
    gc_per_sweep: list[tuple[float, list[int]]] = []

    async def ticker(stop: asyncio.Event) -> None:
        """The event loop's responsiveness: the longest a 1 ms sleep overran during the sweep."""
        worst = 0.0
        while not stop.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            worst = max(worst, time.perf_counter() - t - 0.001)
        lags.append(worst * 1e3)

    async def one() -> float:
        stop = asyncio.Event()
        tick = asyncio.ensure_future(ticker(stop))
        gc_now.update(ms=0.0, n=[0, 0, 0])
        t0[0] = time.perf_counter()
        run = await svc.start(PatchSweepRequest(**body))
        await run.task
        ms = (time.perf_counter() - t0[0]) * 1e3
        gc_per_sweep.append((gc_now["ms"], list(gc_now["n"])))
        stop.set()
        await tick
        return ms

    loop = asyncio.new_event_loop()
    total, setup, tail = [], [], []
    try:
        for i in range(3 + args.reps):
            log.clear()
            ms = loop.run_until_complete(one())
            if i < 3:
                continue
            fan_out = next(e for e in log if e[0] == "_fan_out")
            cleanup = next(e for e in log if e[0] == "_cleanup")
            total.append(ms)
            setup.append(fan_out[1])
            tail.append(fan_out[2] - cleanup[1])
    finally:
        eng.close()
    med = statistics.median
    print(json.dumps({"bench": "sweep_phases", "label": args.label, "reps": len(total), "multiprocess": not args.in_process,
                      "total_ms": round(med(total), 2), "min_ms": round(min(total), 2),
                      "until_fan_out_ms": round(med(setup), 2), "cleanup_to_end_ms": round(med(tail), 2),
                      "loop_lag_max_ms": round(med(lags[3:]), 2),
                      "gc_ms": round(med(g[0] for g in gc_per_sweep[3:]), 2),
                      "gc_collections": [med(g[1][k] for g in gc_per_sweep[3:]) for k in range(3)],
                      "gc_threshold": gc.get_threshold()[0]}), flush=True)
    if args.timeline:
        for e in sorted(log, key=lambda e: e[1]):
            print(json.dumps({"call": e[0], "start_ms": e[1], "end_ms": e[2]}))


if __name__ == "__main__":
    main()
