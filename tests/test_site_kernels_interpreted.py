"""Fast tier (no engine, no GPU): the CUDA site kernels (`intervention_op._triton_kernels`) run
under Triton's CPU interpreter (`TRITON_INTERPRET=1`, in a subprocess) against the torch
implementation the CPU engine uses: the single-site kernel at a pair site and at a branch site,
and the merged kernel of `sites_op` (`mlp_out`, `post_block`, the next `pre_attn` in one launch)
against the three sites in turn. Every slot mode is exercised (scalar and per-dimension affine,
replacement with `a = 0`, pairs, directional clamps, row gates) with captures at every site.

In fp32 every row without a reduction must be bit-identical (the interpreter does its float32
arithmetic in numpy; its conversions to 16-bit types are its own, so 16-bit dtypes are not
compared here — the GPU matrix compares the compiled kernels); rows with a clamp or a row gate
(sums in each implementation's own order) must agree to 1e-5."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO

SCRIPT = r"""
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
from engine_ext.worker import intervention_op as op
from engine_ext.worker.intervention_op import SiteBuffers, SlotMode

H, ROWS, SITES = 48, 12, 10
B_SITE, P_SITE, N_SITE = 3, 4, 5

def buffers(seed, reductions):
    g = torch.Generator().manual_seed(seed)
    b = SiteBuffers(SITES, 16, 12, 64, H, torch.device("cpu"), torch.float32)
    b.slot_mode[:] = SlotMode.AFFINE
    b.slot_a[0] = 0.5; b.slot_c[0] = torch.randn(H, generator=g)
    b.slot_a[1] = 0.0; b.slot_c[1] = torch.randn(H, generator=g)
    b.slot_mode[2] = SlotMode.PAIR; b.slot_px[2] = torch.randn(H, generator=g); b.slot_pr[2] = torch.randn(H, generator=g)
    b.slot_adim[3] = 0; b.dim_a[0] = torch.rand(H, generator=g); b.slot_c[3] = torch.randn(H, generator=g)
    b.slot_a[4] = -1.5; b.slot_c[4] = torch.randn(H, generator=g)
    if reductions:
        b.slot_clamp[4] = 0
        b.clamp_dir[0, 0] = torch.nn.functional.normalize(torch.randn(H, generator=g), dim=0)
        b.clamp_lo[0, 0], b.clamp_hi[0, 0] = -0.2, 0.3
        b.slot_gate[0] = 0
        b.gate_probe[0] = torch.randn(H, generator=g) / H ** 0.5
        b.gate_params[0] = torch.tensor([0.1, 2.0]); b.gate_term[0] = torch.randn(H, generator=g)
    # rows: a slot (or none) and a capture (or none) at each of the three sites
    choice = torch.randint(-1, 5, (ROWS, 3), generator=g)
    caps = torch.randint(0, 2, (ROWS, 3), generator=g)
    k = 0
    for row in range(ROWS):
        for j, site in enumerate((B_SITE, P_SITE, N_SITE)):
            b.row_slot[row, site] = int(choice[row, j])
            if caps[row, j]:
                b.cap_dst[row, site] = k; k += 1
    b.active[:] = [True] * SITES
    return b

def run(seed, reductions, fn):
    b = buffers(seed, reductions)
    g = torch.Generator().manual_seed(seed + 100)
    x = torch.randn(ROWS, H, generator=g); r = torch.randn(ROWS, H, generator=g)
    fn(b, x, r)
    return x, r, b.cap_x.clone(), b.cap_r.clone(), b.gate_out.clone()

def torch_impl(fn):
    def go(b, x, r):
        b.use_triton = False
        fn(b, x, r)
    return go

single_pair = lambda b, x, r: op._apply_triton(b, x, r, P_SITE)
single_branch = lambda b, x, r: op._apply_triton(b, x, None, B_SITE)
ref_pair = torch_impl(lambda b, x, r: op._apply_torch(b, x, r, P_SITE))
ref_branch = torch_impl(lambda b, x, r: op._apply_torch(b, x, None, B_SITE))
merged = lambda b, x, r: op._apply_sites_triton(b, x, r, B_SITE, P_SITE, N_SITE)
merged_last = lambda b, x, r: op._apply_sites_triton(b, x, r, B_SITE, P_SITE, -1)
in_turn = torch_impl(lambda b, x, r: op._apply_sites_in_turn(b, x, r, B_SITE, P_SITE, N_SITE))
in_turn_last = torch_impl(lambda b, x, r: op._apply_sites_in_turn(b, x, r, B_SITE, P_SITE, -1))

bad = []
for seed in range(6):
    for reductions in (False, True):
        for name, got_fn, want_fn in (("single pair", single_pair, ref_pair), ("single branch", single_branch, ref_branch),
                                      ("merged", merged, in_turn), ("merged, no next", merged_last, in_turn_last)):
            got, want = run(seed, reductions, got_fn), run(seed, reductions, want_fn)
            for label, a, w in zip(("x", "r", "cap_x", "cap_r", "gate_out"), got, want):
                ok = torch.equal(a, w) if not reductions else torch.allclose(a, w, rtol=1e-5, atol=1e-5)
                if not ok:
                    bad.append((name, seed, reductions, label, float((a - w).abs().max())))
print("BAD", bad)
sys.exit(1 if bad else 0)
"""


def test_the_site_kernels_equal_the_torch_implementation_under_the_interpreter():
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert "BAD []" in proc.stdout
