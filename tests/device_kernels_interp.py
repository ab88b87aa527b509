"""Run by tests/test_device_kernels.py in its own process: the Triton kernels of
`engine_ext/dynamic/device_kernels.py` under Triton's interpreter (CPU tensors, numpy arithmetic:
IEEE float64 like the GPU's), against the torch reference (`PolicyTable.decide`, the row rewrite,
the proportional payload), bit for bit, on random tables: every state, NaN scores, empty and
partial blocks. The interpreter must be chosen before Triton is imported."""
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from engine_ext.dynamic import device_kernels as K  # noqa: E402
from engine_ext.dynamic.device_rule import PolicyTable  # noqa: E402

def table(k, rng):
    t = PolicyTable(k, "cpu")
    t.mode[:] = torch.from_numpy(rng.integers(0, 2, k).astype(np.int8))
    for name in ("on", "release_at", "engage_scale", "gain", "target", "scale"):
        getattr(t, name)[:] = torch.from_numpy(rng.standard_normal(k))
    t.min_scale[:] = torch.from_numpy(-abs(rng.standard_normal(k)))
    t.max_scale[:] = torch.from_numpy(abs(rng.standard_normal(k)))
    t.min_hold[:] = torch.from_numpy(rng.integers(0, 4, k))
    t.held[:] = torch.from_numpy(rng.integers(0, 5, k))
    for name in ("latch_none", "engaged", "latched"):
        getattr(t, name)[:] = torch.from_numpy(rng.integers(0, 2, k).astype(bool))
    return t

def clone(t):
    u = PolicyTable(t.capacity, "cpu")
    for n, v in vars(t).items():
        if isinstance(v, torch.Tensor): setattr(u, n, v.clone())
    return u

# force the kernel path on CPU tensors (interpreter)
K.use_kernels = lambda device: True
rng = np.random.default_rng(0)
for trial in range(int(sys.argv[1]) if len(sys.argv) > 1 else 20):
    k = int(rng.integers(1, 70))
    a = table(k, rng); b = clone(a)
    flat = torch.from_numpy(rng.standard_normal(3 * k).astype(np.float32))
    flat[rng.integers(0, 3 * k)] = float("nan")
    picks = torch.from_numpy(rng.permutation(3 * k)[:k].astype(np.int64))
    idx = torch.arange(k)
    want = a.decide(idx, flat.index_select(0, picks))
    scales = torch.zeros(k, dtype=torch.float64); rb = torch.zeros(2 * k, dtype=torch.float64)
    K.decide(b, idx, flat, picks, scales, rb)
    assert torch.equal(scales.view(torch.int64), want.view(torch.int64)), trial
    for n in ("engaged", "held", "latched", "scale"):
        assert torch.equal(getattr(a, n), getattr(b, n)), (trial, n)
    assert torch.equal(rb[:k].view(torch.int64), flat.index_select(0, picks).double().view(torch.int64))
    assert torch.equal(rb[k:].view(torch.int64), scales.view(torch.int64))
    # rewrite
    S, H = 5, 8
    row_slot = torch.full((40, S), -1, dtype=torch.int32); ref = row_slot.clone()
    n = int(rng.integers(1, 30))
    rows = torch.from_numpy(rng.permutation(40)[:n].astype(np.int64)); sites = torch.from_numpy(rng.integers(0, S, n))
    q = torch.from_numpy(rng.integers(0, k, n)); on = torch.from_numpy(rng.integers(0, 50, n).astype(np.int32)); off = torch.from_numpy(rng.integers(-1, 50, n).astype(np.int32))
    nl = int(rng.integers(0, 4))
    c = torch.zeros(60, H); cref = c.clone()
    live = torch.from_numpy(rng.permutation(60)[:nl].astype(np.int64)); live_q = torch.from_numpy(rng.integers(0, k, nl)); vec = torch.randn(nl, H) if nl else None
    K.rewrite(row_slot, rows, sites, q, on, off, scales, c, live, live_q, vec)
    flags = scales != 0.0
    ref[rows, sites] = torch.where(flags.index_select(0, q), on, off)
    if vec is not None:
        cref.index_copy_(0, live, vec * scales.index_select(0, live_q).to(torch.float32)[:, None])
    assert torch.equal(row_slot, ref), trial
    assert torch.equal(c, cref), trial
print("kernel == torch reference in", trial + 1, "trials")
