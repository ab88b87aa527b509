"""Everything one engine keeps inside its worker: registered requests and their plans, global
steering, named vectors, the source store, captures in progress, the checksum and dynamic
steering (`dynamic`: `engine_ext.dynamic.worker.DynamicWorker`).

Per step (called from the seam's runner wrappers):
1. `on_schedule(scheduler_output)` — register the new requests (their wire program travels in
   `SamplingParams.extra_args`) and forget the finished ones;
2. `plan_step(req_ids, query_start_loc, num_computed)` — right before the forward: the planner
   fills the op's buffers for the rows of planned requests (`planner.StepPlanner`);
3. `after_forward()` — score dynamic steering's monitored rows, and start copying captured rows
   (and those scores) to the host.

Results (status, errors, captures, stored runs) wait, by request key, until the client collects
them (`collect`); a finished request whose captured rows are still being copied gets its captures
once they are filed (`_complete_finished`). With a capture ring (`enable_ring`), captured values
go to the client as slices of shared memory, acknowledged with its next `collect`. `close()` frees
the device buffers and the ring (called when the engine shuts down).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engine_ext.capture_ring import CaptureRing, auto_size
from engine_ext.dynamic.worker import DYNAMIC_ARGS_KEY, DynamicWorker
from engine_ext.program import EXTRA_ARGS_KEY, AddOp, ClampOp, ProgramCache, WorkerProgram, clamp_op
from engine_ext.sites import SITES_PER_LAYER
from engine_ext.worker import cuda_streams
from engine_ext.worker.checksum import ActionChecksum
from engine_ext.worker.intervention_op import BUFFERS, SiteBuffers
from engine_ext.worker.planner import RequestPlan, StepCaptures, StepPlanner
from engine_ext.worker.slots import SlotCapacityError, SlotTable
from engine_ext.worker.source_store import RunRows, RunValues, SourceStore, SourceStoreFull

logger = logging.getLogger("causalboard.worker")

#: finished results nobody collected are dropped beyond this many (memory bound)
MAX_UNCOLLECTED = 4096


@dataclass
class WorkerConfig:
    max_slots: int = 4096
    #: distinct per-dimension `a` vectors (dimension-masked patches: one per mask x alpha) in use at once
    max_dim_rows: int = 256
    #: captured (site, position) rows one step can hold; None: as many as `capture_buffer_bytes`
    #: holds (two rows of `hidden` values in the model dtype each), at most MAX_CAPTURE_ROWS
    max_capture_rows: int | None = None
    capture_buffer_bytes: int = 256 * 1024 * 1024
    source_store_bytes: int = 256 * 1024 * 1024
    #: CPU: make every linear layer row-invariant where this host's GEMM is not (`cpu_gemm.py`)
    cpu_row_invariant: bool = False
    #: directional clamps acting at one (site, position) (K) and distinct clamp sets in use at once
    max_clamp_directions: int = 4
    max_clamp_rows: int = 256
    #: distinct row gates (the fork's `this_token` probe gates: one per gated request) in use at once
    max_gate_rows: int = 256

    def capture_rows(self, hidden: int, dtype: torch.dtype) -> int:
        if self.max_capture_rows is not None:
            return int(self.max_capture_rows)
        per_row = 2 * hidden * torch.empty((), dtype=dtype, device="cpu").element_size()
        return max(1024, min(MAX_CAPTURE_ROWS, self.capture_buffer_bytes // per_row))


#: upper bound of the derived capture capacity (rows per step)
MAX_CAPTURE_ROWS = 65536


@dataclass
class CapturedBlock:
    """One request's captured rows of one step: `xs` / `rs` [positions, sites, hidden] (host, model
    dtype; None unless a request of the step keeps its pairs) hold position `positions[i]` at site
    `sites[j]`; they are rows `[base, base + k)` of the step's `StepCaptures` (`step`), which holds
    their fp32 sums for every request of the step."""

    positions: np.ndarray
    sites: np.ndarray
    xs: torch.Tensor | None
    rs: torch.Tensor | None
    step: StepCaptures
    base: int

    def values(self) -> torch.Tensor:
        """fp32 `x + r`, [positions, sites, hidden]."""
        n, m = self.positions.size, self.sites.size
        vals = self.step.values(self.base, n * m)
        return vals.view(n, m, vals.shape[-1])


@dataclass
class RequestState:
    req_id: str
    program: WorkerProgram
    #: captured blocks, in the order they were computed; a later block for the same (site,
    #: position) wins (recomputed after preemption)
    captures: list[CapturedBlock] = field(default_factory=list)
    leased: list[str] = field(default_factory=list)
    collected: bool = False
    #: a segmented request's scores, as computed step by step: (positions, [k, ids] fp32 host
    #: tensor, the event its copy completes (None: done))
    scores: list[tuple[np.ndarray, torch.Tensor, Any]] = field(default_factory=list)

    def capture_pairs(self) -> RunValues:
        """(site, position) -> (x, r), the latest block winning; for one block of distinct sites
        and positions (a stored clean run: every site at every prompt position) its rows stacked
        at once (`RunRows`, one copy of each tensor, in the same (position, site) order), instead
        of a pair per key stacked again by the store (~20 ms for 16 positions x 48 sites on the
        2-core CPU, ~7 ms of a GPU host's engine step)."""
        if len(self.captures) == 1 and _distinct(self.captures[0].positions) and _distinct(self.captures[0].sites):
            blk = self.captures[0]
            sites, positions = blk.sites.tolist(), blk.positions.tolist()
            keys = [(site, pos) for pos in positions for site in sites]
            return RunRows(keys, blk.xs.flatten(0, 1).clone(), blk.rs.flatten(0, 1).clone())
        out: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        for blk in self.captures:
            for i, pos in enumerate(blk.positions.tolist()):
                for j, site in enumerate(blk.sites.tolist()):
                    out[(site, pos)] = (blk.xs[i, j], blk.rs[i, j])
        return out

    def capture_values(self, ring: CaptureRing | None = None) -> dict:
        """The captured stream values for the client, in one block: `keys` [[site, position], ...]
        (sorted) and `data`, their fp32 values `x + r` (as vLLM's fused add computes them),
        little-endian, row after row (a `bytearray`: an in-process client reads it without a copy);
        with a `ring` that has room, written there instead and `ring` = [name, offset, nbytes]
        in place of `data` (`engine_ext.capture_ring`)."""
        layout = _block_layout(self.captures[0]) if len(self.captures) == 1 else None
        if layout is not None:
            # the common case (one block, sites and positions in order): keys in (site, position)
            # order are the block's rows transposed; one copy, no per-row work
            blk = self.captures[0]
            keys, sites, positions = layout
            step = blk.step
            if ring is not None and step.ring is ring and (len(positions) == 1 or len(sites) == 1):
                # the block's rows, in key order, already in the ring: handed over as a slice
                # (its bounds from the sizes alone: no tensor made per request)
                cols = step.width
                return {"keys": keys, "ring": ring.share(step.region, 4 * blk.base * cols, 4 * len(keys) * cols)}
            vals = blk.values()
            if len(positions) > 1:
                vals = vals.transpose(0, 1)
            return {"keys": keys, **_block_data(vals, ring)}
        latest: dict[tuple[int, int], tuple[int, int, int]] = {}
        for b, blk in enumerate(self.captures):
            for i, pos in enumerate(blk.positions.tolist()):
                for j, site in enumerate(blk.sites.tolist()):
                    latest[(site, pos)] = (b, i, j)
        keys = sorted(latest)
        if not keys:
            return {"keys": [], "data": bytearray()}
        per_block = [blk.values() for blk in self.captures]
        vals = torch.stack([per_block[b][i, j] for b, i, j in (latest[k] for k in keys)])
        return {"keys": [list(k) for k in keys], **_block_data(vals, ring)}


#: `_block_layout` of the site and position tables that capture-only plans share (read-only
#: arrays that own their data, `RequestPlan._capture_only`), by identity; each entry holds the
#: arrays themselves, so their ids cannot be reused while it is cached
_LAYOUTS: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, tuple | None]] = {}


