"""The intervention op and the persistent buffers it reads (registered by `seam` as
`vllm::causalboard_site` / `vllm::causalboard_embed_site`).

Every patched decoder layer calls the op at each of its sites, in every step and every mode
(eager, torch.compile, CUDA graphs). The op is opaque to torch.compile; it reads per-step *buffer
contents* filled by the planner (`planner.StepPlanner`) and never changes shapes, so a captured
CUDA graph replays it correctly.

vLLM carries the residual stream as a pair (x, r) whose true value is `fp32(x) + fp32(r)` (the
add is deferred into the next fused add-norm). Per row and site, `row_slot[row, site]` names a
slot (-1: leave the row bit-identical) and the slot's `SlotMode` says what to do:

* `AFFINE` — `new = a * s + c` in fp32, per dimension (`a == 0` means `new = c` exactly), where
  `a` is the slot's scalar `slot_a`, or, for a slot with `slot_adim >= 0`, that row of `dim_a`
  (a per-dimension `a`: dimension-masked patches), written back as
  `r = dt(new)`, `x = dt(new - r)` (two-term split: the next add recovers `new` to ~2^-16 relative
  in bf16; exactly in fp32);
* `PAIR`   — `x = px`, `r = pr` (a stored source run's own pair: replacement is bit-exact).

An `AFFINE` slot may also carry directional clamps (`slot_clamp[slot] >= 0`: a row of the clamp
tables, shared by every slot with the same clamps): after the affine edit, with `K` unit
directions `d_k` and bounds `[lo_k, hi_k]`, strengths `st_k` (unused entries: zero directions),

    p_k = sum(new * d_k)                                  (fp32, every k from the same `new`)
    new = new + sum_k st_k * (min(max(p_k, lo_k), hi_k) - p_k) * d_k

(the reference fork's clamp: a value inside its bounds is untouched), then written back as above.

An `AFFINE` slot may also carry a *row gate* (`slot_gate[slot] >= 0`: a row `q` of the gate
tables, content-addressed like the clamp rows): the reference fork's per-row in-graph monitor
(`this_token` + probe gates). From the row's value `s` *before* the edit (the same `s` as above),

    score = sum(s * gate_probe[q])                        (fp32)
    g     = 1 / (1 + exp(-(sharpness_q * (score - threshold_q))))
    new   = (a * s + c) + (g - 1) * gate_term[q]

so the slot's gated term `gate_term[q]` (what the fork's row adds at that site: the request's own
static decode steering and its fired `add` gates) is applied scaled by `g`, and `g = 1` leaves the
slot's ungated value exactly; the rest of the slot (`a`, the other parts of `c`) is not gated.
The clamps, if any, come after. The op writes `(score, g)` to `gate_out[row]` (read back after the
forward: the trace reports the `g` the op used).

Single-tensor sites (`embed_site_op`: layer 0's `pre_attn`, where the stream is the embeddings
alone, and the MLP-branch sites `mlp_in` / `mlp_out`) have no `r`: the value is `x` itself,
`AFFINE` writes `x = dt(new)`, `PAIR` writes `x = px`, and captures store `r = 0`.

Captures copy the (post-intervention) pair of rows whose `cap_dst[row, site]` is >= 0 into that
row of `cap_x` / `cap_r`.

Two implementations with the same arithmetic (fp32, no fused multiply-add):

* CUDA: one Triton kernel launch per site call, one program per row; a row with neither a slot
  nor a capture returns after two scalar loads, so an idle site costs one tiny launch. With
  merged sites (`sites_op`, the default; `CAUSALBOARD_MERGED_SITES=0`: one call per site) one
  launch serves `mlp_out`, `post_block` and the next layer's `pre_attn` (both kernels run the
  same per-site code, `site_edit`).
* CPU (and any non-CUDA device): torch ops on the active rows only; the planner's per-step
  `active` flags let an idle site return at once (CPU runs eagerly: no graph is captured).

(and a branch-free torch version for CUDA tensors the kernel cannot take, `_apply_torch_cuda`).
The element-wise arithmetic is the same in all three; the reductions (a row gate's score, a
clamp's projections) sum in each implementation's own order, and the kernel's `exp` is Triton's,
so a gate's `g` agrees across implementations to fp32 rounding (~1e-6 relative), not bit for bit.
"""

