"""The worker's host time per sweep cell (P1's patched cells, no engine, CPU): `--n` one-token
requests of a Llama-3.2-1B-shaped model (16 layers, hidden 2048, bf16) on one 16-token prompt,
each patching one (layer, hook, position) from a stored clean run (16 layers x 3 hooks x 16
positions, as `host_work.py p1_patched` and the sweep), scored at two ids, in prefill steps of
`--per-step` requests. Reports microseconds per cell for each phase the engine core runs:
registration (`on_schedule` of new requests: parse, plan), planning (`plan_step`: the step's
tables, checksum fold, slot upload), the finish (`on_schedule` of finished requests: results)
and `collect`; with `--profile`, the top functions of one more repetition under cProfile.

    PYTHONPATH=. .venv/bin/python benchmarks/diag/cell_worker.py [--reps 5] [--n 768] [--per-step 768]
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time
from types import SimpleNamespace

import numpy as np
import torch

from engine_ext.program import ModelDims, PromptInfo, compile_program, program_to_extra_args
from engine_ext.sites import site_index
from engine_ext.specs import Interventions, Patch, RunSource
from engine_ext.worker.state import WorkerConfig, WorkerState

L, H, PROMPT = 16, 2048, 16
HOOKS = ("pre_attn", "post_attn", "post_block")


def requests(n: int, dims: ModelDims, first: int) -> list[SimpleNamespace]:
    """`n` scheduled-request stand-ins (what vLLM hands `on_schedule`), ids from `first` on."""
    cells = [(layer, h, p) for layer in range(L) for h in HOOKS for p in range(PROMPT)]
    out = []
    for i in range(first, first + n):
        layer, h, p = cells[i % len(cells)]
        spec = Interventions(patch=(Patch.make(f"L{layer}.{h}", [p], RunSource("clean", (p,))),), score_token_ids=(1, 2))
        prog = compile_program(spec, PromptInfo(list(range(PROMPT)), None, None, 1), dims, key=f"k{i}",
                               named_vector_dims=lambda name: None)
        out.append(SimpleNamespace(req_id=f"r{i}", prompt_token_ids=list(range(PROMPT)),
                                   sampling_params=SimpleNamespace(extra_args=program_to_extra_args(prog))))
    return out


def run_once(st: WorkerState, batches: list[list[SimpleNamespace]]) -> dict[str, float]:
    t = dict.fromkeys(("register", "plan_step", "finish", "collect"), 0.0)
    prev: list[str] = []
    for new in batches:
        t0 = time.perf_counter()
        st.on_schedule(SimpleNamespace(finished_req_ids=list(prev), scheduled_new_reqs=[]))
        t1 = time.perf_counter()
        if prev:
            st.collect([f"k{r[1:]}" for r in prev], None)
        t2 = time.perf_counter()
        st.on_schedule(SimpleNamespace(finished_req_ids=[], scheduled_new_reqs=new))
        t3 = time.perf_counter()
        k = len(new)
        st.plan_step([r.req_id for r in new], np.arange(0, PROMPT * k + 1, PROMPT, dtype=np.int32), np.zeros(k, np.int32))
        t4 = time.perf_counter()
        voided = [r.req_id for r in new if r.req_id not in st.plans]
        assert not voided, f"{len(voided)} cells have no plan (voided: {st.requests[voided[0]].program.errors})"
        t["finish"] += t1 - t0
        t["collect"] += t2 - t1
        t["register"] += t3 - t2
        t["plan_step"] += t4 - t3
        prev = [r.req_id for r in new]
    t0 = time.perf_counter()
    st.on_schedule(SimpleNamespace(finished_req_ids=list(prev), scheduled_new_reqs=[]))
    t1 = time.perf_counter()
    st.collect([f"k{r[1:]}" for r in prev], None)
    t["finish"] += t1 - t0
    t["collect"] += time.perf_counter() - t1
    return t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--n", type=int, default=768)
    ap.add_argument("--per-step", type=int, default=768)
    ap.add_argument("--profile", type=int, default=0, help="print the top N functions of one profiled repetition")
    ap.add_argument("--sort", default="tottime", help="pstats order of --profile (tottime, cumulative)")
    args = ap.parse_args()
    dims = ModelDims(L, H, 128256, 0.02)
    st = WorkerState(L, H, 16384, torch.device("cpu"), torch.bfloat16, WorkerConfig())
    g = torch.Generator().manual_seed(0)
    values = {(site_index(layer, h), p): (torch.randn(H, generator=g).to(torch.bfloat16), torch.randn(H, generator=g).to(torch.bfloat16))
              for layer in range(L) for h in HOOKS for p in range(PROMPT)}
    st.store.put("clean", values)
    phases: dict[str, list[float]] = {k: [] for k in ("register", "plan_step", "finish", "collect")}
    rid = 0
    for rep in range(args.reps + 1 + (1 if args.profile else 0)):
        batches = []
        for first in range(0, args.n, args.per_step):
            k = min(args.per_step, args.n - first)
            batches.append(requests(k, dims, rid))
            rid += k
        if rep == args.reps + 1:
            prof = cProfile.Profile()
            prof.enable()
            run_once(st, batches)
            prof.disable()
            pstats.Stats(prof).sort_stats(args.sort).print_stats(args.profile)
            continue
        t = run_once(st, batches)
        if rep:  # the first is a warm-up
            for p, v in t.items():
                phases[p].append(v / args.n * 1e6)
    out = {p: round(statistics.median(v), 2) for p, v in phases.items()}
    out["total_us_per_cell"] = round(sum(out.values()), 2)
    print(json.dumps({"bench": "cell_worker", "n": args.n, "per_step": args.per_step, "reps": args.reps,
                      "us_per_cell": out, "slots_in_use": len(st.slots)}))


if __name__ == "__main__":
    main()
