"""`SlotTable`: the persistent, reference-counted table of intervention values on the device.

A slot holds one composed value that rows can point at (`row_slot[row, site] = slot`): an
`AFFINE` edit `new = a * s + c` or a stored `PAIR` written back as is (see `intervention_op`).
A dimension-masked patch has a per-dimension `a`: it lives in a second, smaller content-addressed
table (`dim_a` rows, shared by every slot with the same `a` vector — a sweep's cells all share
one), referenced by the slot and released with it. A slot's directional clamps live the same way
in a third table (`clamp_dir` / `clamp_lo` / `clamp_hi` / `clamp_st` rows, content-addressed by
`clamp_key`), and its row gate (the fork's `this_token` probe gate) in a fourth (`gate_probe` /
`gate_params` / `gate_term` rows, content-addressed by `gate_key`).
Slots are content-addressed: requests that need the same value (the same steering vector at the
same scale, say) share one slot, uploaded once. A request holds references to its slots from
registration until it finishes; a slot whose last reference is released is free for reuse.

Uploads are batched per step (`flush`) and never block the host: values are staged in pinned
memory and copied with `non_blocking=True`, ordered on the current stream before the forward that
reads them.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine_ext.worker.intervention_op import SiteBuffers, SlotMode
from engine_ext.worker.source_store import StoredPair


@dataclass(slots=True, eq=False)
class SlotValue:
    """What one slot does: `AFFINE` with `a` and `c` (fp32 vector; None = zeros), or `PAIR` with
    a stored (x, r) pair (model dtype) written back as is. `a_vec` (fp32 vector, with its content
    key `a_key`) replaces the scalar `a` per dimension. Never changed once made (slots share it by
    content; `dataclasses.replace` for a variant). Not frozen: a frozen dataclass's constructor
    costs ~1.5 µs more, once per new slot (a sweep makes one per cell)."""

    mode: SlotMode
    a: float = 1.0
    c: np.ndarray | None = None
    pair: StoredPair | None = None
    a_vec: np.ndarray | None = None
    a_key: Hashable = None
    #: directional clamps applied after the affine edit: unit directions [k, H] (fp32), bounds and
    #: strengths [k] (fp32; +-inf when open), with their content key
    clamp_dirs: np.ndarray | None = None
    clamp_lo: np.ndarray | None = None
    clamp_hi: np.ndarray | None = None
    clamp_st: np.ndarray | None = None
    clamp_key: Hashable = None
    #: row gate (see `intervention_op`): probe direction [H], threshold, sharpness and the gated
    #: term [H] (fp32), with their content key
    gate_probe: np.ndarray | None = None
    gate_threshold: float = 0.0
    gate_sharpness: float = 1.0
    gate_term: np.ndarray | None = None
    gate_key: Hashable = None


class SlotCapacityError(RuntimeError):
    """Every slot is in use."""


class ClampCapacityError(SlotCapacityError):
    """More directional clamps at one (site, position) than the clamp table is wide."""


class SlotTable:
    def __init__(self, buffers: SiteBuffers):
        self.b = buffers
        self.capacity = buffers.max_slots
        self._by_key: dict[Hashable, int] = {}
        self._key_of: list[Hashable | None] = [None] * self.capacity
        self._value_of: list[SlotValue | None] = [None] * self.capacity
        self._refs = np.zeros(self.capacity, np.int64)
        self._free = list(range(self.capacity - 1, -1, -1))  # pop() hands out low ids first
        self._pending: list[tuple[int, SlotValue]] = []
        # per-dimension `a` rows and clamp rows: content-addressed, reference-counted by the slots
        # using them; pending: (row, what to upload) since the last flush
        self._dims = _RowPool(buffers.max_dim_rows, "per-dimension rows (distinct dimension masks x alpha in use)",
                              "max_dim_rows", "masks")
        self._dim_of_slot = np.full(self.capacity, -1, np.int64)
        self._clamps = _RowPool(buffers.max_clamp_rows, "clamp rows (distinct clamp sets in use)", "max_clamp_rows",
                                "clamps")
        self._cl_of_slot = np.full(self.capacity, -1, np.int64)
        self._gates = _RowPool(buffers.max_gate_rows, "gate rows (distinct per-token probe gates in use)",
                               "max_gate_rows", "gated requests")
        self._gate_of_slot = np.full(self.capacity, -1, np.int64)

    def __len__(self) -> int:
        return self.capacity - len(self._free)

    def acquire(self, key: Hashable, make) -> int:
        """The slot holding `key`'s value (one more reference); `make()` builds the value the
        first time. Raises SlotCapacityError when every slot is in use."""
        slot = self._by_key.get(key)
        if slot is None:
            if not self._free:
                raise SlotCapacityError(f"all {self.capacity} intervention slots are in use; raise max_slots "
                                        "or send fewer distinct intervention values at once")
            value = make()
            dim = self._dims.acquire(value.a_key, value.a_vec) if value.a_vec is not None else -1
            cl = -1
            if value.clamp_dirs is not None:
                k = value.clamp_dirs.shape[0]
                try:
                    if k > self.b.max_clamp_dirs:
                        raise ClampCapacityError(f"{k} directional clamps at one site and position; at most "
                                                 f"{self.b.max_clamp_dirs} (max_clamp_directions)")
                    cl = self._clamps.acquire(value.clamp_key, value)
                except SlotCapacityError:
                    self._dims.release(dim)
                    raise
            gq = -1
            if value.gate_key is not None:
                try:
                    gq = self._gates.acquire(value.gate_key, value)
                except SlotCapacityError:
                    self._dims.release(dim)
                    self._clamps.release(cl)
                    raise
            slot = self._free.pop()
            self._by_key[key] = slot
            self._key_of[slot] = key
            self._dim_of_slot[slot] = dim
            self._cl_of_slot[slot] = cl
            self._gate_of_slot[slot] = gq
            self._value_of[slot] = value
            self._pending.append((slot, value))
        self._refs[slot] += 1
        return slot

    def release(self, slots) -> None:
        for slot in slots:
            self._refs[slot] -= 1
            if self._refs[slot] == 0:
                del self._by_key[self._key_of[slot]]
                self._key_of[slot] = None
                self._value_of[slot] = None
                self._free.append(slot)
                self._dims.release(int(self._dim_of_slot[slot]))
                self._dim_of_slot[slot] = -1
                self._clamps.release(int(self._cl_of_slot[slot]))
                self._cl_of_slot[slot] = -1
                self._gates.release(int(self._gate_of_slot[slot]))
                self._gate_of_slot[slot] = -1

    def scaled_rows(self, slots: list[int], vecs: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """For `rewrite_scaled`: the slots' indices and their vectors (`vecs[i]` for `slots[i]`,
        fp32) on the device, uploaded once."""
        b = self.b
        return (to_device_async(torch.tensor(slots, dtype=torch.long), b.device),
                to_device_async(torch.from_numpy(np.ascontiguousarray(vecs, np.float32)), b.device))

    def rewrite_scaled(self, rows: tuple[torch.Tensor, torch.Tensor], s32: np.ndarray) -> None:
        """Give AFFINE slots new `c` rows, `vecs[i] * s32[i]` for `rows = scaled_rows(slots, vecs)`,
        computed on the device on the current stream (before the forward that reads them): one
        correctly rounded fp32 multiply per element, bit-equal to the host's
        `np.multiply(vec, np.float32(s), dtype=np.float32)`; only `s32` (4 bytes a slot) is
        uploaded. Only for slots their one holder acquired under a key of its own, never shared
        and already uploaded (dynamic steering's proportional windows during a chain of repeated
        steps: `repeat_steps.RepeatedSteps._replay_proportional`): nobody else reads them, so their
        key and their host value (`value_of`) keep naming the first value."""
        idx, vecs = rows
        s = to_device_async(torch.from_numpy(np.ascontiguousarray(s32, np.float32)), self.b.device)
        self.b.slot_c.index_copy_(0, idx, vecs * s[:, None])

    def key_of(self, slot: int) -> Hashable | None:
        """The content key a slot in use holds (None for a free slot)."""
        return self._key_of[slot]

    def value_of(self, slot: int) -> SlotValue | None:
        """The value a slot in use holds (to compose another value on top of it)."""
        return self._value_of[slot]

    def flush(self) -> None:
        """Copy this step's new slot values to the device (before the forward reads them)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        b = self.b
        n = len(pending)
        slots = np.fromiter((s for s, _ in pending), np.int64, n)
        # every per-slot scalar in one int32 table, one upload: slot, mode, dim row, clamp row,
        # gate row, and the bits of `a` (an fp32 copied, never cast)
        meta = np.empty((6, n), np.int32)
        meta[0] = slots
        meta[1] = np.fromiter((int(v.mode) for _, v in pending), np.int32, n)
        meta[2] = self._dim_of_slot[slots]
        meta[3] = self._cl_of_slot[slots]
        meta[4] = self._gate_of_slot[slots]
        meta[5] = np.fromiter((v.a for _, v in pending), np.float32, n).view(np.int32)
        dev = to_device_async(torch.from_numpy(meta), b.device)
        idx = dev[0].long()
        b.slot_mode.index_copy_(0, idx, dev[1])
        b.slot_adim.index_copy_(0, idx, dev[2])
        b.slot_clamp.index_copy_(0, idx, dev[3])
        b.slot_gate.index_copy_(0, idx, dev[4])
        b.slot_a.index_copy_(0, idx, dev[5].view(torch.float32))
        if self._gates.pending:
            gts, self._gates.pending = self._gates.pending, []
            probe = np.stack([np.asarray(v.gate_probe, np.float32) for _, v in gts])
            params = np.array([[v.gate_threshold, v.gate_sharpness] for _, v in gts], np.float32)
            term = np.stack([np.asarray(v.gate_term, np.float32) for _, v in gts])
            gidx = to_device_async(torch.tensor([q for q, _ in gts], dtype=torch.long, device="cpu"), b.device)
            b.gate_probe.index_copy_(0, gidx, to_device_async(torch.from_numpy(probe), b.device))
            b.gate_params.index_copy_(0, gidx, to_device_async(torch.from_numpy(params), b.device))
            b.gate_term.index_copy_(0, gidx, to_device_async(torch.from_numpy(term), b.device))
        if self._clamps.pending:
            cls_, self._clamps.pending = self._clamps.pending, []
            K = b.max_clamp_dirs
            dirs = np.zeros((len(cls_), K, b.hidden), np.float32)
            lo = np.full((len(cls_), K), -np.inf, np.float32)
            hi = np.full((len(cls_), K), np.inf, np.float32)
            st = np.ones((len(cls_), K), np.float32)
            for i, (_, v) in enumerate(cls_):
                k = v.clamp_dirs.shape[0]
                dirs[i, :k], lo[i, :k], hi[i, :k], st[i, :k] = v.clamp_dirs, v.clamp_lo, v.clamp_hi, v.clamp_st
            cidx = to_device_async(torch.tensor([r for r, _ in cls_], dtype=torch.long, device="cpu"), b.device)
            b.clamp_dir.index_copy_(0, cidx, to_device_async(torch.from_numpy(dirs), b.device))
            b.clamp_lo.index_copy_(0, cidx, to_device_async(torch.from_numpy(lo), b.device))
            b.clamp_hi.index_copy_(0, cidx, to_device_async(torch.from_numpy(hi), b.device))
            b.clamp_st.index_copy_(0, cidx, to_device_async(torch.from_numpy(st), b.device))
        if self._dims.pending:
            dims, self._dims.pending = self._dims.pending, []
            didx = to_device_async(torch.tensor([d for d, _ in dims], dtype=torch.long, device="cpu"), b.device)
            rows = np.stack([np.asarray(v, np.float32) for _, v in dims])
            b.dim_a.index_copy_(0, didx, to_device_async(torch.from_numpy(rows), b.device))
        affine = [(s, v) for s, v in pending if v.mode == SlotMode.AFFINE]  # PAIR slots never read c
        if affine:
            c = np.zeros((len(affine), b.hidden), np.float32)
            for i, (_, v) in enumerate(affine):
                if v.c is not None:
                    c[i] = v.c
            cidx = to_device_async(torch.tensor([s for s, _ in affine], dtype=torch.long, device="cpu"), b.device)
            b.slot_c.index_copy_(0, cidx, to_device_async(torch.from_numpy(c), b.device))
        by_run: dict[int, tuple[Any, list[int], list[int]]] = {}
        for (slot, v) in pending:
            if v.pair is not None:
                run, to, rows = by_run.setdefault(id(v.pair.run), (v.pair.run, [], []))
                to.append(slot)
                rows.append(v.pair.row)
        for run, to, rows in by_run.values():  # one gather per stored run, on the device
            x, r = run.on(b.device)
            at = to_device_async(torch.from_numpy(np.array([rows, to], np.int64)), b.device)  # [source rows; slots]
            b.slot_px.index_copy_(0, at[1], x.index_select(0, at[0]).to(b.dtype))
            b.slot_pr.index_copy_(0, at[1], r.index_select(0, at[0]).to(b.dtype))


