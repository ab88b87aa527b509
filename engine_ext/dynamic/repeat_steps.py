"""The dynamic worker's steady decode steps repeated (`RepeatedSteps`, a part of
`worker.DynamicWorker`): a step with the same requests on the same rows as the last, one position
further, one policy each (`replay.Replay`), repeats the last step's plan — decisions checked or
taken as arrays on the host (`_replay_begin` / `_replay_finish`), or taken on the device
(`_device_begin`, `device_decisions.DeviceDecisions`) — and a chain of such steps keeps its
decisions' bookkeeping as one log entry per step, written per request in bulk (`_flush_chain`)
when anything else reads or changes the requests' state. Every method here works on the
`DynamicWorker`'s state; `tests/test_dynamic_replay.py` compares all of it with planning request by
request."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine_ext.dynamic.replay import Replay, proportional_scales
from engine_ext.worker.intervention_op import SlotMode
from engine_ext.worker.slots import SlotCapacityError, SlotValue

if TYPE_CHECKING:  # the worker imports this module
    from engine_ext.dynamic.worker import DynRequest  # noqa: F401


#: tags of the slot keys a chain's proportional windows own (`_replay_proportional`): unique for the
#: process's lifetime, so no two chains — nor any other request — ever name the same slot
_OWN_SLOT_TAGS = itertools.count()


class RepeatedSteps:
    """Repeated steady decode steps (mixed into `worker.DynamicWorker`, whose state they use)."""

    def _replay_begin(self, rp: "Replay", planner: Any, req_ids, qsl, num_computed, hs: np.ndarray,
                      hc: np.ndarray, n_cap: int):
        """Phase 1 of a step that repeats the last one (`Replay`: the same requests on the same
        rows, one position further): the threshold windows' slots on the same rows (their
        decisions taken ahead: the held scales, which `_flush_chain` writes to `decided` with the
        rest of the bookkeeping, or the fall-back before it plans request by request), the same
        capture rows, as `plan_rows_begin` would (its result is the same:
        `tests/test_dynamic_replay.py`); the proportional windows wait for their scores
        (`_replay_finish`). None, with nothing written, when the step is not such a repeat."""
        pend = self._pending
        if (pend is None or pend[0] is not rp.work
                or not rp.continues(self._version, planner, req_ids, qsl, num_computed, n_cap)):
            return None
        if (not np.array_equal(hs[rp.w_rows, rp.w_sites], rp.w_base)
                or (hs[rp.p_rows, rp.p_sites] != -1).any()
                or (hc[rp.m_rows, rp.m_sites] >= 0).any()):
            return None
        hs[rp.w_rows, rp.w_sites] = rp.w_slots
        # the held scales at `positions` (`decided`) and the engaged requests' action counts are
        # written by `_flush_chain` (or by the fall-back below) with the rest of the bookkeeping
        positions = self._repeat(rp, num_computed, hc)
        return rp.max_row, n_cap + rp.m_idx.size, lambda: self._replay_finish(rp, positions, planner, hs)

    def _repeat(self, rp: "Replay", num_computed, hc: np.ndarray) -> np.ndarray:
        """What every repeated step does once it repeats: the record disarmed until this step's
        `after_forward`, the monitors' capture rows, the positions each window is at (returned)."""
        rp.armed = False
        rp.nc = np.array(num_computed)
        hc[rp.m_rows, rp.m_sites] = rp.m_idx
        positions = rp.nc[rp.win_rows]
        self._monitors, self._gated = [], []
        self._replaying = (rp, positions)
        return positions

    def _decide_on_device(self, rp: "Replay") -> bool:
        """Should the chain that `rp` starts take its decisions on the device?"""
        if self.device_decisions == "auto":
            return self.st.device.type == "cuda" and bool(rp.prop)
        return bool(self.device_decisions)

    def _device_begin(self, rp: "Replay", planner: Any, req_ids, qsl, num_computed, hs: np.ndarray,
                      hc: np.ndarray, n_cap: int):
        """A repeated step whose decisions the device takes (`device_decisions`): every window's
        on-slots written (the device rewrites each entry from its flag right after the upload),
        the capture rows as before, nothing waited for. None when the step is not a repeat."""
        dev = rp.dev
        if (not self.device_decisions or self._pending is not None or not dev.ready()
                or not rp.continues(self._version, planner, req_ids, qsl, num_computed, n_cap)):
            return None
        if not np.array_equal(hs[dev.h_rows, dev.h_sites], dev.h_off) or (hc[rp.m_rows, rp.m_sites] >= 0).any():
            return None
        dev.consume(planner.checksum.step)  # this step applies the last read-back's decisions
        hs[dev.h_rows, dev.h_sites] = dev.h_on
        self._repeat(rp, num_computed, hc)
        planner.after_upload = dev.rewrite
        self.replayed_steps += 1
        self._replay = rp
        return rp.max_row, n_cap + rp.m_idx.size, lambda: (rp.max_row, [])

    def _end_device(self, rp: "Replay") -> None:
        """End a chain of steps decided on the device: every read-back waited for and taken on
        the host (so the host's states and `decided` are the device's), its slots released."""
        dev, rp.dev = rp.dev, None
        if dev is None:
            return
        if not dev.process(rp):
            self.device_decisions = False
        dev.release()
        if self._replay is rp:
            self._replay = None

    def sync_device(self, end: bool = True) -> None:
        """Before the host reads or changes dynamic state from outside the step loop (a result,
        a request leaving: `end`, the chain decided on the device ends; the status: every
        read-back is taken, the chain goes on)."""
        rp = self._replay
        if rp is not None and rp.dev is not None:
            if end:
                self._end_device(rp)
            elif not rp.dev.process(rp):
                self.device_decisions = False

    def _replay_finish(self, rp: "Replay", positions: np.ndarray, planner: Any, hs: np.ndarray) -> tuple[int, Any]:
        """Phases 2 and 3 of a repeated step: wait for the previous step's scores and check, at
        once for the batch, that every decision taken ahead holds (`Replay.lo`/`hi`: the scores
        at which a threshold policy could flip); decide the proportional policies for the batch
        (`PolicyState.decide`'s arithmetic on float64 arrays) and compose their slots. If all
        hold, the threshold windows stay as written (their actions: the last step's, one position
        further); else — or if a proportional scale is 0 or no slot is left — the repeat is undone
        and the step finished as `plan_rows_begin`'s would be."""
        work, host, event = self._pending
        if event is not None:
            event.synchronize()
            event = None
        scores = (host.numpy() if isinstance(host, torch.Tensor) else np.asarray(host))[rp.picks]
        flips = (scores < rp.lo) | (scores >= rp.hi)
        prop = rp.prop
        acquired: list[int] = []
        if not flips.any() and prop:
            new, acquired, crcs, fresh = self._replay_proportional(rp, scores)
            if new is None:
                flips = True
        if np.any(flips):  # undo, and finish the step the usual way
            self.replay_fallbacks += 1
            self._flush_chain()
            self._pending = (work, host, None)
            hs[rp.w_rows, rp.w_sites] = rp.w_base
            positions = positions.tolist()
            for j, scales in zip(rp.ahead_idx, rp.ahead_scales):  # the decisions taken ahead
                rp.drs[j].decided[positions[j]] = scales
            self._monitors = self.step_monitors()
            self._replaying = None
            windows = [[dr, row, p, 1, None, None] for dr, row, p in zip(rp.drs, rp.w0.tolist(), positions)]
            held_before, self._held = self._held, []
            ahead = {id(rp.drs[j]): positions[j] - 1 for j in rp.ahead_idx}
            return self._plan_rows_finish(planner, hs, windows, ahead, held_before)
        self._pending = None
        self.replayed_steps += 1
        act_crcs = rp.act_crcs
        if prop:
            hs[rp.p_rows, rp.p_sites] = acquired
            if fresh:  # the chain's own slots from now on: the last step's content-named ones go
                self.st.slots.release(rp.prop_held)
                rp.prop_held = acquired
            self._held = rp.static_held + acquired
            rp.p_cur = new  # decided; the states get it with the rest of the bookkeeping
            act_crcs = act_crcs.copy()
            act_crcs[rp.act_prop] = crcs
        self._log_chain(rp, positions - 1, scores, new if prop else None, rp.acting)
        acts = np.empty((rp.act_idx.size, 3), np.int64)
        acts[:, 0] = act_crcs
        acts[:, 1] = rp.nc[rp.win_rows[rp.act_idx]]
        acts[:, 2] = acts[:, 1] + 1
        self.actions += rp.act_idx.size
        self._replay = rp  # the next step may repeat it again (armed by `after_forward`)
        return rp.max_row, acts

    def _replay_proportional(self, rp: "Replay", scores: np.ndarray):
        """The proportional windows of a repeated step: their new scales (`PolicyState.decide`:
        `min(max_scale, max(min_scale, scale + gain * (target - score)))` in float64, Python's
        min/max order), the slots of `vector * f32(scale)` at their sites (no base under them)
        and each action's crc (the name `_action_plan` gives it). The chain's first repeat takes
        one slot of its own per window (a key no other request can name), held through the chain
        (`rp.p_own`); every later repeat rewrites those slots' `c` in place on the device from the
        new scales alone (`SlotTable.rewrite_scaled`: the vectors were uploaded with the first)
        instead of acquiring a content-named slot per new scale and releasing the last. Returns (scales, the slot per window and site, crcs, whether the slots
        are new this step); (None, [], None, False) when a scale is 0 (no action) or no slot is
        left (nothing is left acquired)."""
        prop = rp.prop
        x = scores[rp.p_j].astype(np.float64)
        new = proportional_scales(rp.p_cur, rp.p_gain, rp.p_target, x, rp.p_min, rp.p_max)
        if not new.all():
            return None, [], None, False
        s32 = new.astype(np.float32)
        slots = self.st.slots
        if rp.p_own is not None:
            rows = rp.p_own_rows
            slots.rewrite_scaled(rp.p_own_dev, s32 if rows is None else s32[rows])
            return new, rp.p_own, rp.p_crcs.crcs(s32), False
        tag = next(_OWN_SLOT_TAGS)
        acquire = slots.acquire
        acquired: list[int] = []
        unique: list[int] = []
        with_sites = [k for k, (_, _, _, sites) in enumerate(prop) if sites]  # (every window, in practice)
        rows = None if len(with_sites) == len(prop) else np.asarray(with_sites, np.int64)
        vecs = rp.p_vec if rows is None else rp.p_vec[rows]
        own_c = np.multiply(vecs, (s32 if rows is None else s32[rows])[:, None], dtype=np.float32)
        try:
            for i, k in enumerate(with_sites):
                key = ("dyn-own", tag, k)
                row = own_c[i]
                for _ in prop[k][3]:
                    acquired.append(acquire(key, lambda row=row: SlotValue(SlotMode.AFFINE, a=1.0, c=row)))
                unique.append(acquired[-1])
        except SlotCapacityError:
            slots.release(acquired)
            return None, [], None, False
        rp.p_own, rp.p_own_rows = acquired, rows
        rp.p_own_dev = slots.scaled_rows(unique, vecs)
        return new, acquired, rp.p_crcs.crcs(s32), True

    def _log_chain(self, rp: "Replay", positions: np.ndarray, scores: np.ndarray, prop_scales: np.ndarray | None,
                   acting: np.ndarray) -> None:
        """Queue one repeated step's decisions that held (`_flush_chain`)."""
        if self._chain_log and self._chain_log[-1][0] is not rp:
            self._flush_chain()
        self._chain_log.append((rp, positions, scores, prop_scales, acting))

    def _flush_chain(self) -> None:
        """The bookkeeping of a chain of repeated steps' decisions that held, request by request
        for all of its steps at once: what `_decide(..., held=True)` does for each request and
        position in turn (`tests/test_dynamic_replay.py` compares both), written in bulk. In a
        chain every request has one policy that holds at every step (a threshold policy stays
        engaged or released: its threshold and scale do not change; a proportional one's scale
        is each step's, logged), and each step scores each request one position further."""
        if not self._chain_log:
            return
        log, self._chain_log = self._chain_log, []
        rp = log[0][0]
        n = len(log)
        pos = np.stack([e[1] for e in log], axis=1).tolist()  # [request][step]
        sc = np.stack([e[2] for e in log], axis=1).tolist()
        prop_scales = (np.stack([e[3] for e in log], axis=1).tolist() if log[0][3] is not None else None)
        prop_k = {int(j): k for k, j in enumerate(rp.p_j.tolist())}
        acted = np.sum([e[4] for e in log], axis=0).tolist()  # per window: the steps it acted at
        for j, dr in enumerate(rp.drs):
            ps, xs = pos[j], sc[j]
            st = dr.states[0]
            first = dr.decided.get(ps[0])
            app0 = first[0] if first is not None else 0.0
            if j in prop_k:  # proportional: each step's scale (set on the state at its step)
                new = prop_scales[prop_k[j]]
                dr.trace[0].extend(zip(ps, xs, [st.policy.target] * n, [app0] + new[:-1]))
                dr.decided.update(zip([p + 1 for p in ps], [(s,) for s in new]))
                st.scale = new[-1]
            else:  # threshold, held: the same threshold and scale throughout
                scale = st.current_scale()
                dr.trace[0].extend(zip(ps, xs, [st.threshold()] * n, [app0] + [scale] * (n - 1)))
                dr.decided.update(zip([p + 1 for p in ps], [(scale,)] * n))
                if st.engaged:
                    st.held += n
            dr.actions += acted[j]
            dr.last_scored = max(dr.last_scored, ps[-1])
            if st.latched and dr.policies[0].spec.latch == "conversation" and dr.conversation_id is not None:
                self._latch(dr.conversation_id, dr.policies[0].ident)


def device_setting(value: Any) -> bool | str:
    """`CAUSALBOARD_DYN_DEVICE` / `cb_set_dyn_device`'s value: True, False or "auto"."""
    if isinstance(value, str):
        v = value.strip().lower()
        if v == "auto":
            return "auto"
        if v in ("1", "true", "on"):
            return True
        if v in ("0", "false", "off", ""):
            return False
        raise ValueError(f"CAUSALBOARD_DYN_DEVICE / cb_set_dyn_device (decisions on the device): expected 1, 0 or auto, got {value!r}")
    return bool(value)


class _ReplayWork:
    """A repeated step's pending work, `(request, position, picks, row gate pick)` per request as
    `_start_copy` takes it, built only when something iterates it (a fall-back or a read between
    steps; a chain's steps take their decisions from arrays)."""

    __slots__ = ("work", "positions", "_items")

    def __init__(self, work: list, positions: np.ndarray):
        self.work, self.positions, self._items = work, positions, None

    def __iter__(self):
        if self._items is None:
            self._items = [(dr, pos, picks, gp) for (dr, _, _, picks, gp), pos in zip(self.work, self.positions.tolist())]
        return iter(self._items)
