#!/usr/bin/env python3
"""Cost of dynamic steering in decode (issue 15): batch-32 decode with one probe and one policy on
every request against no dynamic steering, in the same process, interleaved per repetition.

    PYTHONPATH=. python3 benchmarks/dynamic_bench.py --model DIR --device cuda   # the lead's GPU run
    PYTHONPATH=. python3 benchmarks/dynamic_bench.py --device cpu --tokens 8     # CPU smoke (bundled model)

Variants (distinct random 16-token prompts, seed 100 + batch (132 at the default 32), ignore_eos, greedy):
  vanilla          no dynamic steering (no program at all);
  monitor_only     a threshold policy that never fires: the probe is read and scored every step,
                   no action is ever applied (the monitor's cost alone);
  threshold_on     a threshold policy engaged from the first generated token: monitor + one
                   action per request and step (one shared slot: the payload never changes);
  proportional     proportional control: monitor + an action whose scale changes every step
                   (a new slot value per request and step: the worst case for uploads);
  static_steer     no dynamic steering: the same vector steered statically at the same site on
                   every generated token (what the engaged action costs by itself, for reference).
The probe reads L{L/2}.post_block; the action steers L{L/2 - 1}.post_attn with a small vector
(norm 0.01 x sqrt(H)) so the generated text stays ordinary. One line of JSON per variant:
{"bench": "dyn_decode", "variant", "batch", "tokens", "tok_s", "ratio_vs_vanilla", "ratio_paired"
(median of each round's vanilla / variant), "ratio_best" (best repetitions), "reps_s"}.
Goal (issue 15): ratio_vs_vanilla >= 0.95 for threshold_on on the GPU.
"""
import argparse
import json
import statistics
import time


def emit(tag, **kw):
    print(json.dumps({"bench": tag, **kw}, default=str), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="model folder (default: the bundled model)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ab-defer", action="store_true",
                    help="also run each dynamic variant with its plan finished at prepare_inputs "
                         "(variant@prepare_inputs; the default finishes it right before the forward)")
    ap.add_argument("--ab-replay", action="store_true",
                    help="also run each dynamic variant with steady decode steps planned request by request "
                         "(variant@no_replay; the default repeats them: engine_ext.dynamic.replay.Replay)")
    ap.add_argument("--ab-device", action="store_true",
                    help="also run each dynamic variant with its decisions taken on the device and on the host "
                         "(variant@device, variant@host: engine_ext.dynamic.device_decisions; the default "
                         "is auto: on the device for proportional control)")
    ap.add_argument("--ab-graphs", action="store_true",
                    help="also run each dynamic variant with its probe scores launched eagerly "
                         "(variant@no_graphs; the default replays a repeating layout as a CUDA graph: "
                         "engine_ext.dynamic.step_graphs)")
    ap.add_argument("--variants", default=None, help="comma-separated subset of the variants (default: all)")
    args = ap.parse_args()

    from benchmarks.dynamic_variants import static_steer, workload
    from engine_ext import Engine, GenerationParams

    t0 = time.perf_counter()
    kw = {"model": args.model} if args.model else {}
    if args.device == "cuda":
        eng = Engine(device="cuda", enforce_eager=False, max_model_len=4096, gpu_memory_utilization=0.8, **kw).start()
    else:
        eng = Engine(device=args.device, **kw).start()
    info = eng.info
    emit("dyn_start", seconds=round(time.perf_counter() - t0, 1), info=str(info))
    variants, v, prompts = workload(eng, args.batch, 100 + args.batch)
    params = GenerationParams(max_tokens=args.tokens, ignore_eos=True)
    static = {"static_steer": static_steer(info.num_layers, v)}
    if args.variants:
        keep = set(args.variants.split(",")) | {"vanilla"}
        variants = {k: v for k, v in variants.items() if k in keep}
    run_kw = {k: {"dynamic": dyn} for k, dyn in variants.items()}
    if args.ab_defer:
        run_kw.update({f"{k}@prepare_inputs": {"dynamic": dyn, "defer": False} for k, dyn in variants.items()
                       if dyn is not None})
    if args.ab_replay:
        run_kw.update({f"{k}@no_replay": {"dynamic": dyn, "replay": False} for k, dyn in variants.items()
                       if dyn is not None})
    if args.ab_device:
        run_kw.update({f"{k}@{where}": {"dynamic": dyn, "device": on} for k, dyn in variants.items()
                       if dyn is not None for where, on in (("device", True), ("host", False))})
    if args.ab_graphs:
        run_kw.update({f"{k}@no_graphs": {"dynamic": dyn, "graphs": False} for k, dyn in variants.items()
                       if dyn is not None})
    run_kw.update({k: {"interventions": spec} for k, spec in static.items() if not args.variants or k in keep})
    # the worker switches a variant sets (RPC only when one changes): name -> [RPC, current value, default]
    switches = {"defer": ["cb_set_defer_plan", True, True], "replay": ["cb_set_dyn_replay", True, True],
                "device": ["cb_set_dyn_device", "auto", "auto"], "graphs": ["cb_set_dyn_graphs", True, True]}

    def generate_kw(kw: dict) -> dict:
        """Set the variant's switches on the workers; the rest are `generate` arguments."""
        for name, sw in switches.items():
            want = kw.get(name, sw[2])
            if want != sw[1]:
                eng._rpc(sw[0], want)
                sw[1] = want
        return {a: b for a, b in kw.items() if a not in switches}

    for name, kw in run_kw.items():  # warm-up
        t = time.perf_counter()
        eng.generate(prompts, GenerationParams(max_tokens=8, ignore_eos=True), **generate_kw(kw))
        emit("dyn_warmup", variant=name, seconds=round(time.perf_counter() - t, 3))
    times = {k: [] for k in run_kw}
    for rep in range(args.reps):
        for k, kw in run_kw.items():
            dyn = kw.get("dynamic")
            kw = generate_kw(kw)
            t = time.perf_counter()
            gens = eng.generate(prompts, params, **kw)
            times[k].append(time.perf_counter() - t)
            assert sum(len(g.token_ids) for g in gens) == args.batch * args.tokens
            if dyn is not None:
                assert all(g.intervention.status == "ok" for g in gens), gens[0].intervention.errors
        # one line per repetition, so a run cut short by its time limit still reports
        emit("dyn_rep", rep=rep, seconds={k: round(ts[-1], 4) for k, ts in times.items()})
    base = statistics.median(times["vanilla"])
    for k, ts in times.items():
        m = statistics.median(ts)
        # also the median of each round's own ratio (a slow round of the host moves it least) and
        # the ratio of the best repetitions (docs/performance.md: this host kind spreads ±0.08)
        paired = statistics.median(a / b for a, b in zip(times["vanilla"], ts))
        emit("dyn_decode", variant=k, batch=args.batch, tokens=args.tokens, tok_s=round(args.batch * args.tokens / m, 1),
             ratio_vs_vanilla=round(base / m, 4), ratio_paired=round(paired, 4),
             ratio_best=round(min(times["vanilla"]) / min(ts), 4), reps_s=[round(x, 4) for x in ts])
    status = eng.dynamic_status()
    emit("dyn_status", determinism=status["determinism"],
         replayed_steps=[w.get("replayed_steps") for w in status.get("workers", [])],
         graph_captures=[w.get("graph_captures") for w in status.get("workers", [])],
         graph_capture_ms=[w.get("graph_capture_ms") for w in status.get("workers", [])])
    eng.close()


if __name__ == "__main__":
    main()
