"""The per-step device work of decisions taken on the device (`device_decisions`), as one Triton
kernel launch each on CUDA (instead of the ~60 small torch operations of `PolicyTable.decide`
and the row rewrite, whose host time per launch made the mode slower than deciding on the host):

* `decide(table, flat, picks, scales, readback)`: every window's policy decides from its score
  (`flat[picks[i]]`) with `PolicyTable.decide`'s arithmetic — float64, one operation per
  arithmetic step (no fused multiply-add: `enable_fp_fusion=False`), the same comparisons (NaN
  compares false) and `torch.where` forms of Python's `min`/`max` — updating the table's state in
  place, writing each window's scale at the next position to `scales` and `(score, scale)` to
  `readback[i]`, `readback[k + i]` (one device-to-host copy);
* `rewrite(row_slot, rows, sites, q, on, off, scales, ...)`: each entry's `row_slot[row, site]`
  from its window's scale (`on` where it is non-zero, else `off`), and each proportional entry's
  slot payload `c = vector * f32(scale)` (round to nearest, as `torch.Tensor.to(float32)`).

Elsewhere (CPU) the same work runs as torch operations (`PolicyTable.decide`): the reference the
kernel is checked against on the GPU (`benchmarks/dynamic_gpu_check.py`: the host takes every
decision again from the read-back and compares).
"""

from __future__ import annotations

import torch

from engine_ext.dynamic.device_rule import THRESHOLD, PolicyTable

_KERNELS = None


