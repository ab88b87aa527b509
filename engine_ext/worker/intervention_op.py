"""The intervention op and the persistent buffers it reads (pure torch; registered by `seam`).

Every patched decoder layer calls the op at each of its three sites, in every step, in every
mode (eager, torch.compile, CUDA graphs). The op body is branch-free, fixed-shape tensor work on
persistent buffers, so a captured graph replays it correctly: only buffer *contents* change from
step to step (filled on the host by `StepPlanner`). A row with slot -1 is left bit-identical.

vLLM carries the residual stream as a pair (x, r) whose true value is `fp32(x) + fp32(r)`
(the add is deferred into the next fused add-norm). Per row, the slot's mode says what to do:

* mode 0 — untouched (both tensors unchanged);
* mode 1 — generic: `new = a * s + c` in fp32 (`a == 0` means `new = c` exactly), written back
  as `r = dt(new)`, `x = dt(new - r)` (two-term split: the next add recovers `new` to ~2^-16
  relative in bf16; exactly in fp32);
* mode 2 — pair: `x = px`, `r = pr` (a stored source run's own pair: replacement is bit-exact).

Captures copy the (post-intervention) pair of rows with a capture destination into
`cap_x` / `cap_r`; rows without one write to a trash row.
"""

from __future__ import annotations

import torch

#: buffers of each live engine in this process, by state id (an int the op receives)
BUFFERS: dict[int, "SiteBuffers"] = {}


class SiteBuffers:
    """Persistent per-engine buffers. Allocated once, before any graph capture; never resized."""

    def __init__(self, num_sites: int, max_rows: int, max_slots: int, max_capture_rows: int,
                 hidden: int, device: torch.device, dtype: torch.dtype):
        self.num_sites, self.max_rows, self.max_slots = num_sites, max_rows, max_slots
        self.max_capture_rows, self.hidden, self.device, self.dtype = max_capture_rows, hidden, device, dtype
        self.row_slot = torch.full((num_sites, max_rows), -1, dtype=torch.int32, device=device)
        self.slot_mode = torch.zeros(max_slots, dtype=torch.int32, device=device)
        self.slot_a = torch.ones(max_slots, dtype=torch.float32, device=device)
        self.slot_c = torch.zeros(max_slots, hidden, dtype=torch.float32, device=device)
        self.slot_px = torch.zeros(max_slots, hidden, dtype=dtype, device=device)
        self.slot_pr = torch.zeros(max_slots, hidden, dtype=dtype, device=device)
        self.trash_row = max_capture_rows
        self.cap_dst = torch.full((num_sites, max_rows), self.trash_row, dtype=torch.int64, device=device)
        self.cap_x = torch.zeros(max_capture_rows + 1, hidden, dtype=dtype, device=device)
        self.cap_r = torch.zeros(max_capture_rows + 1, hidden, dtype=dtype, device=device)

    def nbytes(self) -> int:
        ts = (self.row_slot, self.slot_mode, self.slot_a, self.slot_c, self.slot_px, self.slot_pr,
              self.cap_dst, self.cap_x, self.cap_r)
        return sum(t.numel() * t.element_size() for t in ts)


def _apply(b: SiteBuffers, x: torch.Tensor, r: torch.Tensor | None, site: int) -> None:
    n = x.shape[0]
    slot = b.row_slot[site, :n]
    idx = slot.clamp(min=0).long()
    mode = torch.where(slot >= 0, b.slot_mode[idx], torch.zeros_like(slot)).unsqueeze(1)
    s = x.float() if r is None else x.float() + r.float()
    a = b.slot_a[idx].unsqueeze(1)
    c = b.slot_c[idx]
    new = torch.where(a == 0, c, a * s + c)
    if r is None:
        x_new = torch.where(mode == 2, b.slot_px[idx], torch.where(mode == 1, new.to(x.dtype), x))
        x.copy_(x_new)
        dst = b.cap_dst[site, :n]
        b.cap_x.index_copy_(0, dst, x_new)
        b.cap_r.index_copy_(0, dst, torch.zeros_like(x_new))
        return
    r_gen = new.to(r.dtype)
    x_gen = (new - r_gen.float()).to(x.dtype)
    x_new = torch.where(mode == 2, b.slot_px[idx], torch.where(mode == 1, x_gen, x))
    r_new = torch.where(mode == 2, b.slot_pr[idx], torch.where(mode == 1, r_gen, r))
    x.copy_(x_new)
    r.copy_(r_new)
    dst = b.cap_dst[site, :n]
    b.cap_x.index_copy_(0, dst, x_new)
    b.cap_r.index_copy_(0, dst, r_new)


def site_op(x: torch.Tensor, r: torch.Tensor, state_id: int, site: int) -> None:
    """Intervene/capture at `site` on the (x, r) pair, in place."""
    b = BUFFERS.get(state_id)
    if b is not None:
        _apply(b, x, r, site)


def embed_site_op(x: torch.Tensor, state_id: int, site: int) -> None:
    """Same, for layer 0's `pre_attn` where the stream is the embeddings alone (no residual)."""
    b = BUFFERS.get(state_id)
    if b is not None:
        _apply(b, x, None, site)


def site_op_fake(x: torch.Tensor, r: torch.Tensor, state_id: int, site: int) -> None:
    return None


def embed_site_op_fake(x: torch.Tensor, state_id: int, site: int) -> None:
    return None
