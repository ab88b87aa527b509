"""CPU micro-benchmark of the per-step planner (WorkerState.plan_step): batch-32 decode steps of a
Llama-3.2-1B-shaped model (16 layers, hidden 2048), every request steering 0, 1 or 16 sites.

    .venv/bin/python benchmarks/planner_bench.py
"""
import time, numpy as np, torch
from engine_ext.worker.state import WorkerState, WorkerConfig
from engine_ext.program import compile_program, ModelDims, PromptInfo, program_to_extra_args
from engine_ext.specs import Interventions, Steer
from engine_ext.worker.row_plan import RowPlan, ScheduledRequest
L, H = 16, 2048
dims = ModelDims(L, H, 128256, 0.02)
v = np.random.default_rng(0).standard_normal(H).astype(np.float32)
for sites, label in ((None, "vanilla"), (["L8.post_block"], "1 site"), ([f"L{l}.post_block" for l in range(L)], "16 sites")):
    st = WorkerState(L, H, 8192, torch.device("cpu"), torch.float32, WorkerConfig())
    if sites:
        spec = Interventions(steer=(Steer.make(sites, v),))
        for i in range(32):
            prog = compile_program(spec, PromptInfo(list(range(32)), None, None, 128), dims, key=f"k{i}", named_vector_dims=lambda n: None)
            st.register(f"r{i}", program_to_extra_args(prog))
    times = []
    for step in range(30):
        plan = RowPlan([ScheduledRequest(f"r{i}", i, 1, 32 + step, 32) for i in range(32)], 32)
        t = time.perf_counter(); st.plan_step(plan); times.append(time.perf_counter() - t)
    print(label, f"median {np.median(times[5:])*1e3:.2f} ms per decode step (batch 32)")
