"""Everything one engine keeps inside its worker: registered request programs, global steering,
named vectors, the source store, captures in progress, the checksum — and the per-step planner
that turns them into the contents of the op's persistent buffers (`SiteBuffers`).

Per step (called from the seam's runner wrappers):
1. `register_new` / `finish` — from the scheduler output (requests carry their wire program in
   `SamplingParams.extra_args`);
2. `plan_step(RowPlan)` — host-side: per row and site, compose the interventions into a slot
   (`new = a*s + c`, or a stored pair), assign capture rows; upload to the device;
3. `after_forward()` — copy captured rows back to the host, into each request's captures.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engine_ext.worker.checksum import ActionChecksum, vector_digest
from engine_ext.worker.intervention_op import BUFFERS, SiteBuffers
from engine_ext.program import EXTRA_ARGS_KEY, AddOp, WorkerProgram
from engine_ext.worker.row_plan import RowPlan
from engine_ext.worker.source_store import SourceStore, SourceStoreFull
from engine_ext.sites import SITES_PER_LAYER

logger = logging.getLogger("causalboard.worker")


@dataclass
class WorkerConfig:
    max_slots: int = 4096
    max_capture_rows: int = 8192
    source_store_bytes: int = 256 * 1024 * 1024


@dataclass
class RequestState:
    req_id: str
    program: WorkerProgram
    #: (site, position) -> (x, r) captured pair (host, model dtype)
    captures: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    leased: list[str] = field(default_factory=list)
    collected: bool = False
    #: composed slot values that do not depend on the position, reused across steps
    slot_cache: dict[tuple, tuple] = field(default_factory=dict)


class WorkerState:
    """One engine's worker-side state (one per model instance in the process)."""

    _next_id = 1

    def __init__(self, num_layers: int, hidden: int, max_rows: int, device: torch.device, dtype: torch.dtype,
                 config: WorkerConfig):
        self.state_id = WorkerState._next_id
        WorkerState._next_id += 1
        self.num_layers, self.hidden, self.device, self.dtype = num_layers, hidden, device, dtype
        self.num_sites = num_layers * SITES_PER_LAYER
        self.config = config
        self.buffers = SiteBuffers(self.num_sites, max_rows, config.max_slots, config.max_capture_rows,
                                   hidden, device, dtype)
        BUFFERS[self.state_id] = self.buffers
        self.store = SourceStore(config.source_store_bytes)
        self.checksum = ActionChecksum()
        self.requests: dict[str, RequestState] = {}   # by vLLM (internal) request id
        self.prompt_lens: dict[str, int] = {}          # every scheduled request's prompt length
        self.by_key: dict[str, RequestState] = {}
        self.results: dict[str, dict] = {}            # finished-and-collected results waiting, by key
        self.global_adds: list[AddOp] = []
        self._global_cache: dict[tuple, tuple] = {}
        self.named: dict[str, np.ndarray] = {}
        self.embedding_std: float | None = None
        self.tp_rank = 0
        self.pp_rank = 0
        self._host_slot = np.full((self.num_sites, max_rows), -1, np.int32)
        self._host_cap = np.full((self.num_sites, max_rows), self.buffers.trash_row, np.int64)
        self._dirty_sites: set[int] = set()
        self._dirty_cap_sites: set[int] = set()
        self._dirty_rows = 0
        self._cap_meta: list[tuple[RequestState, int, int]] = []
        self.steps = 0
        self.applied_steps = 0

    # ---- registration ---------------------------------------------------------------------
    def register(self, req_id: str, extra_args: dict | None) -> None:
        """Register a request's program (idempotent: a resumed request keeps its state)."""
        if req_id in self.requests or not extra_args or EXTRA_ARGS_KEY not in extra_args:
            return
        data = json.loads(extra_args[EXTRA_ARGS_KEY])
        prog = WorkerProgram.parse(
            data,
            named_vector=self.named.get,
            source_value=self.store.value,
            source_mean=lambda run, site: (m.numpy() if (m := self.store.mean(run, site)) is not None else None),
        )
        st = RequestState(req_id, prog)
        for run in prog.sources:
            if self.store.lease(run):
                st.leased.append(run)
        self.requests[req_id] = st
        self.by_key[prog.key] = st

    def finish(self, req_id: str) -> None:
        """The request left the engine (finished or aborted): drop its state and leases."""
        self.prompt_lens.pop(req_id, None)
        st = self.requests.pop(req_id, None)
        if st is None:
            return
        for run in st.leased:
            self.store.release(run)
        if self.by_key.get(st.program.key) is st:
            del self.by_key[st.program.key]
        if not st.collected:
            self.results[st.program.key] = self._result(st)
            if len(self.results) > 4096:  # nobody collected these; keep memory bounded
                for k in list(self.results)[: len(self.results) - 4096]:
                    del self.results[k]

    # ---- per step -------------------------------------------------------------------------
    def plan_step(self, plan: RowPlan) -> None:
        """Fill the op's buffers for this step's rows (all other rows: untouched)."""
        self.steps += 1
        self.checksum.begin_step()
        b = self.buffers
        hs, hc = self._host_slot, self._host_cap
        touched: set[int] = set()
        cap_touched: set[int] = set()
        slots: list[tuple[int, float, np.ndarray | None, Any]] = []  # (mode, a, c, pair)
        slot_of: dict[tuple, int] = {}
        self._cap_meta = []
        n_rows = plan.num_rows
        for w in plan.windows:
            st = self.requests.get(w.req_id)
            prog = st.program if st is not None else None
            if prog is not None and prog.voided:
                continue
            adds = (prog.adds if prog else []) + self.global_adds
            if not adds and (prog is None or (not prog.replaces and not prog.capture_sites)):
                continue
            n_prompt = prog.n_prompt if prog else (w.num_prompt if w.num_prompt >= 0 else 1 << 60)
            max_pos = prog.max_pos if prog else 1 << 60
            positions = w.positions
            key = prog.key if prog else w.req_id
            staged_slots: list[tuple[int, int, tuple, tuple]] = []  # (site, row, slot key, slot value)
            actions: list[tuple[str, int, list[int], str]] = []
            # -- steering / noise adds, grouped per site
            masks: dict[int, list[tuple[AddOp, np.ndarray]]] = {}
            for op in adds:
                m = op.mask(positions, n_prompt, max_pos)
                if m.any():
                    masks.setdefault(op.site, []).append((op, m))
                    actions.append((op.kind, op.site, positions[m].tolist(), _op_digest(op)))
            replace_sites = {s for s, _ in prog.replaces} if prog else set()
            cache = st.slot_cache if st is not None else self._global_cache
            for site in set(masks) | replace_sites:
                ops = masks.get(site, [])
                for j, pos in enumerate(positions.tolist()):
                    rep = prog.replaces.get((site, pos)) if prog else None
                    here = [op for op, m in ops if m[j]]
                    if rep is None and not here:
                        continue
                    skey = _slot_key(rep, here, pos, key)
                    if skey not in slot_of:
                        sval = cache.get(skey)
                        if sval is None:
                            sval = _slot_value(rep, here, pos)
                            if skey[2] is None:  # position-independent: reuse in later steps
                                cache[skey] = sval
                    else:
                        sval = None
                    staged_slots.append((site, w.row_start + j, skey, sval))
                    if rep is not None:
                        actions.append(("patch", site, [pos], _target_digest(rep)))
            # -- captures
            cap_rows: list[tuple[int, int, int]] = []
            if prog is not None and prog.capture_sites:
                pos_mask = np.array([prog.captures_at(p) for p in positions.tolist()], bool)
                if pos_mask.any():
                    cap_pos = positions[pos_mask]
                    rows = w.row_start + np.nonzero(pos_mask)[0]
                    for site in prog.capture_sites:
                        cap_rows.extend((site, int(r), int(p)) for r, p in zip(rows, cap_pos))
                        actions.append(("capture", site, cap_pos.tolist(), "-"))
            # -- capacity check, then commit this request's rows
            new_slots = {k for _, _, k, _ in staged_slots if k not in slot_of}
            if len(slots) + len(new_slots) > b.max_slots or len(self._cap_meta) + len(cap_rows) > b.max_capture_rows:
                if prog is not None:
                    prog.errors.append("intervention capacity of the step exceeded (slots or capture rows); "
                                       "raise max_slots / max_capture_rows or send fewer sites per request")
                continue
            for site, row, skey, sval in staged_slots:
                if skey not in slot_of:
                    slot_of[skey] = len(slots)
                    slots.append(sval)
                hs[site, row] = slot_of[skey]
                touched.add(site)
            for site, row, pos in cap_rows:
                hc[site, row] = len(self._cap_meta)
                self._cap_meta.append((st, site, pos))
                cap_touched.add(site)
            for kind, site, pos_list, digest in actions:
                self.checksum.fold(kind, key, site, pos_list, digest)
        self._upload(touched, cap_touched, slots, n_rows)
        if slots or self._cap_meta:
            self.applied_steps += 1

    def _upload(self, touched: set[int], cap_touched: set[int], slots: list, n_rows: int) -> None:
        b = self.buffers
        # copy this step's rows of every site touched now or last step (whose device rows must be
        # reset); the host copies hold -1 / trash beyond what this step wrote
        m = max(n_rows, self._dirty_rows)
        for site in touched | self._dirty_sites:
            b.row_slot[site, :m].copy_(torch.from_numpy(self._host_slot[site, :m]))
        for site in cap_touched | self._dirty_cap_sites:
            b.cap_dst[site, :m].copy_(torch.from_numpy(self._host_cap[site, :m]))
        for site in touched:
            self._host_slot[site, :n_rows].fill(-1)
        for site in cap_touched:
            self._host_cap[site, :n_rows].fill(b.trash_row)
        self._dirty_sites, self._dirty_cap_sites, self._dirty_rows = touched, cap_touched, n_rows
        if not slots:
            return
        k = len(slots)
        zeros = np.zeros(self.hidden, np.float32)
        b.slot_mode[:k].copy_(torch.tensor([s[0] for s in slots], dtype=torch.int32))
        b.slot_a[:k].copy_(torch.tensor([s[1] for s in slots], dtype=torch.float32))
        b.slot_c[:k].copy_(torch.from_numpy(np.stack([s[2] if s[2] is not None else zeros for s in slots])))
        pair_rows = [i for i, s in enumerate(slots) if s[0] == 2]
        if pair_rows:
            idx = torch.tensor(pair_rows, dtype=torch.long, device=b.device)
            b.slot_px.index_copy_(0, idx, torch.stack([slots[i][3][0] for i in pair_rows]).to(b.device, b.dtype))
            b.slot_pr.index_copy_(0, idx, torch.stack([slots[i][3][1] for i in pair_rows]).to(b.device, b.dtype))

    def after_forward(self) -> None:
        """Copy this step's captured rows to the host and file them under their requests."""
        if not self._cap_meta:
            return
        n = len(self._cap_meta)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        xs = self.buffers.cap_x[:n].to("cpu", copy=True)
        rs = self.buffers.cap_r[:n].to("cpu", copy=True)
        for i, (st, site, pos) in enumerate(self._cap_meta):
            if not st.collected:
                st.captures[(site, pos)] = (xs[i].clone(), rs[i].clone())
        self._cap_meta = []

    # ---- results --------------------------------------------------------------------------
    def _result(self, st: RequestState) -> dict:
        prog = st.program
        out: dict[str, Any] = {"key": prog.key, "status": "voided" if prog.voided else "ok",
                               "errors": list(prog.errors), "n_prompt": prog.n_prompt}
        if prog.capture_sites and not prog.voided and prog.keep_as:
            try:
                evicted = self.store.put(prog.keep_as, dict(st.captures))
                out["stored_as"] = prog.keep_as
                out["evicted"] = evicted
            except SourceStoreFull as exc:
                out["store_error"] = str(exc)
        if prog.capture_sites and prog.return_captures:
            out["captures"] = {f"{site}:{pos}": _pair_bytes(x, r) for (site, pos), (x, r) in sorted(st.captures.items())}
        return out

    def collect(self, keys: list[str]) -> dict[str, dict]:
        """Results of finished requests, by key (called by the client once per finished request).
        A request still registered (the worker has not seen its finish yet) is collected now."""
        out = {}
        for key in keys:
            if key in self.results:
                out[key] = self.results.pop(key)
            elif key in self.by_key:
                st = self.by_key[key]
                out[key] = self._result(st)
                st.collected = True
            else:
                out[key] = {"key": key, "status": "unknown", "errors": ["the worker has no record of this request"]}
        return out

    # ---- control plane ----------------------------------------------------------------------
    def set_global_steer(self, entries: list[dict]) -> int:
        """Replace the global steering set. Entries: {site, vec (fp32 bytes) | name, scale, phase,
        pos (list) , gen (bool)}."""
        adds = []
        for k, e in enumerate(entries):
            vec = np.frombuffer(e["vec"], dtype="<f4").copy() if e.get("vec") is not None else self.named.get(e["name"])
            if vec is None:
                raise KeyError(f"no registered vector named {e['name']!r}")
            adds.append(AddOp(k, "global", int(e["site"]), np.asarray(e.get("pos", []), np.int64),
                              bool(e.get("gen", True)), e.get("phase", "both"), vec, float(e["scale"]), name=e.get("name"),
                              every=bool(e.get("every", False))))
        self.global_adds = adds
        self._global_cache = {}
        for st in self.requests.values():
            st.slot_cache.clear()
        return len(adds)

    def status(self) -> dict:
        return {"tp_rank": self.tp_rank, "pp_rank": self.pp_rank, **self.checksum.status(),
                "registered_requests": len(self.requests), "global_steer_entries": len(self.global_adds),
                "named_vectors": sorted(self.named), "store": self.store.usage(), "steps": self.steps,
                "steps_with_interventions": self.applied_steps, "buffer_bytes": self.buffers.nbytes()}