def to_device_async(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without blocking the host (pinned staging for CUDA)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class _RowPool:
    """Content-addressed, reference-counted rows of a device table (the per-dimension `a` rows,
    the clamp rows): `acquire(key, payload)` gives the row holding `key` (a new one gets `payload`
    queued in `pending` for the next upload), `release(row)` drops one reference (-1: none)."""

    def __init__(self, capacity: int, what: str, knob: str, fewer: str):
        self.capacity = capacity
        self.by_key: dict[Hashable, int] = {}
        self.key_of: list[Hashable | None] = [None] * capacity
        self.refs = np.zeros(capacity, np.int64)
        self.free = list(range(capacity - 1, -1, -1))  # pop() hands out low rows first
        self.pending: list[tuple[int, Any]] = []
        self._full = f"all {capacity} {what} are taken; raise {knob} or use fewer distinct {fewer} at once"

    def acquire(self, key: Hashable, payload: Any) -> int:
        row = self.by_key.get(key, -1)
        if row < 0:
            if not self.free:
                raise SlotCapacityError(self._full)
            row = self.free.pop()
            self.by_key[key] = row
            self.key_of[row] = key
            self.pending.append((row, payload))
        self.refs[row] += 1
        return row

    def release(self, row: int) -> None:
        if row >= 0:
            self.refs[row] -= 1
            if self.refs[row] == 0:
                del self.by_key[self.key_of[row]]
                self.key_of[row] = None
                self.free.append(row)
