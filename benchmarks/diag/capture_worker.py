"""The worker's host time per captured request (P3's workload, no engine, CPU): 1000 capture-only
requests of a Llama-3.2-1B-shaped model (16 layers, hidden 2048, bf16), each capturing all 16
layers' `post_block` at its last prompt token, 16-token prompts, in prefill steps of `--per-step`
requests, with a shared-memory capture ring as a multiprocess engine has. Reports microseconds per
request for each phase the engine core runs: registration (`on_schedule` of new requests),
planning (`plan_step`), after the forward (the sums and copy; on a CPU the sum itself is here),
the finish (`on_schedule` of finished requests: results), and `collect`.

    PYTHONPATH=. .venv/bin/python benchmarks/diag/capture_worker.py [--reps 5] [--per-step 250]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from types import SimpleNamespace

import numpy as np
import torch

from engine_ext.program import ModelDims, PromptInfo, compile_program, program_to_extra_args
from engine_ext.specs import Capture, Interventions
from engine_ext.worker.state import WorkerConfig, WorkerState

L, H, PROMPT = 16, 2048, 16


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--per-step", type=int, default=250)
    args = ap.parse_args()
    dims = ModelDims(L, H, 128256, 0.02)
    spec = Interventions(capture=Capture.make([f"L{layer}.post_block" for layer in range(L)], "last_prompt"))
    st = WorkerState(L, H, 16384, torch.device("cpu"), torch.bfloat16, WorkerConfig())
    st.enable_ring(512 << 20)
    phases = {k: [] for k in ("register", "plan_step", "after_forward", "finish", "collect")}
    rid = 0
    for rep in range(args.reps + 1):
        t = dict.fromkeys(phases, 0.0)
        keys_all = []
        prev: list[str] = []
        for first in range(0, args.n, args.per_step):
            k = min(args.per_step, args.n - first)
            new = []
            for _ in range(k):
                key = f"k{rid}"
                prog = compile_program(spec, PromptInfo(list(range(PROMPT)), None, None, 1), dims, key=key,
                                       named_vector_dims=lambda n: None)
                new.append(SimpleNamespace(req_id=f"r{rid}", prompt_token_ids=list(range(PROMPT)),
                                           sampling_params=SimpleNamespace(extra_args=program_to_extra_args(prog))))
                keys_all.append(key)
                rid += 1
            sched = SimpleNamespace(finished_req_ids=list(prev), scheduled_new_reqs=new)
            t0 = time.perf_counter()
            st.on_schedule(SimpleNamespace(finished_req_ids=list(prev), scheduled_new_reqs=[]))
            t1 = time.perf_counter()
            st.on_schedule(SimpleNamespace(finished_req_ids=[], scheduled_new_reqs=sched.scheduled_new_reqs))
            t2 = time.perf_counter()
            ids = [r.req_id for r in new]
            st.plan_step(ids, np.arange(0, PROMPT * k + 1, PROMPT, dtype=np.int32), np.zeros(k, np.int32))
            t3 = time.perf_counter()
            st.after_forward()
            t4 = time.perf_counter()
            st.collect(keys_all[-k - len(prev):-k] if prev else [], None)
            t5 = time.perf_counter()
            t["finish"] += t1 - t0
            t["register"] += t2 - t1
            t["plan_step"] += t3 - t2
            t["after_forward"] += t4 - t3
            t["collect"] += t5 - t4
            prev = ids
        t0 = time.perf_counter()
        st.on_schedule(SimpleNamespace(finished_req_ids=list(prev), scheduled_new_reqs=[]))
        t1 = time.perf_counter()
        st.collect(keys_all[-len(prev):], None)
        t["finish"] += t1 - t0
        t["collect"] += time.perf_counter() - t1
        # the client's acknowledgements: every slice handed out this repetition
        st.ring.release(list(st.ring._slices))
        if rep:  # the first is a warm-up
            for p, v in t.items():
                phases[p].append(v / args.n * 1e6)
    out = {p: round(statistics.median(v), 1) for p, v in phases.items()}
    out["total_us_per_request"] = round(sum(out.values()), 1)
    print(json.dumps({"bench": "capture_worker", "n": args.n, "per_step": args.per_step, "reps": args.reps,
                      "us_per_request": out, "ring": st.ring.status()}))
    st.enable_ring(0)


if __name__ == "__main__":
    main()
