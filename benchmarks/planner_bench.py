"""CPU micro-benchmark of the per-step planner (WorkerState.plan_step): batch-32 decode steps of a
Llama-3.2-1B-shaped model (16 layers, hidden 2048), every request steering 0, 1 or 16 sites, and
a 768-request one-token sweep step (16-token prompt, one patched (site, position) per request).

    .venv/bin/python benchmarks/planner_bench.py
"""
import time

import numpy as np
import torch

from engine_ext.program import ModelDims, PromptInfo, compile_program, program_to_extra_args
from engine_ext.specs import Interventions, Patch, Steer
from engine_ext.worker.state import WorkerConfig, WorkerState

L, H = 16, 2048
dims = ModelDims(L, H, 128256, 0.02)
v = np.random.default_rng(0).standard_normal(H).astype(np.float32)


def decode_steps(st: WorkerState, n: int = 32, steps: int = 30) -> float:
    req_ids = [f"r{i}" for i in range(n)]
    qsl = np.arange(n + 1, dtype=np.int32)
    times = []
    for step in range(steps):
        t = time.perf_counter()
        st.plan_step(req_ids, qsl, np.full(n, 32 + step, np.int32))
        times.append(time.perf_counter() - t)
    return float(np.median(times[5:]))


for sites, label in ((None, "vanilla"), (["L8.post_block"], "1 site"), ([f"L{l}.post_block" for l in range(L)], "16 sites")):
    st = WorkerState(L, H, 8192, torch.device("cpu"), torch.float32, WorkerConfig())
    if sites:
        spec = Interventions(steer=(Steer.make(sites, v),))
        t0 = time.perf_counter()
        for i in range(32):
            prog = compile_program(spec, PromptInfo(list(range(32)), None, None, 128), dims, key=f"k{i}", named_vector_dims=lambda n: None)
            st.register(f"r{i}", program_to_extra_args(prog))
        reg = (time.perf_counter() - t0) / 32
    else:
        reg = 0.0
    print(f"{label}: {decode_steps(st) * 1e3:.3f} ms per decode step (batch 32); registration {reg * 1e6:.0f} us per request")

# a sweep step: 768 one-token requests of a 16-token prompt, each patched at one (site, position)
st = WorkerState(L, H, 16384, torch.device("cpu"), torch.float32, WorkerConfig())
vals = {(s, p): (torch.randn(H), torch.randn(H)) for s in range(3 * L) for p in range(16)}
st.store.put("clean", vals)
cells = [(l, h, p) for l in range(L) for h in ("pre_attn", "post_attn", "post_block") for p in range(16)]
t0 = time.perf_counter()
for i, (l, h, p) in enumerate(cells):
    spec = Interventions(patch=(Patch.make(f"L{l}.{h}", [p], {"run": "clean", "positions": [p]}),))
    prog = compile_program(spec, PromptInfo(list(range(16)), None, None, 1), dims, key=f"c{i}", named_vector_dims=lambda n: None)
    st.register(f"c{i}", program_to_extra_args(prog))
reg = (time.perf_counter() - t0) / len(cells)
req_ids = [f"c{i}" for i in range(len(cells))]
qsl = np.arange(0, 16 * len(cells) + 1, 16, dtype=np.int32)
t = time.perf_counter()
st.plan_step(req_ids, qsl, np.zeros(len(cells), np.int32))
print(f"sweep step (768 requests x 16 tokens): {(time.perf_counter() - t) * 1e3:.2f} ms; compile + registration {reg * 1e6:.0f} us per request")