from __future__ import annotations

from enum import IntEnum

import torch

from engine_ext.worker import cuda_streams

#: buffers of each live engine in this process, by state id (the int the op receives)
BUFFERS: dict[int, "SiteBuffers"] = {}


class SlotMode(IntEnum):
    """What a slot does to a row (the values in `SiteBuffers.slot_mode`)."""

    AFFINE = 1
    PAIR = 2


class SiteBuffers:
    """Persistent per-engine buffers on the model's device. Allocated once, before any graph
    capture; never resized. Row-indexed tables are laid out `[row, site]`."""

    def __init__(self, num_sites: int, max_rows: int, max_slots: int, max_capture_rows: int,
                 hidden: int, device: torch.device, dtype: torch.dtype, max_dim_rows: int = 256,
                 max_clamp_rows: int = 256, max_clamp_dirs: int = 4, max_gate_rows: int = 256):
        self.num_sites, self.max_rows, self.max_slots = num_sites, max_rows, max_slots
        self.max_capture_rows, self.hidden, self.device, self.dtype = max_capture_rows, hidden, device, dtype
        #: the CUDA device index (None off CUDA) for `cuda_streams.record`
        self.cuda_index = cuda_streams.device_index(torch.device(device)) if torch.device(device).type == "cuda" else None
        self.row_slot = torch.full((max_rows, num_sites), -1, dtype=torch.int32, device=device)
        self.cap_dst = torch.full((max_rows, num_sites), -1, dtype=torch.int32, device=device)
        self.slot_mode = torch.zeros(max_slots, dtype=torch.int32, device=device)
        self.slot_a = torch.ones(max_slots, dtype=torch.float32, device=device)
        #: per slot: the row of `dim_a` holding its per-dimension `a` (-1: the scalar `slot_a`)
        self.slot_adim = torch.full((max_slots,), -1, dtype=torch.int32, device=device)
        self.max_dim_rows = max_dim_rows
        self.dim_a = torch.ones(max_dim_rows, hidden, dtype=torch.float32, device=device)
        self.slot_c = torch.zeros(max_slots, hidden, dtype=torch.float32, device=device)
        #: per slot: the row of the clamp tables holding its clamps (-1: none)
        self.slot_clamp = torch.full((max_slots,), -1, dtype=torch.int32, device=device)
        self.max_clamp_rows, self.max_clamp_dirs = max_clamp_rows, max_clamp_dirs
        #: clamp rows: K unit directions each (unused entries zero), their bounds and strengths
        self.clamp_dir = torch.zeros(max_clamp_rows, max_clamp_dirs, hidden, dtype=torch.float32, device=device)
        self.clamp_lo = torch.full((max_clamp_rows, max_clamp_dirs), -float("inf"), dtype=torch.float32, device=device)
        self.clamp_hi = torch.full((max_clamp_rows, max_clamp_dirs), float("inf"), dtype=torch.float32, device=device)
        self.clamp_st = torch.ones(max_clamp_rows, max_clamp_dirs, dtype=torch.float32, device=device)
        #: per slot: the row of the gate tables holding its row gate (-1: none)
        self.slot_gate = torch.full((max_slots,), -1, dtype=torch.int32, device=device)
        self.max_gate_rows = max_gate_rows
        #: gate rows: probe direction, [threshold, sharpness], the gated term
        self.gate_probe = torch.zeros(max_gate_rows, hidden, dtype=torch.float32, device=device)
        self.gate_params = torch.zeros(max_gate_rows, 2, dtype=torch.float32, device=device)
        self.gate_term = torch.zeros(max_gate_rows, hidden, dtype=torch.float32, device=device)
        #: per row of the step: [score, g] of its gated slot (written only where a row gate applied)
        self.gate_out = torch.zeros(max_rows, 2, dtype=torch.float32, device=device)
        self.slot_px = torch.zeros(max_slots, hidden, dtype=dtype, device=device)
        self.slot_pr = torch.zeros(max_slots, hidden, dtype=dtype, device=device)
        self.cap_x = torch.zeros(max_capture_rows, hidden, dtype=dtype, device=device)
        self.cap_r = torch.zeros(max_capture_rows, hidden, dtype=dtype, device=device)
        #: host-side, per site: does any row of this step have a slot or a capture there?
        #: (read by the CPU implementation only; CUDA graphs cannot branch on it)
        self.active: list[bool] = [False] * num_sites
        self.use_triton = device.type == "cuda"
        self._tensors: tuple[torch.Tensor, ...] | None = None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every buffer, in the site kernels' argument order (the same tensors for the engine's
        life: the tuple is built once)."""
        if self._tensors is None:
            self._tensors = (self.row_slot, self.cap_dst, self.slot_mode, self.slot_a, self.slot_adim, self.dim_a,
                             self.slot_c, self.slot_px, self.slot_pr, self.cap_x, self.cap_r, self.slot_clamp,
                             self.clamp_dir, self.clamp_lo, self.clamp_hi, self.clamp_st, self.slot_gate,
                             self.gate_probe, self.gate_params, self.gate_term, self.gate_out)
        return self._tensors

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


# ---- CPU / reference implementation ------------------------------------------------------------
def clamp_correction(new: torch.Tensor, dirs: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                     st: torch.Tensor) -> torch.Tensor:
    """`sum_k st_k * (min(max(p_k, lo_k), hi_k) - p_k) * d_k` with `p_k = sum(new * d_k)`, fp32:
    new [n, H], dirs [n, K, H], lo / hi / st [n, K] -> [n, H]."""
    p = (new.unsqueeze(1) * dirs).sum(dim=-1)
    delta = st * (torch.minimum(torch.maximum(p, lo), hi) - p)
    return (delta.unsqueeze(-1) * dirs).sum(dim=1)


def _clamped(b: SiteBuffers, new: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """`new` (fp32, rows of slots `idx`) after the clamps of those slots."""
    cl = b.slot_clamp[idx]
    sel = torch.nonzero(cl >= 0).flatten()
    if not sel.numel():
        return new
    rows = cl[sel].long()
    new = new.clone()
    new[sel] = new[sel] + clamp_correction(new[sel], b.clamp_dir[rows], b.clamp_lo[rows], b.clamp_hi[rows], b.clamp_st[rows])
    return new


def gate_values(s: torch.Tensor, probe: torch.Tensor, params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The row gate's `(score, g)`, fp32: s / probe [n, H], params [n, 2] -> [n], [n]."""
    score = (s * probe).sum(dim=-1)
    z = params[:, 1] * (score - params[:, 0])
    return score, 1.0 / (1.0 + torch.exp(-z))