def _op_identity(op: AddOp) -> Any:
    """Content identity of an add (vector bytes and scale), so that requests steering with the
    same vector share one slot. Per-position ops (noise) are keyed by object and position."""
    ident = getattr(op, "_identity", None)
    if ident is None:
        if op.per_pos is not None:
            ident = ("obj", id(op))
        else:
            h = hashlib.blake2b(np.ascontiguousarray(op.vec, dtype="<f4").tobytes(), digest_size=16)
            h.update(repr(float(op.scale)).encode())
            ident = ("vec", h.hexdigest())
        op._identity = ident
    return ident


def _op_digest(op: AddOp) -> str:
    d = getattr(op, "_digest", None)
    if d is None:
        if op.per_pos is not None:
            d = "per-pos:" + ",".join(vector_digest(op.per_pos[p]) for p in sorted(op.per_pos))
        else:
            d = f"{vector_digest(op.vec)}*{op.scale!r}"
        op._digest = d
    return d


def _target_digest(rep: tuple[float, Any]) -> str:
    alpha, t = rep
    if t is None:
        return f"zero@{alpha!r}"
    if isinstance(t, tuple):
        return f"pair:{vector_digest(t[0].float().numpy())}:{vector_digest(t[1].float().numpy())}@{alpha!r}"
    return f"{vector_digest(t)}@{alpha!r}"


