"""Where the GPU waits in a dynamic-steering decode (issue 15): the device's timeline, not the
host's. For each variant of `benchmarks/dynamic_variants.py` (and static steering as the control),
one batch-32 decode runs under `torch.profiler` (CUDA activity only) in an IN-PROCESS engine (the
forward runs in this process, so its kernels are recorded); the kernels' execution intervals are
merged, and the time the GPU ran nothing between the first and the last kernel is reported per
decode step, with the gaps of 50 µs or more (those between two forwards: a step waiting for the
host) counted and summed.

    PYTHONPATH=. python3 benchmarks/diag/dynamic_gaps.py --model DIR [--tokens 64] [--device cuda]
        [--variants vanilla,static_steer,monitor_only,threshold_on,proportional] [--ab-device]

`--ab-device` adds each dynamic variant with decisions on the device (`variant@device`,
`cb_set_dyn_device`) and on the host (`variant@host`). `--attribute` adds, per variant, what the
host did around each big gap (`gap_host`: `attribute_gaps`): the CUDA runtime/driver call that
launched the kernel ending the gap (CUPTI records those for every thread), how late it came after
the GPU went idle, and the host call just before it on the same thread (a synchronize that waited
for the GPU, a copy, ...) with the host time between the two — the Python work the GPU waited for. The profiler adds host work of its own, so
tokens/s here are lower than `dynamic_bench.py`'s; compare the variants' idle time per step with
each other. On a CPU there are no CUDA kernels: the lines report `kernels: 0` (the test suite runs
it that way so that it cannot rot).
"""
import argparse
import bisect
import json
import os
import statistics
import time
from collections import Counter

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the forward runs in this process

#: a gap between kernels at least this long counts as the GPU waiting between two forwards
BIG_GAP_US = 50.0


def emit(tag: str, **kw) -> None:
    print(json.dumps({"bench": tag, **kw}), flush=True)


def merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, non-overlapping union of `(start, end)` intervals."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def idle_report(intervals: list[tuple[float, float]], steps: int) -> dict:
    """What the merged kernel intervals (µs) say: busy and idle time over the window from the
    first kernel's start to the last one's end, per decode step, and the big gaps."""
    if not intervals:
        return {"kernels": 0}
    busy = merge(intervals)
    window = busy[-1][1] - busy[0][0]
    gaps = [b[0] - a[1] for a, b in zip(busy, busy[1:])]
    big = [g for g in gaps if g >= BIG_GAP_US]
    busy_us = sum(b - a for a, b in busy)
    return {"kernels": len(intervals), "window_ms": round(window / 1e3, 2), "busy_frac": round(busy_us / window, 4),
            "idle_us_per_step": round((window - busy_us) / steps, 1), "big_gaps": len(big),
            "big_gap_us_per_step": round(sum(big) / steps, 1),
            "big_gap_us_median": round(statistics.median(big), 1) if big else None}


def _is_host_call(name: str) -> bool:
    """A CUDA runtime or driver API call as CUPTI names it (`cudaLaunchKernel`, `cuLaunchKernel`,
    `cudaGraphLaunch`, `cudaEventSynchronize`, `cudaMemcpyAsync`, ...)."""
    return name.startswith("cu") and not name.startswith("cutlass")


