"""CPU micro-benchmark of dynamic steering's per-step host work on the worker (issue 15's cost):
batch-32 decode steps of a Llama-3.2-1B-shaped model (16 layers, hidden 2048), every request
carrying one probe and one policy, as `benchmarks/dynamic_bench.py` runs them on the GPU. No
engine and no forward: `WorkerState.plan_step` then `WorkerState.after_forward` per step, the
capture rows the probe reads filled with fixed random values (so the scores are non-zero and the
proportional policy's scale moves every step).

    PYTHONPATH=. .venv/bin/python benchmarks/dynamic_planner_bench.py [--steps 60] [--reps 5]

On a GPU, `plan_step`'s dynamic part runs after it waits for the previous step's scores, so its
host time is time the GPU idles (docs/performance.md, "Dynamic steering"); `after_forward` runs
while the forward it follows is still on the device. Variants as in `dynamic_bench.py`
(vanilla, monitor_only, threshold_on, proportional). One JSON line per variant: median
microseconds per step of `plan_step` (and of its dynamic part, `plan_rows`), of the part of
`plan_step` after its plan takes the previous step's decisions (`after_wait`: on a GPU the wait for
the scores is there, so this is the host time between two forwards that dynamic steering adds),
of `after_forward`, and the dynamic actions applied in one run (batch x steps for a policy engaged
throughout).
"""
import argparse
import json
import statistics
import time

import numpy as np
import torch

from benchmarks.dynamic_variants import PROBE, probe_site
from benchmarks.dynamic_variants import variants as dynamic_variants
from engine_ext.dynamic.specs import DYNAMIC_ARGS_KEY, Probe
from engine_ext.program import ModelDims, PromptInfo, compile_program, program_to_extra_args
from engine_ext.specs import Interventions, canonical_json
from engine_ext.worker.state import WorkerConfig, WorkerState

L, H, BATCH, PROMPT = 16, 2048, 32, 16


def variants(v: np.ndarray) -> dict:
    return dynamic_variants(L, v)


def run(dyn, steps: int, replay: bool = True, device: str = "cpu", decisions="auto") -> dict:
    """One batch: register, prefill step, `steps` decode steps; median us per call. `replay`:
    steady decode steps repeated (`Replay`, the default) or planned request by request;
    `decisions`: where a repeated step's decisions are taken (`cb_set_dyn_device`: True, False
    or "auto")."""
    dev = torch.device(device)
    st = WorkerState(L, H, 8192, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32, WorkerConfig())
    st.dynamic.replay_enabled = replay
    st.dynamic.device_decisions = decisions
    rng = np.random.default_rng(0)
    st.dynamic.set_probe(Probe.make(PROBE, probe_site(L), direction=rng.standard_normal(H)).to_json())
    st.buffers.cap_x.copy_(torch.from_numpy(rng.standard_normal(tuple(st.buffers.cap_x.shape)).astype(np.float32)))
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    dims = ModelDims(L, H, 128256, 0.02)
    req_ids = [f"r{i}" for i in range(BATCH)]
    for i, rid in enumerate(req_ids):
        prog = compile_program(Interventions(), PromptInfo(list(range(PROMPT)), None, None, steps + 1), dims,
                               key=f"k{i}", named_vector_dims=lambda n: None)
        extra = program_to_extra_args(prog)
        if dyn is not None:
            extra[DYNAMIC_ARGS_KEY] = canonical_json(dyn.wire(()))
        st.register(rid, extra)
    times: dict[str, list[int]] = {"plan_step": [], "plan_rows": [], "after_wait": [], "after_forward": []}
    orig, orig_decide = st.dynamic.plan_rows_begin, st.dynamic.decide_pending
    wait: list[int] = []  # when this step's plan took the pending decisions (a GPU waits there)

    def plan_rows(*a):  # phase 1 (before the wait) and its `finish` (the wait, phases 2-3), timed together
        wait.clear()
        t = time.perf_counter_ns()
        max_row, n_cap, finish = orig(*a)
        t_begin = time.perf_counter_ns() - t

        def timed_finish():
            t = time.perf_counter_ns()
            out = finish()
            times["plan_rows"].append(t_begin + time.perf_counter_ns() - t)
            return out
        return max_row, n_cap, timed_finish

    def decide_pending(*a, **k):
        if not wait and st.dynamic._pending is not None:
            wait.append(time.perf_counter_ns())
        return orig_decide(*a, **k)

    orig_replay = st.dynamic._replay_finish

    def replay_finish(*a, **k):  # a repeated step (`Replay`) waits here instead
        wait.append(time.perf_counter_ns())
        return orig_replay(*a, **k)

    st.dynamic.plan_rows_begin = plan_rows
    st.dynamic.decide_pending = decide_pending
    st.dynamic._replay_finish = replay_finish
    st.plan_step(req_ids, np.arange(0, PROMPT * BATCH + 1, PROMPT, dtype=np.int32), np.zeros(BATCH, np.int32))
    st.after_forward()
    qsl = np.arange(BATCH + 1, dtype=np.int32)
    for step in range(steps):
        wait.clear()
        sync()  # no forward here: the device idle at each step's start, so only host time is timed
        t = time.perf_counter_ns()
        st.plan_step(req_ids, qsl, np.full(BATCH, PROMPT + step, np.int32))
        t1 = time.perf_counter_ns()
        if wait:
            times["after_wait"].append(t1 - wait[0])
        st.after_forward()
        t2 = time.perf_counter_ns()
        times["plan_step"].append(t1 - t)
        times["after_forward"].append(t2 - t1)
    st.dynamic.sync_device()
    actions, replayed = st.dynamic.actions, st.dynamic.replayed_steps
    held = st.dynamic.device_held_reads
    for rid in req_ids:
        st.finish(rid)
    out = {k: statistics.median(v[5:] or v) / 1e3 for k, v in times.items() if v}
    return {**out, "actions": actions, "replayed_steps": replayed, "device_held_reads": held}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--ab-replay", action="store_true",
                    help="also run each dynamic variant with steady steps planned request by request (`@no_replay`)")
    ap.add_argument("--device", default="cpu", help="the worker's device (cuda: host time on a GPU host)")
    ap.add_argument("--ab-device", action="store_true",
                    help="also run each dynamic variant with its decisions taken on the device and on the host "
                         "(`@device`, `@host`; the default is auto: on the device on a GPU for proportional chains)")
    args = ap.parse_args()
    v = (np.random.default_rng(1).standard_normal(H) * 0.01).astype(np.float32)
    results: dict[str, list[dict]] = {}
    for _ in range(args.reps):
        for name, dyn in variants(v).items():
            results.setdefault(name, []).append(run(dyn, args.steps, device=args.device))
            if args.ab_replay and dyn is not None:
                results.setdefault(f"{name}@no_replay", []).append(run(dyn, args.steps, replay=False, device=args.device))
            if args.ab_device and dyn is not None:
                for where, on in (("device", True), ("host", False)):
                    results.setdefault(f"{name}@{where}", []).append(run(dyn, args.steps, device=args.device,
                                                                          decisions=on))
    for name, reps in results.items():
        out = {k: round(statistics.median(r[k] for r in reps), 1) for k in reps[0] if k != "actions"}
        out["actions_per_run"] = reps[0]["actions"]
        print(json.dumps({"bench": "dyn_planner_us", "variant": name, "device": args.device, "batch": BATCH, "hidden": H,
                          **out}), flush=True)


if __name__ == "__main__":
    main()
