"""Host time of the small CUDA operations dynamic steering issues per step (launch costs on the GPU host),
and whether a CUDA graph of the probe scores equals the eager scores bit for bit.

    python3 benchmarks/diag/op_costs.py
"""
import json
import sys
import time

import numpy as np
import torch

if not torch.cuda.is_available():
    sys.exit("op_costs.py times CUDA operations: no CUDA device here")
dev = torch.device("cuda")
def t(name, fn, n=3000):
    for _ in range(200): fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter_ns()
    for _ in range(n): fn()
    dt = (time.perf_counter_ns() - t0) / n / 1e3
    torch.cuda.synchronize()
    print(json.dumps({"op": name, "us": round(dt, 2)}), flush=True)
rs = torch.empty(8192, 200, dtype=torch.int32, device=dev)
st = torch.empty(8192, 200, dtype=torch.int32, pin_memory=True)
t("h2d_pinned_33rows_slice", lambda: rs[:33].copy_(st[:33], non_blocking=True))
flat = torch.zeros(32, device=dev)
host = torch.empty(1024, pin_memory=True)
h = host[:32]
t("d2h_pinned_32", lambda: h.copy_(flat, non_blocking=True))
ev = torch.cuda.Event()
t("event_record", lambda: ev.record())
s = torch.cuda.current_stream()
t("event_record_stream", lambda: ev.record(s))
t("event_sync", lambda: ev.synchronize())
t("current_stream", lambda: torch.cuda.current_stream())
x = torch.randn(8192, 2048, device=dev, dtype=torch.bfloat16)
r = torch.randn(8192, 2048, device=dev, dtype=torch.bfloat16)
rows = torch.arange(100, 132, device=dev)
w = torch.randn(1, 2048, device=dev)
b = torch.randn(1, device=dev)
def scores():
    v = x.index_select(0, rows).to(torch.float32, copy=True).add_(r.index_select(0, rows))
    return (v @ w.T + b).flatten()
t("scores_eager", scores)
t("index_select", lambda: x.index_select(0, rows))
t("torch_add_small", lambda: flat.add_(1.0))
hs = np.zeros((8192, 200), np.int32)
t("stage_numpy_copy_33rows", lambda: st.numpy().__setitem__(slice(0, 33), hs[:33]))
t("pin_memory_128B", lambda: torch.from_numpy(np.zeros(32, np.float32)).pin_memory())
# graph of the scores
g = torch.cuda.CUDAGraph()
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    for _ in range(3):
        scores()
torch.cuda.current_stream().wait_stream(side)
with torch.cuda.graph(g):
    out = scores()
eager = scores()
g.replay()
torch.cuda.synchronize()
print(json.dumps({"graph_equal_eager": bool(torch.equal(out, eager))}))
t("scores_graph_replay", lambda: g.replay())
