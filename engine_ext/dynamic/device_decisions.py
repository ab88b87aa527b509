"""Decisions of repeated steady decode steps taken on the device (`CAUSALBOARD_DYN_DEVICE` /
the RPC `cb_set_dyn_device`: 1, 0 or auto; the default, auto, uses it on a GPU for chains with a
proportional policy, where it measured faster than the host repeat; docs/performance.md).

A repeated step (`replay.Replay`) normally waits for the previous forward's scores before its
forward is launched (to check its decisions taken ahead). With decisions on the device it does
not wait at all:

* at the step that builds the record, every window gets both of its slots at each site it may
  steer: *on* (a threshold policy's action composed on the static plan's slot, acquired and held
  here even while the policy is released; for proportional control a slot of its own whose `c`
  the device rewrites every step with `vector * f32(scale)`) and *off* (the static plan's slot,
  or -1); each policy's constants and state go into a `device_rule.PolicyTable` (bit-equal to
  `PolicyState.decide`);
* after each forward the monitored scores are computed on the device as before and the table
  decides there (`device_kernels.decide`: one Triton kernel on CUDA, `PolicyTable.decide`'s torch
  operations elsewhere): each window's scale at the next position;
* the next step uploads its rows as usual and, right after the upload and before its forward,
  rewrites the windows' entries of `row_slot` from those scales (on where non-zero, else off)
  and the proportional slots' `c` (`device_kernels.rewrite`; no host wait);
* the host copies each step's (score, scale) pairs back without waiting (a ring of pinned
  buffers) and reads them two steps later, after that step's forward is launched (`process`, a
  fixed number of steps behind, so every rank folds in the same order). Where every decision is
  what the host expects without a flip (`_take_held`: threshold scores clear of their flip
  points, proportional scales equal to the host's float64 arithmetic on arrays) the actions are
  folded as one array and the bookkeeping queued for the worker's `_flush_chain`; otherwise
  (`_take_each`) the host takes every decision itself (`DynamicWorker._decide`), checks it against
  the device's (a mismatch is logged, reported in the request's errors and turns the mode off) and
  folds the actions the device applied with the ordinal of the step that applied them.

When the chain of repeated steps ends (a request comes or goes, a preemption, a result read),
every outstanding read-back is waited for and processed first (`DynamicWorker._end_device`), so
the host path goes on from exactly the device's state; a status read takes them without ending
the chain. Only batches whose every dynamic request has one policy (no gates) and whose record
could compose every window's action take this path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine_ext.dynamic import device_kernels, step_graphs
from engine_ext.dynamic.device_rule import PolicyTable
from engine_ext.dynamic.replay import ProportionalCrcs, proportional_action_crc, proportional_scales, threshold_flip_points
from engine_ext.worker import cuda_streams
from engine_ext.worker.intervention_op import SlotMode
from engine_ext.worker.slots import SlotValue

logger = logging.getLogger("causalboard.dynamic")


@dataclass
class _Readback:
    """One step's scores and decided scales on their way to the host."""

    positions: np.ndarray  # the position each window scored
    scores: np.ndarray  # [k] float64 (exact fp32 scores; a view of a pinned buffer on CUDA)
    scales: np.ndarray  # [k] float64: the scale each window's policy has at the next position
    event: Any  # CUDA event (None on CPU)
    #: the checksum ordinal of the step that applied these decisions (None: no step did)
    applied_step: int | None = None