def _kernels():
    global _KERNELS
    if _KERNELS is not None:
        return _KERNELS
    import triton
    import triton.language as tl

    @triton.jit
    def decide_kernel(flat_ptr, picks_ptr, mode_ptr, on_ptr, rel_ptr, minhold_ptr, escale_ptr, latchnone_ptr,
                      gain_ptr, target_ptr, lo_ptr, hi_ptr, eng_ptr, held_ptr, lat_ptr, scale_ptr,
                      out_ptr, rb_ptr, k, THR: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < k
        pick = tl.load(picks_ptr + i, mask=m, other=0)
        x = tl.load(flat_ptr + pick, mask=m, other=0.0).to(tl.float64)
        thr = tl.load(mode_ptr + i, mask=m, other=0) == THR
        eng = tl.load(eng_ptr + i, mask=m, other=0) != 0
        held = tl.load(held_ptr + i, mask=m, other=0)
        lat = tl.load(lat_ptr + i, mask=m, other=0) != 0
        latch_none = tl.load(latchnone_ptr + i, mask=m, other=0) != 0
        # threshold with hysteresis
        held1 = tl.where(eng, held + 1, held)
        release = (eng & latch_none & (~lat) & (held1 >= tl.load(minhold_ptr + i, mask=m, other=0))
                   & (x < tl.load(rel_ptr + i, mask=m, other=0.0)))
        engage = (~eng) & (x >= tl.load(on_ptr + i, mask=m, other=0.0))
        eng2 = (eng & (~release)) | engage
        held2 = tl.where(release | engage, 0, held1)
        lat2 = lat | (engage & (~latch_none))
        thr_scale = tl.where(eng2, tl.load(escale_ptr + i, mask=m, other=0.0), 0.0)
        # proportional control: s = scale + gain * (target - x), then min(hi, max(lo, s))
        scale = tl.load(scale_ptr + i, mask=m, other=0.0)
        t = tl.load(target_ptr + i, mask=m, other=0.0) - x
        t = tl.load(gain_ptr + i, mask=m, other=0.0) * t
        s = scale + t
        lo = tl.load(lo_ptr + i, mask=m, other=0.0)
        hi = tl.load(hi_ptr + i, mask=m, other=0.0)
        s = tl.where(s > lo, s, lo)
        s = tl.where(s < hi, s, hi)
        tl.store(eng_ptr + i, tl.where(thr, eng2, eng).to(tl.int8), mask=m)
        tl.store(held_ptr + i, tl.where(thr, held2, held), mask=m)
        tl.store(lat_ptr + i, tl.where(thr, lat2, lat).to(tl.int8), mask=m)
        tl.store(scale_ptr + i, tl.where(thr, scale, s), mask=m)
        out = tl.where(thr, thr_scale, s)
        tl.store(out_ptr + i, out, mask=m)
        tl.store(rb_ptr + i, x, mask=m)
        tl.store(rb_ptr + k + i, out, mask=m)

    @triton.jit
    def rewrite_kernel(row_slot_ptr, rows_ptr, sites_ptr, q_ptr, on_ptr, off_ptr, scales_ptr, n, num_sites,
                       BLOCK: tl.constexpr):
        e = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = e < n
        q = tl.load(q_ptr + e, mask=m, other=0)
        s = tl.load(scales_ptr + q, mask=m, other=0.0)
        slot = tl.where(s != 0.0, tl.load(on_ptr + e, mask=m, other=-1), tl.load(off_ptr + e, mask=m, other=-1))
        row = tl.load(rows_ptr + e, mask=m, other=0)
        site = tl.load(sites_ptr + e, mask=m, other=0)
        tl.store(row_slot_ptr + row * num_sites + site, slot, mask=m)

    @triton.jit
    def payload_kernel(c_ptr, live_ptr, live_q_ptr, vec_ptr, scales_ptr, hidden, BLOCK: tl.constexpr):
        e = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        m = offs < hidden
        slot = tl.load(live_ptr + e)
        s32 = tl.load(scales_ptr + tl.load(live_q_ptr + e)).to(tl.float32)
        v = tl.load(vec_ptr + e * hidden + offs, mask=m)
        tl.store(c_ptr + slot * hidden + offs, v * s32, mask=m)

    _KERNELS = (decide_kernel, rewrite_kernel, payload_kernel)
    return _KERNELS


def use_kernels(device: torch.device) -> bool:
    return device.type == "cuda"


def decide(table: PolicyTable, idx: torch.Tensor, flat: torch.Tensor, picks: torch.Tensor,
           scales: torch.Tensor, readback: torch.Tensor) -> None:
    """`scales[:] = table.decide(idx, flat[picks])` (`idx`: every slot of the table, in order),
    and `readback[:k] = score`, `readback[k:] = scale` (float64)."""
    k = picks.numel()
    if not use_kernels(flat.device):
        x = flat.index_select(0, picks)
        scales.copy_(table.decide(idx, x))
        readback[:k].copy_(x.to(torch.float64))
        readback[k:].copy_(scales)
        return
    import triton

    kernel = _kernels()[0]
    block = min(1024, triton.next_power_of_2(max(k, 16)))
    t = table
    kernel[(triton.cdiv(k, block),)](
        flat, picks, t.mode, t.on, t.release_at, t.min_hold, t.engage_scale, t.latch_none.view(torch.int8),
        t.gain, t.target, t.min_scale, t.max_scale, t.engaged.view(torch.int8), t.held,
        t.latched.view(torch.int8), t.scale, scales, readback, k, THR=THRESHOLD, BLOCK=block,
        num_warps=4, enable_fp_fusion=False)


def rewrite(row_slot: torch.Tensor, rows: torch.Tensor, sites: torch.Tensor, q: torch.Tensor, on: torch.Tensor,
            off: torch.Tensor, scales: torch.Tensor, slot_c: torch.Tensor, live: torch.Tensor, live_q: torch.Tensor,
            live_vec: torch.Tensor | None) -> None:
    """Each entry's `row_slot[rows, sites]` from its window's scale (`on` where non-zero, else
    `off`); each proportional entry's payload `slot_c[live] = live_vec * f32(scale)`."""
    n = rows.numel()
    if not use_kernels(row_slot.device):
        flags = scales != 0.0
        row_slot[rows, sites] = torch.where(flags.index_select(0, q), on, off)
        if live_vec is not None:
            s32 = scales.index_select(0, live_q).to(torch.float32)
            slot_c.index_copy_(0, live, live_vec * s32[:, None])
        return
    import triton

    rewrite_kernel, payload_kernel = _kernels()[1:]
    if n:
        block = min(1024, triton.next_power_of_2(max(n, 16)))
        rewrite_kernel[(triton.cdiv(n, block),)](row_slot, rows, sites, q, on, off, scales, n, row_slot.shape[1],
                                                 BLOCK=block, num_warps=4)
    if live_vec is not None and live.numel():
        hidden = live_vec.shape[1]
        payload_kernel[(live.numel(),)](slot_c, live, live_q, live_vec, scales, hidden,
                                        BLOCK=triton.next_power_of_2(hidden), num_warps=4, enable_fp_fusion=False)