def _gated(b: SiteBuffers, new: torch.Tensor, s: torch.Tensor, idx: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`new` (fp32, rows `rows` of slots `idx`) after the row gates of those slots; records
    `(score, g)` in `gate_out`."""
    gq = b.slot_gate[idx]
    sel = torch.nonzero(gq >= 0).flatten()
    if not sel.numel():
        return new
    q = gq[sel].long()
    score, g = gate_values(s[sel], b.gate_probe[q], b.gate_params[q])
    new = new.clone()
    new[sel] = new[sel] + (g - 1.0).unsqueeze(1) * b.gate_term[q]
    b.gate_out.index_copy_(0, rows[sel], torch.stack([score, g], dim=1))
    return new


def _apply_torch(b: SiteBuffers, x: torch.Tensor, r: torch.Tensor | None, site: int) -> None:
    if not b.active[site]:
        return
    n = x.shape[0]
    slots = b.row_slot[:n, site]
    rows = torch.nonzero(slots >= 0).flatten()
    if rows.numel():
        idx = slots[rows].long()
        mode = b.slot_mode[idx].unsqueeze(1)
        xs = x[rows]
        s = xs.float() if r is None else xs.float() + r[rows].float()
        a = b.slot_a[idx].unsqueeze(1)
        adim = b.slot_adim[idx]
        if bool((adim >= 0).any()):
            a = torch.where((adim >= 0).unsqueeze(1), b.dim_a[adim.clamp(min=0).long()], a)
        c = b.slot_c[idx]
        new = _clamped(b, _gated(b, torch.where(a == 0, c, a * s + c), s, idx, rows), idx)
        pair = mode == SlotMode.PAIR
        if r is None:
            x.index_copy_(0, rows, torch.where(pair, b.slot_px[idx], new.to(x.dtype)))
        else:
            r_gen = new.to(r.dtype)
            x_gen = (new - r_gen.float()).to(x.dtype)
            x.index_copy_(0, rows, torch.where(pair, b.slot_px[idx], x_gen))
            r.index_copy_(0, rows, torch.where(pair, b.slot_pr[idx], r_gen))
    dst = b.cap_dst[:n, site]
    crow = torch.nonzero(dst >= 0).flatten()
    if crow.numel():
        to = dst[crow].long()
        b.cap_x.index_copy_(0, to, x[crow])
        b.cap_r.index_copy_(0, to, torch.zeros_like(x[crow]) if r is None else r[crow])


# ---- CUDA implementation -------------------------------------------------------------------------
_KERNEL = None


def _triton_kernels():
    """(one site's kernel, the merged kernel of `sites_op`) from `site_kernels` (imported on
    first use: Triton is needed only on CUDA)."""
    global _KERNEL
    if _KERNEL is None:
        from engine_ext.worker import site_kernels

        _KERNEL = (site_kernels.site_kernel, site_kernels.sites_kernel)
    return _KERNEL


def _apply_triton(b: SiteBuffers, x: torch.Tensor, r: torch.Tensor | None, site: int) -> None:
    n = x.shape[0]
    if n == 0:
        return
    import triton

    if x.stride(-1) != 1 or (r is not None and r.stride(-1) != 1):
        _apply_torch_cuda(b, x, r, site)
        return
    kernel = _triton_kernels()[0]
    block = triton.next_power_of_2(b.hidden)
    kernel[(n,)](x, r if r is not None else x, *b.tensors(), site, b.num_sites, b.hidden, x.stride(0),
                 r.stride(0) if r is not None else 0, HAS_R=r is not None, BLOCK=block, PAIR=int(SlotMode.PAIR),
                 KC=b.max_clamp_dirs,
                 num_warps=4 if block <= 2048 else 8, enable_fp_fusion=False)


def _apply_sites_triton(b: SiteBuffers, x: torch.Tensor, r: torch.Tensor, site_b: int, site_p: int, site_n: int) -> None:
    n = x.shape[0]
    if n == 0:
        return
    import triton

    if x.stride(-1) != 1 or r.stride(-1) != 1:
        _apply_sites_in_turn(b, x, r, site_b, site_p, site_n)
        return
    block = triton.next_power_of_2(b.hidden)
    _triton_kernels()[1][(n,)](x, r, *b.tensors(), site_b, site_p, max(site_n, 0), b.num_sites, b.hidden, x.stride(0),
                               r.stride(0), HAS_N=site_n >= 0, BLOCK=block, PAIR=int(SlotMode.PAIR),
                               KC=b.max_clamp_dirs, num_warps=4 if block <= 2048 else 8, enable_fp_fusion=False)


def _apply_sites_in_turn(b: SiteBuffers, x: torch.Tensor, r: torch.Tensor, site_b: int, site_p: int, site_n: int) -> None:
    """`sites_op` as three site calls (what the merged kernel must equal)."""
    _apply(b, x, None, site_b)
    _apply(b, x, r, site_p)
    if site_n >= 0:
        _apply(b, x, r, site_n)


def _apply_torch_cuda(b: SiteBuffers, x: torch.Tensor, r: torch.Tensor | None, site: int) -> None:
    """Branch-free torch version for CUDA tensors with an unusual layout (graph-safe, slower)."""
    n = x.shape[0]
    slot = b.row_slot[:n, site]
    idx = slot.clamp(min=0).long()
    mode = torch.where(slot >= 0, b.slot_mode[idx], torch.zeros_like(slot)).unsqueeze(1)
    s = x.float() if r is None else x.float() + r.float()
    a = b.slot_a[idx].unsqueeze(1)
    adim = b.slot_adim[idx]
    a = torch.where((adim >= 0).unsqueeze(1), b.dim_a[adim.clamp(min=0).long()], a)
    c = b.slot_c[idx]
    new = torch.where(a == 0, c, a * s + c)
    gq = torch.where((slot >= 0) & (mode.squeeze(1) == SlotMode.AFFINE), b.slot_gate[idx], torch.full_like(slot, -1))
    gidx = gq.clamp(min=0).long()
    score, g = gate_values(s, b.gate_probe[gidx], b.gate_params[gidx])
    gated = (gq >= 0).unsqueeze(1)
    new = torch.where(gated, new + (g - 1.0).unsqueeze(1) * b.gate_term[gidx], new)
    b.gate_out[:n].copy_(torch.where(gated, torch.stack([score, g], dim=1), b.gate_out[:n]))
    cl = torch.where(slot >= 0, b.slot_clamp[idx], torch.full_like(slot, -1))
    crow = cl.clamp(min=0).long()
    corr = clamp_correction(new, b.clamp_dir[crow], b.clamp_lo[crow], b.clamp_hi[crow], b.clamp_st[crow])
    new = torch.where((cl >= 0).unsqueeze(1), new + corr, new)
    pair, affine = mode == SlotMode.PAIR, mode == SlotMode.AFFINE
    if r is None:
        x.copy_(torch.where(pair, b.slot_px[idx], torch.where(affine, new.to(x.dtype), x)))
        r_new = torch.zeros_like(x)
    else:
        r_gen = new.to(r.dtype)
        x_gen = (new - r_gen.float()).to(x.dtype)
        x.copy_(torch.where(pair, b.slot_px[idx], torch.where(affine, x_gen, x)))
        r.copy_(torch.where(pair, b.slot_pr[idx], torch.where(affine, r_gen, r)))
        r_new = r
    dst = b.cap_dst[:n, site].long()
    keep = (dst >= 0).unsqueeze(1)
    to = dst.clamp(min=0)
    b.cap_x.index_put_((to,), torch.where(keep, x, b.cap_x[to]))
    b.cap_r.index_put_((to,), torch.where(keep, r_new, b.cap_r[to]))


def _apply(b: SiteBuffers, x: torch.Tensor, r: torch.Tensor | None, site: int) -> None:
    if b.use_triton:
        _apply_triton(b, x, r, site)
    else:
        _apply_torch(b, x, r, site)


def site_op(x: torch.Tensor, r: torch.Tensor, state_id: int, site: int) -> None:
    """Intervene/capture at `site` on the (x, r) pair, in place."""
    b = BUFFERS.get(state_id)
    if b is not None:
        _apply(b, x, r, site)


def sites_op(x: torch.Tensor, r: torch.Tensor, state_id: int, site_b: int, site_p: int, site_n: int) -> None:
    """Three sites at one point of the stream, in one call (one kernel launch on CUDA): the MLP
    branch's site `site_b` on x alone (`mlp_out`), then the pair site `site_p` on (x, r)
    (`post_block`), then, unless `site_n` is -1, the pair site `site_n` (the next layer's
    `pre_attn`, the same point of the stream) — exactly what the three calls in turn do."""
    b = BUFFERS.get(state_id)
    if b is None:
        return
    if b.use_triton:
        _apply_sites_triton(b, x, r, site_b, site_p, site_n)
    else:
        _apply_sites_in_turn(b, x, r, site_b, site_p, site_n)


def sites_op_fake(x: torch.Tensor, r: torch.Tensor, state_id: int, site_b: int, site_p: int, site_n: int) -> None:
    return None


def embed_site_op(x: torch.Tensor, state_id: int, site: int) -> None:
    """Same, on a single tensor: layer 0's `pre_attn` (the embeddings, no residual yet) and the
    MLP-branch sites `mlp_in` / `mlp_out`."""
    b = BUFFERS.get(state_id)
    if b is not None:
        _apply(b, x, None, site)


def site_op_fake(x: torch.Tensor, r: torch.Tensor, state_id: int, site: int) -> None:
    return None


def embed_site_op_fake(x: torch.Tensor, state_id: int, site: int) -> None:
    return None