def _block_layout(blk: CapturedBlock) -> tuple[list, list[int], list[int]] | None:
    """(keys, sites, positions) of a block whose sites and positions both increase (keys in
    (site, position) order, as `capture_values` sends them; lists the caller must not modify),
    else None. Computed once per pair of shared read-only tables."""
    sites, positions = blk.sites, blk.positions
    # read-only arrays that own their data: nothing can change them (views are not cached)
    shared = (not sites.flags.writeable and not positions.flags.writeable
              and sites.base is None and positions.base is None)
    if shared:
        hit = _LAYOUTS.get((id(sites), id(positions)))
        if hit is not None and hit[0] is sites and hit[1] is positions:
            return hit[2]
    layout = None
    if _increasing(sites) and _increasing(positions):
        s, p = sites.tolist(), positions.tolist()
        layout = ([[site, pos] for site in s for pos in p], s, p)
    if shared:
        if len(_LAYOUTS) >= 256:
            _LAYOUTS.clear()
        _LAYOUTS[(id(sites), id(positions))] = (sites, positions, layout)
    return layout


def _distinct(a: np.ndarray) -> bool:
    return a.size < 2 or np.unique(a).size == a.size


def _increasing(a: np.ndarray) -> bool:
    return a.size < 2 or bool((a[1:] > a[:-1]).all())