def _slot_key(rep: tuple[float, Any] | None, adds: list[AddOp], pos: int, key: str) -> tuple:
    """Identity of the slot one row needs at one site: rows with the same key share a slot.
    The third element is None when the value does not depend on the position."""
    add_keys = tuple((op.kind, _op_identity(op), pos if op.per_pos is not None else None) for op in adds)
    if rep is not None:
        alpha, t = rep
        kind = "pair" if alpha == 1.0 and isinstance(t, tuple) and not adds else "rep"
        return ((kind, id(t), alpha), add_keys, (key, pos))
    per_row = any(k[2] is not None for k in add_keys)
    return ((), add_keys, (key, pos) if per_row else None)


def _slot_value(rep: tuple[float, Any] | None, adds: list[AddOp], pos: int) -> tuple:
    """(mode, a, c, pair) for one row at one site: patch (replace/lerp) first, then adds.
    Mode 2 writes a stored pair back as is (bit-exact replacement); mode 1 is new = a*s + c."""
    if rep is not None:
        alpha, t = rep
        if alpha == 1.0 and isinstance(t, tuple) and not adds:
            return (2, 0.0, None, t)
        tv = None if t is None else (t[0].float() + t[1].float()).numpy() if isinstance(t, tuple) else np.asarray(t, np.float32)
        a = float(np.float32(1.0 - alpha))
        c = None if tv is None else np.float32(alpha) * tv
    else:
        a, c = 1.0, None
    for op in adds:
        v = op.vector_at(pos)
        c = v.astype(np.float32) if c is None else c + v
    return (1, a, c, None)


def _pair_bytes(x: torch.Tensor, r: torch.Tensor) -> bytes:
    """fp32 stream value (x + r, as vLLM's fused add computes it) as little-endian bytes."""
    return (x.float() + r.float()).numpy().astype("<f4").tobytes()