def attribute_gaps(kernels: list[tuple[float, float, str, int]], calls: list[tuple[float, float, str, int, int]],
                   big_us: float = BIG_GAP_US, top: int = 6) -> dict:
    """What the host did around each big gap in the device's timeline (all times in µs).

    `kernels`: `(start, end, name, correlation)` of the device's activities (kernels, copies,
    memsets); `calls`: `(start, end, name, correlation, thread)` of the host's CUDA runtime/driver
    calls. A device activity and the call that issued it share CUPTI's correlation id. For each gap
    of at least `big_us` between the merged busy intervals: the activity that ends it, the call that
    issued it (`launch`), how long after the gap began that call *ended* (`late_us`: the host issued
    the work only then), and the previous call on the same thread (`before`) with the host time from
    its end to the launch's start (`host_us`: Python, no CUDA call). Returns counts per launch name,
    per `before` name, per next activity name (`top` each, with their summed gap µs) and the medians."""
    if not kernels:
        return {"gaps": 0}
    order = sorted(kernels)
    by_corr = {c[3]: c for c in calls}
    per_thread: dict[int, list[tuple[float, float, str, int, int]]] = {}
    for c in sorted(calls):
        per_thread.setdefault(c[4], []).append(c)
    starts = {t: [c[0] for c in cs] for t, cs in per_thread.items()}
    launch, before, after = Counter(), Counter(), Counter()
    launch_us, before_us, after_us = Counter(), Counter(), Counter()
    late, host = [], []
    reach = order[0][1]
    n_gaps = 0
    for k in order:
        gap = k[0] - reach
        if gap >= big_us:
            n_gaps += 1
            nxt = k[2][:60]
            after[nxt] += 1
            after_us[nxt] += gap
            call = by_corr.get(k[3])
            if call is not None:
                launch[call[2]] += 1
                launch_us[call[2]] += gap
                late.append(call[1] - reach)
                cs = per_thread[call[4]]
                i = bisect.bisect_left(starts[call[4]], call[0]) - 1
                if i >= 0:
                    prev = cs[i]
                    before[prev[2]] += 1
                    before_us[prev[2]] += gap
                    host.append(call[0] - prev[1])
        reach = max(reach, k[1])

    def table(cnt, us):
        return [[name, n, round(us[name], 1)] for name, n in cnt.most_common(top)]

    return {"gaps": n_gaps, "attributed": len(late),
            "launch": table(launch, launch_us), "before": table(before, before_us), "next": table(after, after_us),
            "late_us_median": round(statistics.median(late), 1) if late else None,
            "host_us_median": round(statistics.median(host), 1) if host else None}


def _kineto_lists(prof) -> tuple[list, list]:
    """(device activities, host CUDA calls) of a finished `torch.profiler.profile`, in µs, as
    `attribute_gaps` takes them."""
    import torch

    kernels, calls = [], []
    for e in prof.profiler.kineto_results.events():
        start, end = e.start_ns() / 1e3, e.end_ns() / 1e3
        if e.device_type() == torch.autograd.DeviceType.CUDA:
            kernels.append((start, end, e.name(), e.correlation_id()))
        elif _is_host_call(e.name()):
            calls.append((start, end, e.name(), e.correlation_id(), e.start_thread_id()))
    return kernels, calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--variants", default="vanilla,static_steer,monitor_only,threshold_on,proportional")
    ap.add_argument("--ab-device", action="store_true")
    ap.add_argument("--attribute", action="store_true",
                    help="also a gap_host line per variant: the host calls around each big gap (attribute_gaps)")
    args = ap.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.dynamic_variants import in_process_engine, static_steer, workload
    from engine_ext import GenerationParams

    eng = in_process_engine(args.model, args.device)
    dyn, v, prompts = workload(eng, args.batch, 100 + args.batch)
    params = GenerationParams(max_tokens=args.tokens, ignore_eos=True)
    runs: dict[str, dict] = {}
    for name in args.variants.split(","):
        if name == "static_steer":
            runs[name] = {"interventions": static_steer(eng.info.num_layers, v)}
        elif name in dyn:
            runs[name] = {"dynamic": dyn[name]}
            if args.ab_device and dyn[name] is not None:
                runs[f"{name}@device"] = {"dynamic": dyn[name], "device": True}
                runs[f"{name}@host"] = {"dynamic": dyn[name], "device": False}
        else:
            raise SystemExit(f"unknown variant {name!r}")
    activities = [ProfilerActivity.CUDA] if args.device == "cuda" and torch.cuda.is_available() else [ProfilerActivity.CPU]
    for name, run in runs.items():
        eng._rpc("cb_set_dyn_device", run.get("device", "auto"))
        gen_kw = {k: x for k, x in run.items() if k != "device"}
        eng.generate(prompts, GenerationParams(max_tokens=8, ignore_eos=True), **gen_kw)  # warm-up
        with profile(activities=activities) as prof:
            t = time.perf_counter()
            gens = eng.generate(prompts, params, **gen_kw)
            seconds = time.perf_counter() - t
        assert sum(len(g.token_ids) for g in gens) == args.batch * args.tokens
        kernels = [(e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA]
        emit("dyn_gaps", variant=name, batch=args.batch, tokens=args.tokens,
             tok_s_profiled=round(args.batch * args.tokens / seconds, 1), **idle_report(kernels, args.tokens))
        if args.attribute:
            try:
                emit("gap_host", variant=name, **attribute_gaps(*_kineto_lists(prof)))
            except Exception as exc:  # a diagnostic: report, never lose the other variants
                emit("gap_host", variant=name, error=f"{type(exc).__name__}: {exc}")
    eng._rpc("cb_set_dyn_device", "auto")
    eng.close()


if __name__ == "__main__":
    main()