def _block_data(vals: torch.Tensor, ring: CaptureRing | None) -> dict:
    """`{"data": bytes}` or, where the ring has room, `{"ring": [name, offset, nbytes]}`."""
    if ring is not None:
        n = 4 * vals.numel()
        off = ring.alloc(n)
        if off is not None:
            dst = np.frombuffer(ring.buffer(off, n), dtype="<f4").reshape(vals.shape)
            np.copyto(dst, vals.numpy())
            desc = ring.share(off, 0, n)
            ring.deref(off)  # the slice's reference is the only one
            return {"ring": desc}
    return {"data": _le_bytes(vals)}


def _le_bytes(vals: torch.Tensor) -> bytearray:
    """The values as little-endian fp32 bytes, row after row (one copy, strided or not)."""
    arr = vals.numpy()
    if arr.flags.c_contiguous and arr.dtype == np.dtype("<f4"):
        return bytearray(memoryview(arr).cast("B"))
    out = bytearray(4 * arr.size)
    np.copyto(np.frombuffer(out, dtype="<f4").reshape(arr.shape), arr)
    return out


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
        self.buffers = SiteBuffers(self.num_sites, max_rows, config.max_slots, config.capture_rows(hidden, dtype),
                                   hidden, device, dtype, max_dim_rows=config.max_dim_rows,
                                   max_clamp_rows=config.max_clamp_rows, max_clamp_dirs=config.max_clamp_directions,
                                   max_gate_rows=config.max_gate_rows)
        BUFFERS[self.state_id] = self.buffers
        self.slots = SlotTable(self.buffers)
        self.checksum = ActionChecksum()
        self.planner = StepPlanner(self.buffers, self.slots, self.checksum, self._file_capture)
        self.store = SourceStore(config.source_store_bytes)
        self.requests: dict[str, RequestState] = {}   # by vLLM (internal) request id
        self.plans: dict[str, RequestPlan] = {}       # by vLLM request id: what the planner applies
        self.prompt_lens: dict[str, int] = {}         # every scheduled request's prompt length
        self.by_key: dict[str, RequestState] = {}
        self.results: dict[str, dict] = {}            # finished-and-collected results waiting, by key
        #: finished requests whose result waits for capture copies still in flight, by vLLM
        #: request id: (state, its result so far); completed by `_complete_finished`
        self._finishing: dict[str, tuple[RequestState, dict]] = {}
        #: shared memory for captured values handed to a client in another process (`enable_ring`)
        self.ring: CaptureRing | None = None
        self.global_adds: list[AddOp] = []
        self.global_clamps: list[ClampOp] = []
        self.global_version = 0
        self._recompose = False
        self.named: dict[str, np.ndarray] = {}
        self.embedding_std: float | None = None
        self.tp_rank = 0
        self.pp_rank = 0
        #: decoder layers built on this worker (all of them, or one pipeline stage's)
        self.own_layers: set[int] = set()
        #: CPU engines: how many linear layers got each row-invariant form (`cpu_gemm.py`: native,
        #: chunked, per_row); empty where the engine does not ask for batch invariance
        self.cpu_gemm: dict[str, int] = {}
        #: programs parsed once for every request of one template (`program.ProgramCache`)
        self.programs = ProgramCache()
        #: dynamic steering: probes, per-request policy states, conversation latches
        self.dynamic = DynamicWorker(self)
        #: may the seam leave a step with dynamic steering open until right before its forward
        #: (`plan_step(defer=True)`, vLLM's V2 runner)? A benchmarking switch (`cb_set_defer_plan`)
        self.defer_plan = True
        self._value_bytes = 2 * hidden * torch.empty((), dtype=dtype, device="cpu").element_size()
        #: segmented requests (`engine_ext.worker.segments`) by vLLM request id: (S, score positions,
        #: entry layer: `WorkerProgram.entry_layer`)
        self.segmented: dict[str, tuple[int, np.ndarray, int]] = {}
        #: steps that entered the forward above layer 0 (`segments.step_entry`) and the rows x
        #: layers they did not compute
        self.entered_steps = 0
        self.layers_skipped = 0
        #: the step's rows to score after its forward: (request id, carrier positions, rows)
        self.step_scores: list[tuple[str, np.ndarray, np.ndarray]] = []

    def owns_site(self, site: int) -> bool:
        """Whether this worker computes `site` (its layer is on this worker's pipeline stage)."""
        return not self.own_layers or site // SITES_PER_LAYER in self.own_layers

    # ---- lifecycle ----------------------------------------------------------------------------
    def close(self) -> None:
        """Free the device buffers and forget everything (the engine is shutting down)."""
        BUFFERS.pop(self.state_id, None)
        self.requests.clear()
        self.plans.clear()
        self.by_key.clear()
        self.results.clear()
        self._finishing.clear()
        self.enable_ring(0)
        self.store = SourceStore(self.config.source_store_bytes)
        self.buffers = None  # type: ignore[assignment]

    # ---- registration ---------------------------------------------------------------------
    def on_schedule(self, scheduler_output: Any) -> None:
        for req_id in scheduler_output.finished_req_ids:
            self.finish(req_id)
        for new in scheduler_output.scheduled_new_reqs:
            sp = new.sampling_params
            self.prompt_lens[new.req_id] = len(new.prompt_token_ids or ())
            extra = sp.extra_args if sp is not None else None
            if extra and EXTRA_ARGS_KEY in extra:
                self.register(new.req_id, extra)
            elif self.global_adds or self.global_clamps:
                self._plan_global_only(new.req_id)

    def register(self, req_id: str, extra_args: dict | None) -> None:
        """Register a request's program and compose its plan (idempotent: a resumed request
        keeps its state)."""
        if req_id in self.requests or not extra_args or EXTRA_ARGS_KEY not in extra_args:
            return
        prog = self.programs.parse(
            extra_args[EXTRA_ARGS_KEY],
            named_vector=self.named.get,
            source_value=self.store.value,
            source_mean=lambda run, site: (m.numpy() if (m := self.store.mean(run, site)) is not None else None),
            owns_site=self.owns_site,
        )
        st = RequestState(req_id, prog)
        for run in sorted(prog.sources):  # the same runs, in the same order, on every stage
            self.store.get(run)  # recency
            if self.store.lease(run):
                st.leased.append(run)
        self.requests[req_id] = st
        self.by_key[prog.key] = st
        if prog.segment_len:
            self.segmented[req_id] = (prog.segment_len, prog.score_pos, prog.entry_layer)
        if DYNAMIC_ARGS_KEY in extra_args:
            self.dynamic.register(req_id, prog.key, prog.n_prompt, extra_args[DYNAMIC_ARGS_KEY], prog.errors)
        self._compose(req_id)

    def _compose(self, req_id: str) -> None:
        """(Re)build the plan of a registered request (nothing for a voided one)."""
        st = self.requests[req_id]
        old = self.plans.pop(req_id, None)
        if old is not None:
            self.slots.release(old.held)
        if st.program.voided:
            return
        try:
            self.plans[req_id] = RequestPlan.build(st.program.key, st.program.n_prompt, st.program, self.global_adds,
                                                   self.slots, self.global_version, self.global_clamps)
        except SlotCapacityError as exc:
            st.program.errors.append(str(exc))

    def _plan_global_only(self, req_id: str) -> None:
        old = self.plans.pop(req_id, None)
        if old is not None:
            self.slots.release(old.held)
        try:
            self.plans[req_id] = RequestPlan.build(f"global:{req_id}", self.prompt_lens.get(req_id, 0), None,
                                                   self.global_adds, self.slots, self.global_version, self.global_clamps)
        except SlotCapacityError as exc:
            logger.error("global steering not applied to request %s: %s", req_id, exc)

    def finish(self, req_id: str) -> None:
        """The request left the engine (finished or aborted): drop its state, plan and leases.
        Its results wait for `collect` (captures still in flight are filed first)."""
        if req_id in self.requests:
            self.planner.file_captures(wait=False)
        self.prompt_lens.pop(req_id, None)
        self.segmented.pop(req_id, None)
        plan = self.plans.pop(req_id, None)
        if plan is not None:
            self.slots.release(plan.held)
        st = self.requests.pop(req_id, None)
        if st is None:
            return
        for run in st.leased:
            self.store.release(run)
        if self.by_key.get(st.program.key) is st:
            del self.by_key[st.program.key]
        if not st.collected:
            prog = st.program
            if prog.capture_sites and self.planner.has_pending() and prog.keep_as:
                self.planner.file_captures(wait=True)  # a run to store is stored now: a request registered next finds it
            if prog.capture_sites and self.planner.has_pending():
                # its last rows may still be on their way: no wait for the GPU here (the step's
                # host work overlaps the forward); the captures join the result once filed
                out = self._result(st, captures=False)
                self._finishing[req_id] = (st, out)
            else:
                out = self._result(st)
            self.results[prog.key] = out
            if len(self.results) > MAX_UNCOLLECTED:
                for k in list(self.results)[: len(self.results) - MAX_UNCOLLECTED]:
                    self._free_ring(self.results.pop(k))
                if self._finishing:
                    keep = {id(v) for v in self.results.values()}
                    self._finishing = {r: v for r, v in self._finishing.items() if id(v[1]) in keep}
        self.dynamic.finish(req_id)

    # ---- per step -------------------------------------------------------------------------
    def plan_step(self, req_ids: Any, query_start_loc: Any, num_computed: Any, defer: bool = False) -> bool:
        """Fill the op's buffers for this step's rows (all other rows: untouched). With `defer`
        and dynamic requests in flight, the step is left open (`StepPlanner.plan_step`): the
        caller must call `finish_step` before launching the forward. Returns whether it did."""
        if self._recompose:  # the global steering changed: recompose the plans made before
            self._recompose = False
            for rid, plan in list(self.plans.items()):
                if plan.global_version != self.global_version:
                    if rid in self.requests:
                        self._compose(rid)
                    else:
                        self._plan_global_only(rid)
        if self._finishing:
            self._complete_finished(wait=False)
        dynamic = bool(self.dynamic.requests)
        if not dynamic:
            self.dynamic.idle()
        defer = defer and dynamic
        self.planner.plan_step(req_ids, query_start_loc, num_computed, self.plans, self._overflow,
                               self.dynamic.plan_rows_begin if dynamic else None, defer=defer)
        return defer

    def finish_step(self) -> None:
        """Close a step `plan_step(defer=True)` left open (the dynamic decisions that wait for the
        previous forward's scores, the checksum fold, the upload); nothing if none is open."""
        self.planner.finish_step()

    def _overflow(self, req_id: str, message: str) -> None:
        st = self.requests.get(req_id)
        if st is not None and message not in st.program.errors:
            st.program.errors.append(message)
        plan = self.plans.pop(req_id, None)  # voided: never touched again
        if plan is not None:
            self.slots.release(plan.held)

    def after_forward(self) -> None:
        if self.planner._open is not None:  # a seam bug: the forward ran before its plan was uploaded
            logger.error("causalboard: a step's plan was not finished before its forward; finishing it now")
            self.planner.finish_step()
        self.dynamic.after_forward()
        self.planner.after_forward()

    def score_segments(self, hidden: Any, model: Any, v2: bool = False) -> None:
        """After the forward (the model's output: final hidden states on the last pipeline stage):
        score this step's segment ends (`step_scores`; `v2`: as vLLM's V2 sampler computes
        logprobs, `segments.score`) and start their copy to the host. A rank whose
        `compute_logits` returns nothing (vocab-parallel logits gathered on another rank) records
        nothing."""
        todo, self.step_scores = self.step_scores, []
        if not todo or not isinstance(hidden, torch.Tensor):
            return
        from engine_ext.worker.segments import score

        by_ids: dict[tuple[int, ...], list[tuple[str, np.ndarray, np.ndarray]]] = {}
        for rid, pos, rows in todo:
            st = self.requests.get(rid)
            if st is not None:
                by_ids.setdefault(tuple(st.program.score_ids), []).append((rid, pos, rows))
        cuda = hidden.device.type == "cuda"
        for ids, group in by_ids.items():
            lp = score(hidden, np.concatenate([rows for _, _, rows in group]), model, list(ids), v2=v2)
            if lp is None:
                continue
            if cuda:
                host = torch.empty(lp.shape, dtype=lp.dtype, device="cpu", pin_memory=True)
                host.copy_(lp, non_blocking=True)
                done = torch.cuda.Event()
                cuda_streams.record(done, cuda_streams.device_index(hidden.device))
            else:
                host, done = lp, None
            at = 0
            for rid, pos, rows in group:
                self.requests[rid].scores.append((pos, host[at: at + len(rows)], done))
                at += len(rows)

    def _file_capture(self, req_id: str, positions: np.ndarray, sites: np.ndarray, xs: torch.Tensor | None,
                      rs: torch.Tensor | None,
                      step: StepCaptures, base: int) -> None:
        st = self.requests.get(req_id)
        if st is None and req_id in self._finishing:
            st = self._finishing[req_id][0]
        if st is not None and not st.collected:
            st.captures.append(CapturedBlock(positions, sites, xs, rs, step, base))

    # ---- results --------------------------------------------------------------------------
    def _complete_finished(self, wait: bool) -> None:
        """Add their captures to the results of finished requests (`_finishing`) once every
        pending copy is filed (`wait`: wait for the copies in flight)."""
        self.planner.file_captures(wait=wait)
        if self.planner.has_pending():
            return
        finishing, self._finishing = self._finishing, {}
        for st, out in finishing.values():
            self._add_captures(st, out)
            st.captures = []

    def _add_captures(self, st: RequestState, out: dict) -> None:
        """The captured values into a request's result, where it asked for them."""
        prog = st.program
        if prog.capture_sites and not prog.voided and prog.return_captures:
            out["captures"] = st.capture_values(self.ring)

    def _result(self, st: RequestState, captures: bool = True) -> dict:
        prog = st.program
        out: dict[str, Any] = {"key": prog.key, "status": "voided" if prog.voided else "ok",
                               "errors": list(prog.errors), "n_prompt": prog.n_prompt}
        if prog.keep_as and not prog.voided:
            # every pipeline stage stores its share, an empty one when the capture has no site in
            # its layers, charged as the whole run: a run is stored (and evicted) on every stage or none
            pairs = st.capture_pairs()
            try:
                charge = prog.capture_values * self._value_bytes if prog.capture_values else None
                evicted = self.store.put(prog.keep_as, pairs, charge=charge)
                out["stored_as"] = prog.keep_as
                out["evicted"] = evicted
                if prog.lease_kept:  # stored = leased: no other request can evict it in between
                    self.store.lease(prog.keep_as)
            except SourceStoreFull as exc:
                out["store_error"] = str(exc)
        if captures:
            self._add_captures(st, out)
        if prog.segment_len and not prog.voided:
            out["segment_scores"] = _segment_scores(st)
        dyn = self.dynamic.result(st.req_id, columns=True)
        if dyn is not None:
            out["dynamic"] = dyn
            if dyn["errors"]:  # a decision not taken or an action not applied: the output is not the policy's
                out["status"] = "voided"
                out["errors"] += [e for e in dyn["errors"] if e not in out["errors"]]
        return out

    def collect(self, keys: list[str], ring_acks: dict[str, list[int]] | None = None) -> dict[str, dict]:
        """Results of finished requests, by key (called by the client once per finished request).
        A request still registered (the worker has not seen its finish yet) is collected now.
        `ring_acks`: the ring regions the client has read since its last call, by ring name."""
        if ring_acks and self.ring is not None:
            self.ring.release(ring_acks.get(self.ring.name, ()))
        self._complete_finished(wait=True)
        out = {}
        for key in keys:
            if key in self.results:
                out[key] = self.results.pop(key)
            elif key in self.by_key:
                st = self.by_key[key]
                out[key] = self._result(st)
                st.collected = True
                st.captures = []
            else:
                out[key] = {"key": key, "status": "unknown", "errors": ["the worker has no record of this request"]}
        return out

    def enable_ring(self, size: int) -> str | None:
        """Hand captured values to the client through a shared-memory ring of `size` bytes
        (`engine_ext.capture_ring`; 0: no ring, values inline; negative: `capture_ring.auto_size`
        of the largest step's fp32 values). Returns the ring's name, None where there is none
        (off, or shared memory cannot hold it)."""
        if self.ring is not None:
            self.ring.close()
            self.ring = None
        if size < 0 and self.buffers is not None:
            size = auto_size(4 * self.buffers.max_capture_rows * self.hidden)
        if size > 0:
            self.ring = CaptureRing.create(size)
            if self.ring is not None and self.device.type == "cuda":
                self.ring.pin_for_cuda()  # else results copy their values into it
        self.planner.ring = self.ring
        return self.ring.name if self.ring is not None else None

    def _free_ring(self, result: dict) -> None:
        """Give back the ring region of a result that will never be handed out."""
        block = result.get("captures")
        if self.ring is not None and block and "ring" in block:
            self.ring.release([block["ring"][1]])

    # ---- control plane ----------------------------------------------------------------------
    def set_global_steer(self, entries: list[dict], clamps: list[dict] | None = None) -> int:
        """Replace the global steering set. Entries: {site, vec (fp32 bytes) | name, scale, phase,
        pos (list), gen (bool), every (bool), mask (fp32 bytes | None)}; `clamps` (None: keep the
        current ones): {site, dir (fp32 bytes: a unit vector), lo, hi (None: open), st, phase,
        pos, gen, every}. Plans are recomposed before the next step."""
        if clamps is not None:
            self.global_clamps = [clamp_op(k, "global_clamp", int(e["site"]),
                                           {**e, "dir": np.frombuffer(e["dir"], dtype="<f4").copy()})
                                  for k, e in enumerate(clamps)]
        adds = []
        for k, e in enumerate(entries):
            vec = np.frombuffer(e["vec"], dtype="<f4").copy() if e.get("vec") is not None else self.named.get(e["name"])
            if vec is None:
                raise KeyError(f"no registered vector named {e['name']!r}")
            if e.get("mask") is not None:
                vec = (vec * np.frombuffer(e["mask"], dtype="<f4")).astype(np.float32)
            adds.append(AddOp(k, "global", int(e["site"]), np.asarray(e.get("pos", []), np.int64),
                              bool(e.get("gen", True)), e.get("phase", "both"), vec, float(e["scale"]), name=e.get("name"),
                              every=bool(e.get("every", False))))
        self.global_adds = adds
        self.global_version += 1
        self._recompose = True
        if adds or self.global_clamps:  # requests without a program of their own get a global-only plan
            for rid in self.prompt_lens:
                if rid not in self.requests and rid not in self.plans:
                    self._plan_global_only(rid)
        else:
            for rid in [r for r in self.plans if r not in self.requests]:
                self.slots.release(self.plans.pop(rid).held)
        return len(adds)

    def status(self) -> dict:
        return {"tp_rank": self.tp_rank, "pp_rank": self.pp_rank, **self.checksum.status(),
                "registered_requests": len(self.requests), "global_steer_entries": len(self.global_adds),
                "global_clamp_entries": len(self.global_clamps),
                "named_vectors": sorted(self.named), "store": self.store.usage(), "steps": self.planner.steps,
                "steps_with_interventions": self.planner.applied_steps, "slots_in_use": len(self.slots),
                "uploads_skipped": self.planner.uploads_skipped, "steady_steps": self.planner.steady_steps,
                "held_steps": self.planner.held_steps,
                "buffer_bytes": self.buffers.nbytes(), "dynamic": self.dynamic.status(),
                "capture_ring": None if self.ring is None else self.ring.status(),
                "entered_steps": self.entered_steps, "layers_skipped": self.layers_skipped}


def _segment_scores(st: RequestState) -> dict:
    """A segmented request's scores for its result: `positions` (carrier positions, ascending),
    `ids` (the scored token ids) and `logprobs` (one list per position, in `ids` order). A
    position scored twice (recomputed after preemption) keeps its latest value."""
    latest: dict[int, list[float]] = {}
    for pos, host, done in st.scores:
        if done is not None:
            done.synchronize()
        for p, row in zip(pos.tolist(), host.tolist()):
            latest[p] = row
    positions = sorted(latest)
    return {"positions": positions, "ids": list(st.program.score_ids), "logprobs": [latest[p] for p in positions]}