class DeviceDecisions:
    """The device-side decision state of one chain of repeated steps (`replay.Replay`)."""

    def __init__(self, worker: Any, rp: Any, hs: np.ndarray):
        """Acquire every window's on-slots and load the table; raises `NotEligible` when a
        window's action cannot be composed (the chain then repeats on the host)."""
        self.w = worker
        b = worker.st.buffers
        self.device = b.device
        slots = worker.st.slots
        k = len(rp.drs)
        self.held: list[int] = []
        rows: list[int] = []
        sites: list[int] = []
        on: list[int] = []
        off: list[int] = []
        q: list[int] = []
        self.crc_on: list[int] = []
        #: proportional windows: window -> (vector crc, ["site:" in site order]) for the checksum
        self.prop: dict[int, tuple[int, list[str]]] = {}
        live_slots: list[int] = []  # per proportional entry: its dedicated slot, its window
        live_q: list[int] = []
        vecs: list[np.ndarray] = []
        prop_of = {id(e[0]): e for e in rp.prop}
        try:
            for i, dr in enumerate(rp.drs):
                st = dr.states[0]
                row = int(rp.w0[i])
                if st.policy.mode == "proportional":
                    # one slot of its own per site, not shared: its `c` is rewritten on the device
                    # every step (`vector * f32(scale)`, the payload the host would compose)
                    _, _, vcrc, site_tags = prop_of[id(dr)]
                    vec = np.asarray(dr.policies[0].vec, np.float32)
                    c0 = np.multiply(vec, np.float32(st.current_scale()), dtype=np.float32)
                    for tag in site_tags:
                        site = int(tag[:-1])
                        slot = slots.acquire(("dyn-live", id(self), i, site),
                                             lambda c0=c0: SlotValue(SlotMode.AFFINE, a=1.0, c=c0))
                        self.held.append(slot)
                        rows.append(row)
                        sites.append(site)
                        on.append(slot)
                        off.append(-1)  # `Replay.build`: no static steering under a proportional action
                        q.append(i)
                        live_slots.append(slot)
                        live_q.append(i)
                    vecs.append(vec)
                    self.prop[i] = (vcrc, site_tags)
                    self.crc_on.append(0)
                    continue
                if st.policy.mode != "threshold":
                    raise NotEligible()
                on_scales = (float(st.policy.scale),)
                layout = worker._layout(dr, on_scales)[0]
                if st.current_scale() != 0.0:  # engaged: this step's slots are the on-slots
                    got = [(site, int(hs[row, site])) for site in layout]
                    crc = rp.crc_of[i]
                    base = [int(rp.snap[row, site]) for site in layout]
                    for _, slot in got:
                        self.held.append(slots.acquire(slots.key_of(slot), _no_make))
                else:
                    plan = worker._action_plan(dr, row, on_scales, hs)
                    if isinstance(plan, str):
                        raise NotEligible()
                    entries, crc, gated = plan
                    if gated:
                        raise NotEligible()
                    base = [int(hs[row, site]) for site, _, _ in entries]
                    got = []
                    for site, key, make in entries:
                        slot = slots.acquire(key, make)
                        self.held.append(slot)
                        got.append((site, slot))
                for (site, slot), b0 in zip(got, base):
                    rows.append(row)
                    sites.append(site)
                    on.append(slot)
                    off.append(b0)
                    q.append(i)
                self.crc_on.append(int(crc))
        except Exception:
            slots.release(self.held)
            self.held = []
            raise
        slots.flush()  # new on-slots: uploaded before any forward reads them
        #: the proportional windows (window indices, ascending) and their actions' crcs in bulk
        self.prop_idx = np.asarray(sorted(self.prop), np.int64)
        self.prop_crcs = ProportionalCrcs([(rp.drs[i].key, self.prop[i][1], self.prop[i][0]) for i in self.prop_idx.tolist()])
        dev = self.device
        self.h_rows, self.h_sites = np.asarray(rows, np.int64), np.asarray(sites, np.int64)
        self.h_on, self.h_off = np.asarray(on, np.int32), np.asarray(off, np.int32)
        self.rows = torch.as_tensor(self.h_rows, device=dev)
        self.sites = torch.as_tensor(self.h_sites, device=dev)
        self.on = torch.as_tensor(self.h_on, device=dev)
        self.off = torch.as_tensor(self.h_off, device=dev)
        self.q = torch.as_tensor(np.asarray(q, np.int64), device=dev)
        # proportional entries: their slots, windows and vectors (one row per entry)
        self.live = torch.as_tensor(np.asarray(live_slots, np.int64), device=dev)
        self.live_q = torch.as_tensor(np.asarray(live_q, np.int64), device=dev)
        by_window = {i: v for i, v in zip(sorted(self.prop), vecs)}
        self.live_vec = (torch.as_tensor(np.stack([by_window[i] for i in live_q]), device=dev)
                         if live_q else None)
        table = PolicyTable(k, "cpu")
        for i, dr in enumerate(rp.drs):
            table.load(i, dr.states[0])
        self.table = table.to(dev)
        self.idx = torch.arange(k, device=dev)
        self.picks: torch.Tensor | None = None
        #: each window's scale at the next step (device), written by `after_forward`'s decision
        self.scales = torch.zeros(k, dtype=torch.float64, device=dev)
        #: (score, scale) per window for the host: one device buffer, copied into a ring of
        #: pinned host buffers (a read-back is taken at most 2 steps later: 4 never collide)
        self.rb = torch.zeros(2 * k, dtype=torch.float64, device=dev)
        self.k = k
        if dev.type == "cuda":
            # pinned buffers and events of an earlier chain of this size (pinning memory costs
            # the host ~1 ms a buffer), else new ones; given back by `release`
            got = self.w.readback_pool.pop(k, None)
            self.ring, self.events = got if got is not None else (
                [torch.empty(2 * k, dtype=torch.float64, pin_memory=True) for _ in range(4)],
                [torch.cuda.Event() for _ in range(4)])
        self.n_rb = 0
        self._expect(rp)
        self.crc_arr = np.asarray(self.crc_on, np.int64)
        self.queue: list[_Readback] = []
        #: the newest read-back's actions when the host took it before any step applied it
        self.taken_early: tuple | None = None
        self.steps = 0
        #: the decision's and the rewrite's launches as CUDA graphs once they repeat (`step_graphs`):
        #: the decision's keyed by the address its scores come from (`flat`'s pointer)
        self._decide = step_graphs.RepeatingLaunch()
        self._rewrite = step_graphs.RepeatingLaunch()

    # ---- per step -----------------------------------------------------------------------------
    def after_forward(self, rp: Any, positions: Any, flat: torch.Tensor) -> bool:
        """Decide on the device from this step's scores and start their read-back; first take,
        on the host, every read-back but the newest (the one this step applied): a fixed number of
        steps behind, never depending on timing, so every rank folds the checksum in the same
        order. Returns False on a mismatch with the device."""
        ok = self.process(rp, keep=1)
        if self.picks is None:
            self.picks = torch.as_tensor(np.asarray(rp.picks, np.int64), device=self.device)
        if self._decide.run(lambda: device_kernels.decide(self.table, self.idx, flat, self.picks, self.scales, self.rb),
                            key=flat.data_ptr(), graphs=self._graphs()):
            self.w.graph_replays += 1
        k = self.k
        if self.device.type == "cuda":
            j = self.n_rb % 4
            host, ev = self.ring[j], self.events[j]
            host.copy_(self.rb, non_blocking=True)
            cuda_streams.record(ev, self.w.st.buffers.cuda_index)
        else:
            host, ev = self.rb.clone(), None
        self.n_rb += 1
        arr = host.numpy()
        self.queue.append(_Readback(np.asarray(positions), arr[:k], arr[k:], ev))
        return ok

    def rewrite(self) -> None:
        """After the step's upload, before its forward: each window's entries from its flag (and
        each proportional entry's payload at the decided scale, in fp32); from the chain's
        `step_graphs.AFTER`-th step on as one captured launch (every tensor it reads is the chain's)."""
        b = self.w.st.buffers
        if self._rewrite.run(lambda: device_kernels.rewrite(b.row_slot, self.rows, self.sites, self.q, self.on, self.off,
                                                            self.scales, b.slot_c, self.live, self.live_q, self.live_vec),
                             graphs=self._graphs()):
            self.w.graph_replays += 1

    def _graphs(self) -> bool:
        """May repeating launches run as CUDA graphs now (`step_graphs`)?"""
        return self.device.type == "cuda" and self.w.step_graphs_on

    def ready(self) -> bool:
        """Is there a decision for the next step (the last read-back, not yet applied, whether or
        not the host has taken it already)?"""
        return (bool(self.queue) and self.queue[-1].applied_step is None) or self.taken_early is not None

    def consume(self, ordinal: int) -> None:
        """The step about to be launched applies the last read-back's decisions (if the host took
        them already, for a status read, their actions are folded now)."""
        if self.taken_early is not None:
            (acts, drs), self.taken_early = self.taken_early, None
            self._fold(acts, drs, ordinal)
        else:
            self.queue[-1].applied_step = ordinal
        self.steps += 1

    def process(self, rp: Any, keep: int = 0) -> bool:
        """Take, on the host and in order, the decisions of every read-back but the newest `keep`
        (waiting for each copy). A read-back no step has applied yet keeps its actions for
        `consume` (a status read between steps does not end the chain). Returns False on a
        mismatch with the device."""
        ok = True
        while len(self.queue) > keep:
            r = self.queue.pop(0)
            if r.event is not None:
                r.event.synchronize()
            ok &= self._take(rp, r)
        return ok

    def _fold(self, acts: list, drs: list, ordinal: int) -> None:
        if len(acts):
            self.w.st.planner.checksum.fold_step(acts, step=ordinal)
            self.w.actions += len(acts)
            for dr in drs:
                dr.actions += 1

    def _expect(self, rp: Any) -> None:
        """What the host expects of the next read-back while no policy flips, from the requests'
        states: each window's scale (`cur`), the scores at which a threshold policy could flip
        (`lo`, `hi`, as `Replay.build`), the proportional windows' constants."""
        k = len(rp.drs)
        nan = np.nan
        self.cur = np.zeros(k)
        self.lo, self.hi = np.full(k, nan), np.full(k, nan)
        self.is_prop = np.zeros(k, bool)
        self.gain, self.target = np.zeros(k), np.zeros(k)
        self.smin, self.smax = np.zeros(k), np.zeros(k)
        for i, dr in enumerate(rp.drs):
            st = dr.states[0]
            pol = st.policy
            self.cur[i] = st.current_scale()
            if pol.mode == "proportional":
                self.is_prop[i] = True
                self.gain[i], self.target[i] = float(pol.gain), float(pol.target)
                self.smin[i], self.smax[i] = float(pol.min_scale), float(pol.max_scale)
            else:
                self.lo[i], self.hi[i] = threshold_flip_points(st)
        self.any_prop = bool(self.is_prop.any())

    def _take(self, rp: Any, r: _Readback) -> bool:
        """Take one read-back on the host. While no policy flips (the scores and the device's
        scales what the host expects: `_expect`), its bookkeeping is queued for the worker's
        `_flush_chain` and its actions folded as arrays; else every decision is taken again
        request by request (`DynamicWorker._decide`) and compared with the device's."""
        x, d = r.scores, r.scales
        if r.applied_step is not None and not ((x < self.lo) | (x >= self.hi)).any():
            exp = self.cur.copy()
            if self.any_prop:
                p = self.is_prop
                exp[p] = proportional_scales(self.cur[p], self.gain[p], self.target[p], x[p], self.smin[p], self.smax[p])
            if np.array_equal(exp, d):
                return self._take_held(rp, r)
        return self._take_each(rp, r)

    def _take_held(self, rp: Any, r: _Readback) -> bool:
        """A read-back that a step applied, where every decision held (or moved a proportional
        scale as the host expects): its actions folded as one array, its bookkeeping logged."""
        w = self.w
        w.device_held_reads += 1
        x, d = r.scores, r.scales
        acting = d != 0.0
        crcs = self.crc_arr
        if self.any_prop:
            self.cur[self.is_prop] = d[self.is_prop]
            crcs = crcs.copy()
            pi = self.prop_idx
            sel = np.flatnonzero(acting[pi])  # the acting proportional windows (positions in `pi`)
            if sel.size:
                crcs[pi[sel]] = self.prop_crcs.crcs(d[pi], only=sel.tolist())
        pos = r.positions
        w._log_chain(rp, pos, x.copy(), d[rp.p_j].copy() if self.any_prop else None, acting)
        acts = np.empty((int(acting.sum()), 3), np.int64)
        acts[:, 0] = crcs[acting]
        acts[:, 1] = pos[acting] + 1
        acts[:, 2] = acts[:, 1] + 1
        if len(acts):
            w.st.planner.checksum.fold_step(acts, step=r.applied_step)
            w.actions += len(acts)
        return True

    def _take_each(self, rp: Any, r: _Readback) -> bool:
        w = self.w
        w._flush_chain()  # the chain's bookkeeping so far comes first
        scores = r.scores.tolist()
        scales = r.scales.tolist()
        acts = []
        acting = []
        ok = True
        for i, (dr, pos, x, dev) in enumerate(zip(rp.drs, r.positions.tolist(), scores, scales)):
            w._decide(dr, pos, [x])
            host = dr.decided[pos + 1][0]
            if host != dev and not (host != host and dev != dev):
                msg = (f"dynamic decision at position {pos} taken on the device ({dev!r}) differs from "
                       f"the host's ({host!r}); decisions on the device turned off")
                logger.error("causalboard: %s (request %s)", msg, dr.req_id)
                if msg not in dr.errors:
                    dr.errors.append(msg)
                ok = False
            if dev != 0.0:
                crc = self.crc_on[i]
                if i in self.prop:  # the crc the host path gives a proportional action
                    vcrc, tags = self.prop[i]
                    crc = proportional_action_crc(dr.key, tags, vcrc, np.float32(dev).astype("<f4").tobytes())
                acts.append((crc, pos + 1, pos + 2))
                acting.append(dr)
        if r.applied_step is not None:
            self._fold(acts, acting, r.applied_step)
        else:  # taken before a step applied it: folded by that step's `consume`, if one does
            self.taken_early = (acts, acting)
        self._expect(rp)  # the states may have flipped
        return ok

    def release(self) -> None:
        """The chain ended (every read-back taken): its slots released, its pinned read-back
        buffers kept for the next chain of the same size."""
        self.w.st.slots.release(self.held)
        self.held = []
        if self.device.type == "cuda" and self.ring is not None:
            self.w.readback_pool[self.k] = (self.ring, self.events)
            self.ring = None


class NotEligible(Exception):
    """A window whose action cannot be composed for decisions on the device."""


def _no_make():  # pragma: no cover - the key is held already
    raise AssertionError("an on-slot held by the step is missing")
