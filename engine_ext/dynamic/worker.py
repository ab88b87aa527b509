"""Dynamic steering on the worker: monitor -> policy -> action, one step apart.

Per step, inside `StepPlanner.plan_step` (`plan_rows_begin` and its `finish`, before the upload):

* **actions** — for every generated position `p` of a dynamic request's window whose decision is
  already made (`decided[p]`: one scale per policy), the engaged policies' `scale * vector` are
  composed at their sites on top of whatever slot the static plan put there (static steering,
  then global steering, then the dynamic policies in order: the oracle's order), through the
  content-addressed `SlotTable`. Each applied (request, position) is one checksum action whose
  identity is the crc32 of the request key, the sites and every payload's name (`_Policy.parts`:
  bit-exact, from the vector's fp32 bytes and `f32(scale)`).
  An action that cannot be applied (no slot left) is rejected: not applied, not folded, and the
  request is voided with the reason.
* **row gates** — a request with a `this_token` probe gate (the fork's per-row monitor,
  `GateSet.row_gate`) gets, at every position its gate components apply, a slot at the probe's
  site carrying a gate row (probe, threshold, sharpness, and the request's row term there,
  `GateSet.row_term`): the op scales that term by the same position's `g`, computed from the
  row's pre-edit value. The gate row's content (not the device-computed `g`) is folded into the
  action's crc, so ranks agree bit for bit. The op writes `(score, g)` to `gate_out[row]`; the
  window's last position's pair is read back with the scores (below) and reported in the trace.
* **monitors** — the window's last position, if it is the last prompt position or a generated one
  and was never scored, gets a capture row at each of its probes' sites (the capture path the op
  already has: graph-safe, no eager forcing).

After the forward (`after_forward`): the monitored rows are read from the capture buffer on the
device, each probe's `W @ s + b` is computed there, and only those score floats are copied to the
host (one non-blocking copy per step, the row gates' `(score, g)` included). The next step's
planning (`plan_rows_begin`) hands out its monitor rows first (they do not depend on decisions), then
takes the decisions (`decide_pending`, which waits for that copy; `policy.PolicyState.decide`) and
records the scales for position `p + 1` in `decided`: that step applies them, exactly. A request
whose policies are all threshold policies has its decision taken *ahead*, before the wait: its
policies are assumed to hold (stay engaged or released), its action is applied with those scales,
and after the wait each score is checked (`PolicyState.holds`); where one does not hold, the
action is undone and the decision taken as usual, so the result is the same as deciding after the
wait, with most of the per-request work done while the previous forward still runs. The
bookkeeping of the decisions that held (trace entries included) is done after that step's
forward is launched.
Positions recomputed after a preemption reuse their recorded decisions (nothing is decided twice).

A steady decode step (the same requests on the same rows as the last step, one position on, one
policy each, no gates) repeats the last step's plan (`Replay`): its writes as arrays, its
threshold decisions checked at once, its proportional ones decided at once; anything else falls
back to the path above, exactly. Opt-in, such steps' threshold decisions are taken on the device
instead (`engine_ext.dynamic.device_decisions`): no wait before the forward at all.

Every tensor-parallel rank holds the same registrations, sees the same post-all-reduce stream and
runs the same code, so all ranks take the same decisions; the applied-action checksum proves it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engine_ext.dynamic import step_graphs, trace
from engine_ext.dynamic.device_decisions import DeviceDecisions, NotEligible
from engine_ext.dynamic.gates import GateSet, GateState
from engine_ext.dynamic.repeat_steps import RepeatedSteps, _ReplayWork, device_setting
from engine_ext.dynamic.replay import Replay, requests_decode_only
from engine_ext.dynamic.policy import PolicyState
from engine_ext.dynamic.specs import DYNAMIC_ARGS_KEY, Policy, Probe, policy_from_wire  # noqa: F401 (re-export)
from engine_ext.specs import spec_hash
from engine_ext.worker import cuda_streams
from engine_ext.worker.intervention_op import SlotMode
from engine_ext.worker.slots import SlotCapacityError, SlotValue, to_device_async

logger = logging.getLogger("causalboard.dynamic")

#: conversations whose latches are remembered (least recently used dropped beyond)
MAX_CONVERSATIONS = 4096
#: probes of the fork's gates kept on the device while no request uses them (least recently used dropped beyond)
IDLE_GATE_PROBES = 64


@dataclass
class _Probe:
    spec: Probe
    w: torch.Tensor  # [k, H] fp32 on the device
    b: torch.Tensor  # [k]
    site: int = -1  # the flat index of `spec.site`

    def __post_init__(self) -> None:
        self.site = self.spec.site.index()


@dataclass
class _Policy:
    """An action source: a policy (one vector at all its sites) or a gate component (`spec`
    None: one vector per site, `vecs`)."""

    spec: Policy | None
    ident: str
    vec: np.ndarray | None  # fp32
    sites: list[int]
    vecs: list[np.ndarray] | None = None
    _parts: dict = field(default_factory=dict)
    _vec_crcs: dict = field(default_factory=dict)

    def parts(self, scale: float) -> list[tuple[int, np.ndarray, np.float32, int]]:
        """Per site: (site, vector, `f32(scale)`, crc), cached per scale. The payload is
        `vector * f32(scale)` (fp32; `payload`, computed only when a slot is made); the crc names it
        bit-exactly: the crc32 of `f32(scale)`'s bytes continued from the crc32 of the vector's fp32
        bytes (the payload is a deterministic function of the two, so payloads differing in any
        bit have different (vector, scale) and, but for a crc32 collision, different crcs)."""
        got = self._parts.get(scale)
        if got is None:
            s32 = np.float32(scale)
            vecs = self.vecs if self.vecs is not None else [self.vec] * len(self.sites)
            got = []
            for site, vec in zip(self.sites, vecs):
                vcrc = self._vec_crcs.get(id(vec))
                if vcrc is None:
                    vcrc = self._vec_crcs[id(vec)] = zlib.crc32(np.ascontiguousarray(vec, "<f4").tobytes())
                got.append((site, vec, s32, zlib.crc32(s32.astype("<f4").tobytes(), vcrc)))
            if len(self._parts) > 64:  # proportional control: a new scale nearly every step
                self._parts.clear()
            self._parts[scale] = got
        return got


def payload(vec: np.ndarray, s32: np.float32) -> np.ndarray:
    """`vector * f32(scale)` in fp32 (a new array): what a dynamic action adds at a site."""
    return np.multiply(vec, s32, dtype=np.float32)


#: dynamic wire texts whose parse `DynamicWorker.register` keeps (the last ones)
_WIRE_CACHE = 8


@dataclass
class _ParsedWire:
    """One dynamic wire text, parsed once for every request that brings it: its JSON, each
    policy with its ident (`spec_hash` of its JSON), and each policy's `_Policy` once made
    (with the vector it was made from: a named vector registered again makes it anew). A
    `_Policy` is shared by those requests (its caches are functions of its vector and sites)."""

    data: dict
    policies: list[tuple[Policy, str]]
    made: list[tuple[np.ndarray, _Policy] | None]


@dataclass(eq=False)
class DynRequest:
    req_id: str
    key: str
    n_prompt: int
    conversation_id: str | None
    policies: list[_Policy]
    states: list[PolicyState]
    #: position -> scale of each policy there (decided after the forward at position - 1)
    decided: dict[int, tuple[float, ...]] = field(default_factory=dict)
    #: per policy, one entry per scored position: (position, score, threshold, scale applied
    #: there) (`result` spells them out)
    trace: list[list[tuple]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    actions: int = 0
    last_scored: int = -1
    #: the sites its probes read (flat indices, sorted; fixed at registration)
    monitor_sites: tuple[int, ...] = ()
    #: (scales, whether the row gate acts, base slot keys per site) -> (per site: (slot key,
    #: make), the action's crc, gated); an action repeated with the same inputs (a threshold
    #: policy holding) is composed once
    actions_cache: dict = field(default_factory=dict)
    #: scales -> (sites an action writes on this worker, whether the row gate acts): `_layout`
    layouts: dict = field(default_factory=dict)
    #: the fork's declarative gates: their decision state and their components (applied after
    #: the policies; `decided` tuples hold the policies' scales, then the components')
    gate: GateState | None = None
    gate_actions: list[_Policy] = field(default_factory=list)
    gate_trace: list[dict] = field(default_factory=list)
    #: the inline probes of its gates (worker probe names), released when it finishes
    gate_probes: tuple[str, ...] = ()
    #: the row gate (the fork's per-row monitor, `GateSet.row_gate`): its site (flat index) and
    #: what the op's gate row holds apart from the term: probe direction, threshold, sharpness
    gate_site: int | None = None
    gate_row: tuple[np.ndarray, float, float] | None = None
    #: the content key of `gate_row` (probe crc32, threshold and sharpness as float32 hex)
    gate_row_key: tuple[int, str, str] | None = None
    #: every policy a threshold policy and no gates: its decisions may be taken ahead (`_speculate`)
    speculable: bool = False
    #: each policy's index in the request's wire (policies no longer registered are left out)
    wire_index: list[int] = field(default_factory=list)
    _refs: tuple[tuple[str, int], ...] | None = None

    def engaged(self) -> bool:
        return (any(s.current_scale() != 0.0 for s in self.states)
                or (self.gate is not None and any(self.gate.current_scales())))

    def actors(self) -> list[_Policy]:
        """Every action source, in the order of the `decided` tuples."""
        return self.policies + self.gate_actions

    def score_refs(self) -> tuple[tuple[str, int], ...]:
        """(probe, component) of every score a decision needs: the policies', then each
        probe-triggered gate's (fixed at registration; built once)."""
        if self._refs is None:
            refs = [(p.spec.probe, p.spec.component) for p in self.policies]
            if self.gate is not None:  # a `this_token` probe is scored in the op (the row gate), not here
                refs += [(g.probe.name, 0) for g in self.gate.gs.gates if g.probe is not None and not g.soft]
            self._refs = tuple(refs)
        return self._refs


class DynamicWorker(RepeatedSteps):
    """One engine's dynamic-steering state on one worker (held by `WorkerState.dynamic`)."""

    def __init__(self, state: Any):
        self.st = state
        self.probes: dict[str, _Probe] = {}
        self.requests: dict[str, DynRequest] = {}
        self.latches: OrderedDict[str, set[str]] = OrderedDict()
        #: the last dynamic wire texts parsed (`_parsed_wire`)
        self._wires: OrderedDict[str, _ParsedWire] = OrderedDict()
        #: slots the dynamic actions of the previous step hold (released after this step's acquire)
        self._held: list[int] = []
        self._monitors: list[tuple[DynRequest, int, int, int]] = []  # (request, position, site index, capture row)
        self._gated: list[tuple[DynRequest, int, int]] = []  # (request, position, row) whose row gate the op scores
        #: scores of the last step not yet decided on: (work, host scores, copy event or None)
        self._pending: tuple | None = None
        #: decisions taken ahead that held (request, position, scores): their bookkeeping
        #: (`PolicyState.hold`, `last_scored`, trace, latches) is done by `_settle`
        self._held_decisions: list[tuple[DynRequest, int, list[float]]] = []
        #: the same for a chain of repeated steps (`Replay`), one entry per step and not per
        #: request: (record, positions scored [k], scores [k], proportional scales decided or
        #: None, which windows acted [k]);
        #: `_flush_chain` does their bookkeeping request by request, in bulk, whenever anything
        #: but the next repeated step reads or changes the requests' state
        self._chain_log: list[tuple[Replay, np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]] = []
        #: the last step's score layout (`_ScorePlan`), reused while it stays the same
        self._score_plan: _ScorePlan | None = None
        #: a chain decided on the device launches its repeating work as CUDA graphs (`step_graphs`;
        #: `CAUSALBOARD_DYN_GRAPHS=0` or `cb_set_dyn_graphs` turn it off; a graph of the scores
        #: that differs from the eager scores does too)
        self.step_graphs_on = os.environ.get("CAUSALBOARD_DYN_GRAPHS", "1") != "0"
        #: per-step work launched as a graph replay (scores, decisions, rewrites: `step_graphs`)
        self.graph_replays = 0
        #: pinned read-back buffers and events of ended chains decided on the device, by size
        #: (`device_decisions.DeviceDecisions`: reused by the next chain of that size)
        self.readback_pool: dict[int, tuple[list, list]] = {}
        #: CUDA: the pinned buffer the scores are copied into and the copy's event (reused)
        self._host_scores: torch.Tensor | None = None
        self._score_event: Any = None
        #: the steady decode step to repeat (`Replay`), built by a step's finish, armed by its
        #: `after_forward`, consumed by the next plan; `_version` changes whenever a request or
        #: probe comes or goes (a replay built before is void)
        self._replay: Replay | None = None
        self._replaying: tuple[Replay, np.ndarray] | None = None
        self._version = 0
        #: repeat steady decode steps (`Replay`); off: every step planned request by request
        #: (`CAUSALBOARD_DYN_REPLAY=0`; the same plans, decisions and checksum, only slower)
        self.replay_enabled = os.environ.get("CAUSALBOARD_DYN_REPLAY", "1") != "0"
        #: steps repeated / begun as a repeat and finished the usual way (a decision flipped)
        self.replayed_steps = 0
        self.replay_fallbacks = 0
        #: take the repeated steps' decisions on the device (no wait before a forward;
        #: `engine_ext.dynamic.device_decisions`): True, False, or "auto" (the default: on a GPU,
        #: for chains with a proportional policy, where it measured faster; threshold policies
        #: and monitors measured as fast or faster on the host: docs/performance.md).
        #: `CAUSALBOARD_DYN_DEVICE=1` / `0` / `auto`; turned off (False) by a mismatch
        self.device_decisions: bool | str = device_setting(os.environ.get("CAUSALBOARD_DYN_DEVICE", "auto"))
        #: read-backs of such steps taken as arrays (every decision held: `DeviceDecisions._take_held`)
        self.device_held_reads = 0
        self.actions = 0
        self.rejected = 0
        self.results: dict[str, dict] = {}
        #: gate probes travel with their requests: worker probe name -> requests using it; the
        #: last unused ones stay on the device (no upload when the next request brings them again)
        self._gate_probe_refs: dict[str, int] = {}
        self._idle_gate_probes: OrderedDict[str, None] = OrderedDict()

    # ---- registry -------------------------------------------------------------------------
    def set_probe(self, data: dict) -> int:
        self._version += 1
        probe = Probe.from_wire(data)
        dev = self.st.device
        self.probes[probe.name] = _Probe(probe, torch.from_numpy(probe.weights.copy()).to(dev),
                                         torch.from_numpy(probe.bias.copy()).to(dev))
        return probe.size

    def delete_probe(self, name: str) -> bool:
        self._version += 1
        return self.probes.pop(name, None) is not None

    # ---- requests ---------------------------------------------------------------------------
    def _parsed_wire(self, text: str) -> _ParsedWire:
        """A request's dynamic wire text parsed (`_ParsedWire`), shared by every request that
        brings the same text (a batch with one dynamic steering: `_WIRE_CACHE` last texts kept)."""
        got = self._wires.get(text)
        if got is None:
            data = json.loads(text)
            pjs = data.get("policies") or []
            got = _ParsedWire(data, [(policy_from_wire(pj), spec_hash(pj)) for pj in pjs], [None] * len(pjs))
            self._wires[text] = got
            while len(self._wires) > _WIRE_CACHE:
                self._wires.popitem(last=False)
        else:
            self._wires.move_to_end(text)
        return got

    def register(self, req_id: str, key: str, n_prompt: int, text: str, errors: list[str]) -> None:
        self._version += 1
        wire = self._parsed_wire(text)
        data = wire.data
        conv = data.get("conversation_id")
        pols, states, index = [], [], []
        for k, (pol, ident) in enumerate(wire.policies):
            if pol.probe not in self.probes:
                errors.append(f"dynamic policy {k}: probe {pol.probe!r} is no longer registered")
                continue
            vec = pol.vector if pol.vector is not None else self.st.named.get(pol.vector_name)
            if vec is None:
                errors.append(f"dynamic policy {k}: steering vector {pol.vector_name!r} is no longer registered")
                continue
            made = wire.made[k]
            if made is None or made[0] is not vec:  # a named vector registered again: made anew
                made = wire.made[k] = (vec, _Policy(pol, ident, np.asarray(vec, np.float32), [s.index() for s in pol.sites]))
            latched = conv is not None and pol.latch == "conversation" and ident in self.latches.get(conv, ())
            pols.append(made[1])
            states.append(PolicyState.start(pol, latched=latched))
            index.append(k)
        if conv is not None and conv in self.latches:
            self.latches.move_to_end(conv)
        dr = DynRequest(req_id, key, n_prompt, conv, pols, states, trace=[[] for _ in pols], wire_index=index)
        if data.get("gates"):
            gs = GateSet.from_wire(data["gates"])
            names = []
            for probe in gs.probes():  # content-addressed names ('~…'): equal names, equal probes
                self._idle_gate_probes.pop(probe.name, None)
                if probe.name not in self.probes:
                    self.set_probe(probe.to_json())
                self._gate_probe_refs[probe.name] = self._gate_probe_refs.get(probe.name, 0) + 1
                names.append(probe.name)
            dr.gate_probes = tuple(names)
            dr.gate = GateState(gs, n_prompt)
            for sv, role in gs.components():
                dr.gate_actions.append(_Policy(None, role, None, [s.index() for s in sv.sites],
                                               vecs=[np.asarray(v, np.float32) for v in sv.vectors]))
            if gs.row_gate is not None:
                g = gs.gates[gs.row_gate]
                dr.gate_site = g.probe.site.index()
                thr = float(np.float32(g.threshold) - np.float32(g.probe.bias[0]))  # gate probes have bias 0
                probe = np.ascontiguousarray(g.probe.weights[0], np.float32)
                sharp = float(np.float32(g.sharp))
                dr.gate_row = (probe, thr, sharp)
                dr.gate_row_key = (zlib.crc32(probe.astype("<f4").tobytes()), np.float32(thr).tobytes().hex(),
                                   np.float32(sharp).tobytes().hex())
        dr.monitor_sites = tuple(sorted({self.probes[name].spec.site.index() for name, _ in dr.score_refs()}))
        dr.speculable = dr.gate is None and all(st.policy.mode == "threshold" for st in states)
        if any(s.current_scale() != 0.0 for s in states):
            dr.decided[n_prompt] = tuple(s.current_scale() for s in states) + (0.0,) * len(dr.gate_actions)
        self.requests[req_id] = dr

    def finish(self, req_id: str) -> None:
        self._version += 1
        if not self.requests:
            # no dynamic request in flight: the last one's finish settled everything, and the next
            # step's `idle` takes what a forward since has left (a request without dynamic
            # steering leaving costs no more than this)
            return
        self.sync_device()
        self.decide_pending()
        dr = self.requests.pop(req_id, None)
        for name in dr.gate_probes if dr is not None else ():
            left = self._gate_probe_refs.get(name, 1) - 1
            if left <= 0:
                self._gate_probe_refs.pop(name, None)
                self._idle_gate_probes[name] = None
                while len(self._idle_gate_probes) > IDLE_GATE_PROBES:
                    self.probes.pop(self._idle_gate_probes.popitem(last=False)[0], None)
            else:
                self._gate_probe_refs[name] = left

    def result(self, req_id: str, columns: bool = False) -> dict | None:
        """The request's dynamic result: its policies, per-token trace (the public dicts, or
        with `columns` as `trace_columns`, what a result travels in: `dynamic.trace`, and the
        policies as `policy_index`, their indices in the request's wire), actions,
        latches and errors. None for a request without dynamic steering."""
        if not self.requests:  # none in flight (`finish`): nothing to settle for this one
            return None
        self.sync_device()
        self.decide_pending()
        dr = self.requests.get(req_id)
        if dr is None:
            return None
        cols = [trace.columns(entries) for entries in dr.trace]
        # as columns, the policies travel as their indices in the request's wire (the client
        # holds their JSON: `trace.expand`), not as one JSON with its vector per request
        pols = {"policy_index": list(dr.wire_index)} if columns else {"policies": [p.spec.to_api() for p in dr.policies]}
        out = {**pols, **({"trace_columns": cols} if columns else {"trace": [trace.dicts(c) for c in cols]}),
               "actions": dr.actions,
               "conversation_id": dr.conversation_id, "latched": [s.latched for s in dr.states], "errors": list(dr.errors)}
        if dr.gate is not None:
            out["gates"] = {**dr.gate.summary(), "trace": dr.gate_trace}
        return out

    # ---- per step ---------------------------------------------------------------------------
    def idle(self) -> None:
        """No dynamic request left: release the slots the last dynamic step held (at once when
        nothing is left of one: every step of an engine without dynamic steering calls this)."""
        if (self._replay is None and self._replaying is None and self._pending is None and not self._chain_log
                and not self._held_decisions and not self._held and not self._monitors and not self._gated
                and self._score_plan is None):
            return
        self.sync_device()
        self.decide_pending()
        if self._held:
            held, self._held = self._held, []
            self.st.slots.release(held)
        self._monitors = []
        self._gated = []
        self._score_plan = None
        self._replay = self._replaying = None
        self._version += 1

    def plan_rows_begin(self, planner: Any, req_ids, qsl, num_computed, hs: np.ndarray, hc: np.ndarray, n_cap: int):
        """Phase 1 of this step's dynamic plan (below). Returns (max row written + 1, capture rows
        used, `finish`); `finish()` runs phases 2 and 3 and returns (max row written + 1, checksum
        actions). The planner calls `finish` before the upload, at once or, on vLLM's V2 runner,
        right before the forward is launched (`StepPlanner.plan_step(defer=True)`), so that the
        runner's own preparation of the step also runs before the wait.

        In three phases, so that little is left between the wait for the previous step's scores
        (on a GPU, the end of the previous forward) and the upload:

        1. before the wait: the monitors' capture rows (they depend on no decision), and the actions
           of every window whose scales are known: no decision pending for its request, or one
           taken ahead (`_speculate`: a request whose policies are all threshold policies applies
           the scales they hold at, the common case: an engaged policy staying engaged);
        2. the wait, then the pending decisions (`decide_pending`): one taken ahead is checked
           (`PolicyState.holds`; its bookkeeping waits for `_settle`), any other is taken;
        3. the actions of the other windows, and of each window whose decision taken ahead did not
           hold (its action undone first).

        The checksum's actions are listed in batch order whatever the phase that applied them.
        The bookkeeping of the decisions that held is done after the step's forward is launched
        (`after_forward`)."""
        self._settle(chain=False)
        rp, self._replay = self._replay, None
        if rp is not None and self.replay_enabled:
            if rp.dev is not None:
                got = self._device_begin(rp, planner, req_ids, qsl, num_computed, hs, hc, n_cap)
            else:
                got = self._replay_begin(rp, planner, req_ids, qsl, num_computed, hs, hc, n_cap)
            if got is not None:
                return got
        self._settle()  # the chain's bookkeeping, before any step planned request by request
        if rp is not None and rp.dev is not None:
            self._end_device(rp)  # the host goes on from the device's decisions
        ctx = (req_ids, np.array(qsl), np.array(num_computed), hs[: int(qsl[-1])].copy(), n_cap,
               self.rejected, self._version) if self.replay_enabled and requests_decode_only(qsl, req_ids) else None
        held_before, self._held = self._held, []
        self._monitors = []
        self._gated = []
        max_row = 0
        requests = self.requests
        work = self._pending[0] if self._pending is not None else ()
        ahead = self._speculate(work)  # id(request) -> the position whose decision is taken ahead
        deciding = {id(w[0]): w[1] for w in work}  # positions the pending scores decide
        # per window: [request, first row, first position, rows, actions (None: not applied yet), undo]
        windows: list[list] = []
        if requests:
            starts = qsl.tolist() if hasattr(qsl, "tolist") else list(qsl)
            computed = num_computed.tolist() if hasattr(num_computed, "tolist") else list(num_computed)
            owns_site = self.st.owns_site
            for i, rid in enumerate(req_ids):
                dr = requests.get(rid)
                if dr is None or not (dr.policies or dr.gate_actions):
                    continue
                row0, p0 = starts[i], computed[i]
                n = starts[i + 1] - row0
                if n <= 0:
                    continue
                win = [dr, row0, p0, n, None, None]
                windows.append(win)
                last = p0 + n - 1
                if (dr.monitor_sites and last >= dr.n_prompt - 1
                        and last > max(dr.last_scored, deciding.get(id(dr), -1))):
                    row = row0 + n - 1
                    first = len(self._monitors)
                    for site in dr.monitor_sites:
                        if not owns_site(site):
                            continue
                        idx = hc.item(row, site)
                        if idx < 0:
                            if n_cap >= planner.b.max_capture_rows:
                                # not scored at all (no decision on part of the scores): the rows
                                # already handed out to it stay unread
                                dr.errors.append(f"position {last}: no capture row left for the probe; not scored")
                                del self._monitors[first:]
                                break
                            idx = hc[row, site] = n_cap
                            n_cap += 1
                        self._monitors.append((dr, last, site, idx))
                    if row >= max_row:
                        max_row = row + 1
                if dr.gate is None and (id(dr) not in deciding or (n == 1 and ahead.get(id(dr)) == p0 - 1)):
                    if n == 1 and not any(dr.decided.get(p0) or ()):  # a decode row with nothing engaged
                        win[4], win[5] = [], []
                        continue
                    got = self._apply_window(planner, dr, row0, p0, n, hs, speculative=id(dr) in ahead)
                    if got is not None:
                        win[4], win[5], top, _ = got
                        max_row = max(max_row, top)
        return max_row, n_cap, lambda: self._plan_rows_finish(planner, hs, windows, ahead, held_before, ctx)

    def _plan_rows_finish(self, planner: Any, hs: np.ndarray, windows: list[list], ahead: dict[int, int],
                          held_before: list[int], ctx: tuple | None = None) -> tuple[int, list]:
        """Phases 2 and 3 of `plan_rows_begin`; then, for a steady decode step (`ctx`), the
        record of it that the next step may repeat (`Replay.build`)."""
        max_row = 0
        flipped = self.decide_pending(record=False, ahead=ahead)  # the previous step's decisions apply from this step
        # requests whose monitor rows were handed out (a row refused for lack of capture rows: the
        # position is not scored, so not decided; the error says so)
        monitored = {id(m[0]) for m in self._monitors}
        for win in windows:
            dr, row0, p0, n, acts, undo = win
            if acts is not None and id(dr) in flipped:
                self._undo(dr, acts, undo, hs)
                acts = None
            if acts is not None:
                continue
            win[4], _, top, gated_last = self._apply_window(planner, dr, row0, p0, n, hs, speculative=False)
            max_row = max(max_row, top)
            last = p0 + n - 1
            if last < dr.n_prompt - 1 or last <= dr.last_scored:
                continue
            if dr.monitor_sites and id(dr) not in monitored:
                continue
            if gated_last:
                # the op writes the row gate's (score, g) of this row: read after the forward (with
                # the host probes' scores of this row, if the request has any)
                self._gated.append((dr, last, row0 + n - 1))
            elif not dr.monitor_sites:
                # gates that read no host probe (`always`, `this_token`): decided without a score
                self._decide(dr, last, [])
        actions = [a for win in windows for a in win[4]]
        self.st.slots.release(held_before)
        self.actions += len(actions)
        if ctx is not None and not flipped and windows:
            rp = self._replay = Replay.build(self, ctx, windows, hs)
            if rp is not None and self._decide_on_device(rp):
                self._settle()  # the table starts from the states after this step's decisions
                try:
                    rp.dev = DeviceDecisions(self, rp, hs)
                except NotEligible:
                    rp.dev = None
        return max_row, actions

    def step_monitors(self) -> list[tuple[DynRequest, int, int, int]]:
        """The monitors of the step planned last, not yet scored: (request, position, site index,
        capture row) — for tests and tools (a repeated step keeps them in its `Replay`)."""
        if self._replaying is not None:
            rp, positions = self._replaying
            return [(dr, p, site, idx) for dr, p, site, idx in
                    zip(rp.drs, positions.tolist(), rp.m_sites.tolist(), rp.m_idx.tolist())]
        return list(self._monitors)

    def _speculate(self, work) -> dict[int, int]:
        """Take ahead the pending decisions of requests whose policies are all threshold policies
        (no gates: `DynRequest.speculable`): each is assumed to hold (`PolicyState.holds`), so the
        scales at the next position are the current ones, written to `decided` now and checked
        after the wait. Returns id(request) -> the position decided."""
        ahead: dict[int, int] = {}
        for dr, pos, picks, gp in work:
            if not dr.speculable or gp is not None or None in picks:
                continue
            dr.decided[pos + 1] = tuple([st.current_scale() for st in dr.states])
            ahead[id(dr)] = pos
        return ahead

    def _apply_window(self, planner: Any, dr: DynRequest, row0: int, p0: int, n: int, hs: np.ndarray,
                      speculative: bool):
        """Apply the decided scales over a window. Returns (checksum actions, undo records, max row
        written + 1, whether a row gate acts on the window's last row); None when `speculative`
        and an action could not be applied (nothing is left applied or recorded: the window waits
        for its checked decision). Undo records (speculative only): (row, the row's slots before,
        the slots acquired)."""
        acts: list[tuple[int, int, int]] = []
        undo: list[tuple[int, np.ndarray, list[int]]] = []
        top = 0
        gated_last = False
        p1 = p0 + n
        if p1 > dr.n_prompt and dr.decided:
            decided = dr.decided
            for p in range(max(p0, dr.n_prompt), p1):
                scales = decided.get(p)
                if scales is None or not any(scales):
                    continue
                if planner.skip_next_action:  # test-only fault: this rank skips one action
                    planner.skip_next_action = False
                    continue
                row = row0 + p - p0
                if speculative:
                    before, start = hs[row].copy(), len(self._held)
                got = self._apply(dr, row, scales, hs, quiet=speculative)
                if got is None:
                    if speculative:
                        self._undo(dr, acts, undo, hs)
                        return None
                    continue
                if speculative:
                    undo.append((row, before, self._held[start:]))
                crc, gated = got
                acts.append((crc, p, p + 1))
                dr.actions += 1
                top = max(top, row + 1)
                gated_last |= gated and p == p1 - 1
        return acts, undo, top, gated_last

    def _undo(self, dr: DynRequest, acts: list, undo: list, hs: np.ndarray) -> None:
        """Take back a window's speculative actions (its decision taken ahead did not hold)."""
        for row, before, slots in reversed(undo):
            hs[row] = before
            self.st.slots.release(slots)
            for slot in slots:
                self._held.remove(slot)
        dr.actions -= len(acts)

    def _apply(self, dr: DynRequest, row: int, scales: tuple[float, ...], hs: np.ndarray,
               quiet: bool = False) -> tuple[int, bool] | None:
        """Compose the engaged policies at their sites on `row`; the action's crc and whether a
        row gate acts on it, or None when rejected (`quiet`: without recording the rejection)."""
        slots = self.st.slots
        plan = self._action_plan(dr, row, scales, hs)
        if isinstance(plan, str):
            return None if quiet else self._reject(dr, plan)
        entries, crc, gated = plan
        acquired: list[tuple[int, int]] = []
        try:
            for site, key, make in entries:
                acquired.append((site, slots.acquire(key, make)))
        except SlotCapacityError as exc:
            slots.release([s for _, s in acquired])
            return None if quiet else self._reject(dr, str(exc))
        held = self._held
        for site, slot in acquired:
            hs[row, site] = slot
            held.append(slot)
        return crc, gated

    def _layout(self, dr: DynRequest, scales: tuple[float, ...]) -> tuple[tuple[int, ...], bool]:
        """The sites an action with `scales` writes on this worker (sorted) and whether the row
        gate acts there. Cached per scales for requests without a row gate (whether a row gate
        acts also depends on its gate's state)."""
        got = dr.layouts.get(scales)
        if got is not None:
            return got
        owns_site = self.st.owns_site
        sites_set = {site for pol, scale in zip(dr.actors(), scales) if scale != 0.0
                     for site in pol.sites if owns_site(site)}
        row_gated = (dr.gate_site is not None and owns_site(dr.gate_site)
                     and dr.gate.row_gated(scales[len(dr.policies):]))
        if row_gated:
            sites_set.add(dr.gate_site)
        got = (tuple(sorted(sites_set)), row_gated)
        if dr.gate_site is None:
            if len(dr.layouts) > 64:
                dr.layouts.clear()
            dr.layouts[scales] = got
        return got

    def _action_plan(self, dr: DynRequest, row: int, scales: tuple[float, ...], hs: np.ndarray):
        """What `_apply` acquires for `scales` on `row` — per site (slot key, make) — the
        action's crc (request key, sites, payload crcs, the row gate's content) and whether a row
        gate acts; or the reason it cannot be composed. Cached per (scales, whether the row gate
        acts, the content keys of the slots already on the row's sites).

        The row gate (the fork's `this_token` probe gate): where the request's gate components
        apply, the slot at the gate's probe site carries a gate row whose term is the request's
        row there (`GateSet.row_term`); the op scales that term by the same position's `g`."""
        slots = self.st.slots
        sites, row_gated = self._layout(dr, scales)
        item = hs.item
        bases = [item(row, site) for site in sites]
        # the row gate's term is a function of the scales: (scales, whether the gate acts, the
        # bases' content keys) decides the whole plan, so the term is only built on a miss
        key_of = slots.key_of
        sig = (scales, row_gated, tuple([key_of(b) if b >= 0 else None for b in bases]))
        got = dr.actions_cache.get(sig)
        if got is not None:
            return got
        gscales = scales[len(dr.policies):]
        gate = None
        if row_gated:
            term = dr.gate.gs.row_term(gscales, dr.gate.gs.gates[dr.gate.gs.row_gate].probe.site)
            probe, thr, sharp = dr.gate_row
            term = np.zeros_like(probe) if term is None else term
            gkey = ("gate", *dr.gate_row_key, zlib.crc32(term.astype("<f4").tobytes()))
            gate = (dr.gate_site, gkey, dict(gate_probe=probe, gate_threshold=thr, gate_sharpness=sharp,
                                             gate_term=term, gate_key=gkey))
        by_site: dict[int, list[tuple[np.ndarray, np.float32, int]]] = {site: [] for site in sites}
        owns_site = self.st.owns_site
        for pol, scale in zip(dr.actors(), scales):
            if scale == 0.0:
                continue
            for site, vec, s32, crc in pol.parts(scale):
                if owns_site(site):
                    by_site[site].append((vec, s32, crc))
        desc = [dr.key]
        entries = []
        for (site, parts), base in zip(sorted(by_site.items()), bases):
            base_val = slots.value_of(base) if base >= 0 else None
            if base_val is not None and base_val.mode != SlotMode.AFFINE:
                return f"position has a stored-pair patch at site {site}; dynamic steering cannot compose with it"
            g = gate[2] if gate is not None and gate[0] == site else {}
            key = ("dyn", slots.key_of(base) if base >= 0 else None, tuple(c for _, _, c in parts), g.get("gate_key"))

            def make(base_val=base_val, parts=parts, g=g):
                c = None if base_val is None or base_val.c is None else base_val.c.astype(np.float32)
                for vec, s32, _ in parts:
                    add = payload(vec, s32)
                    c = add if c is None else c + add
                if base_val is None:
                    return SlotValue(SlotMode.AFFINE, a=1.0, c=c, **g)
                # keep the base's per-dimension a (a dimension-masked patch) and its directional clamps
                # (applied after this add, as the fork orders them), with their content keys
                return dataclasses.replace(base_val, c=c, **g)

            entries.append((site, key, make))
            desc.append(f"{site}:{','.join(f'{c:08x}' for _, _, c in parts)}")
            if g:
                _, pcrc, thr, sharp, tcrc = g["gate_key"]
                desc.append(f"gate:{site}:{pcrc:08x}:{thr}:{sharp}:{tcrc:08x}")
        if len(dr.actions_cache) > 64:  # proportional control: a new scale nearly every step
            dr.actions_cache.clear()
        got = dr.actions_cache[sig] = (entries, zlib.crc32("|".join(desc).encode()), gate is not None)
        return got

    def _reject(self, dr: DynRequest, reason: str) -> None:
        self.rejected += 1
        msg = f"dynamic action rejected: {reason}"
        if msg not in dr.errors:
            dr.errors.append(msg)
        return None

    def after_forward(self) -> None:
        """Score the monitored rows on the device and start copying the scores to the host. The
        copy is not waited for here: the decisions are taken when they are first needed
        (`decide_pending`: at the start of the next step's planning, or before a result or the
        status is read), so on a GPU the host keeps running ahead of the forward until the next
        step's plan needs them. The bookkeeping of the decisions this step's plan took ahead is
        done first (the forward they steer is launched already)."""
        self.decide_pending(chain=False)
        rpl, self._replaying = self._replaying, None
        if rpl is not None:  # a repeated step: the last step's layout, one position further
            rp, positions = rpl
            flat = self._scores(rp.sp, True, False, graph=True)
            if rp.dev is not None:  # decided on the device, read back later
                if not rp.dev.after_forward(rp, positions, flat):
                    self.device_decisions = False
                rp.armed = True
                return
            work = _ReplayWork(rp.sp.work, positions)
            rp.work, rp.armed = work, True
            self._start_copy(work, flat)
            return
        if not self._monitors and not self._gated:
            return
        monitors, self._monitors = self._monitors, []
        gated, self._gated = self._gated, []
        # the layout of this step's scores: the same as the last step's in a steady decode
        key = ([(m[0], m[2], m[3]) for m in monitors], [(g[0], g[2]) for g in gated])
        sp = self._score_plan
        if sp is None or sp.key != key or not sp.current(self.probes):
            sp = self._score_plan = _ScorePlan(key, self.probes)
        flat = self._scores(sp, bool(monitors), bool(gated))
        work = [(dr, (monitors if from_monitor else gated)[i][1], picks, gp)
                for dr, from_monitor, i, picks, gp in sp.work]
        rp = self._replay
        if rp is not None and not rp.armed:  # built by this step's plan: may the next step repeat it?
            rp.arm(sp, work)
            if rp.dev is not None:
                if rp.armed:  # from now on the device decides
                    rp.dev.after_forward(rp, [m[1] for m in monitors], flat)  # nothing to take back yet
                    return
                self._end_device(rp)
        self._start_copy(work, flat)

    def _scores(self, sp: "_ScorePlan", monitors: bool, gated: bool, graph: bool = False) -> torch.Tensor:
        """The step's scores on the device, flat in `sp`'s layout. With `graph` (a chain of
        repeated steps, decided on the device or on the host), on CUDA, once the layout has been
        scored `step_graphs.AFTER` times that way, as one CUDA graph replay (bit for bit the eager
        scores; its output is overwritten by the next replay: consumed on this stream before the
        next step's scores, by the device decisions or the host copy)."""
        if graph and monitors and not gated and sp.views and self.step_graphs_on:
            if sp.graph is not None:
                self.graph_replays += 1
                return sp.graph.replay()
            flat = self._scores_eager(sp, True, False)
            if flat.is_cuda:
                sp.eager_runs += 1
                if sp.pending is not None:  # captured at an earlier step: replayed once its check is in
                    verdict = sp.pending.verdict()
                    if verdict is not None:
                        graph, sp.pending = sp.pending.graph, None
                        if verdict:
                            sp.graph = graph
                        else:
                            logger.warning("causalboard: a CUDA graph of the probe scores differed from the eager "
                                           "scores; scoring eagerly from now on")
                            self.step_graphs_on = False
                elif sp.eager_runs == step_graphs.AFTER:
                    sp.pending = step_graphs.capture_scores(lambda: self._scores_eager(sp, True, False), flat,
                                                            keep=tuple(pr for pr, _ in sp.probe_rows))
                    if sp.pending is None and not torch.cuda.is_current_stream_capturing():
                        self.step_graphs_on = False
            return flat
        return self._scores_eager(sp, monitors, gated)

    def _scores_eager(self, sp: "_ScorePlan", monitors: bool, gated: bool) -> torch.Tensor:
        b = self.st.buffers
        blocks = []
        if monitors:
            # [m, H] in fp32: x + r (r converted exactly inside the add: one launch fewer than
            # converting it first; a copy, so the capture buffer itself is never written)
            vals = _rows(b.cap_x, sp.cap_rows).to(torch.float32, copy=True).add_(_rows(b.cap_r, sp.cap_rows))
            for pr, rows in sp.probe_rows:
                blocks.append((_rows(vals, rows) @ pr.w.T + pr.b).flatten())
        if gated:  # the row gates' (score, g) the op wrote for the gated rows, after the scores
            blocks.append(_rows(b.gate_out, sp.gate_rows).flatten())
        return blocks[0] if len(blocks) == 1 else torch.cat(blocks) if blocks else torch.zeros(0, device=b.device)

    def _start_copy(self, work: list, flat: torch.Tensor) -> None:
        """Leave the step's decisions pending on `flat` (on CUDA, copied to the host, not waited for)."""
        if flat.device.type == "cuda":  # the step's one small device-to-host copy, not waited for
            # into one pinned buffer and with one event, both reused: the previous step's copy was
            # waited for and read (`decide_pending`, above) before this one is issued
            n = flat.numel()
            if self._host_scores is None or self._host_scores.numel() < n:
                self._host_scores = torch.empty(max(n, 1024), dtype=torch.float32, device="cpu", pin_memory=True)
                self._score_event = torch.cuda.Event()
            host = self._host_scores[:n]
            host.copy_(flat, non_blocking=True)
            cuda_streams.record(self._score_event, self.st.buffers.cuda_index)
            self._pending = (work, host, self._score_event)
        else:  # CPU: the scores are computed already; the decisions are still taken when needed (same path)
            self._pending = (work, flat, None)

    def decide_pending(self, record: bool = True, ahead: dict[int, int] | None = None, chain: bool = True) -> set[int]:
        """Take the decisions of the last scored step (waits for its scores' copy). A decision
        taken ahead (`ahead`, from `_speculate`) is checked: if every policy holds, its bookkeeping
        is queued for `_settle`; else it is taken here (it overwrites the scales written ahead).
        With `record`, everything queued is settled too (the step's `finish` leaves that for later;
        `chain=False`: a chain of repeated steps' bookkeeping stays queued, `_flush_chain`, unless
        decisions are taken here: those always come after it).
        Returns the ids of the requests whose decision taken ahead did not hold."""
        flipped: set[int] = set()
        # a chain's bookkeeping comes before any decision taken request by request: with
        # `chain=False` it stays queued only while nothing is decided here (a step with no plan,
        # as vLLM's asynchronous scheduling runs once a batch has reached its last tokens, takes
        # a chain's last scores from `after_forward`)
        if chain or self._pending is not None:
            self._flush_chain()
        if self._pending is not None:
            work, host, event = self._pending
            self._pending = None
            if event is not None:
                event.synchronize()
            flat = host.tolist()
            for dr, pos, picks, gp in work:
                if ahead and id(dr) in ahead:
                    scores = [flat[pick] for pick in picks]
                    states = dr.states
                    if (states[0].holds(scores[0]) if len(states) == 1
                            else all([st.holds(x) for st, x in zip(states, scores)])):
                        self._held_decisions.append((dr, pos, scores))
                        continue
                    flipped.add(id(dr))
                    self._decide(dr, pos, scores)
                    continue
                self._decide(dr, pos, [None if pick is None else flat[pick] for pick in picks],
                             None if gp is None else (flat[gp], flat[gp + 1]))
        if record:
            self._settle(chain)
        return flipped

    def _settle(self, chain: bool = True) -> None:
        """The bookkeeping of the decisions taken ahead that held (`_decide` with `held`), in
        the order taken: a chain of repeated steps' first (`_flush_chain`; `chain=False` leaves
        it queued: only the next repeated step may come before it)."""
        if chain:
            self._flush_chain()
        if self._held_decisions:
            held, self._held_decisions = self._held_decisions, []
            for dr, pos, scores in held:
                self._decide(dr, pos, scores, held=True)

    def _decide(self, dr: DynRequest, pos: int, scores: list[float | None],
                row_gate: tuple[float, float] | None = None, held: bool = False) -> None:
        """The decisions taken on position `pos` (`scores`: one per `dr.score_refs()`), applied at
        `pos + 1`. `row_gate`: the (score, g) the op's row gate used at `pos` (the trace's).
        `held`: a decision taken ahead whose scores all held (`PolicyState.holds`): each policy
        holds (`PolicyState.hold`, equal to `decide` on such a score) with the same bookkeeping."""
        dr.last_scored = max(dr.last_scored, pos)
        applied = dr.decided.get(pos)
        nxt = []
        for k, (pol, state, score) in enumerate(zip(dr.policies, dr.states, scores)):
            if score is None:
                msg = f"dynamic policy {k}: probe {pol.spec.probe!r} was deleted while the request ran"
                if msg not in dr.errors:
                    dr.errors.append(msg)
                nxt.append(state.current_scale())
                continue
            threshold = state.threshold()
            nxt.append(state.hold() if held else state.decide(score))
            dr.trace[k].append((pos, score, threshold, applied[k] if applied is not None else 0.0))
            if state.latched and pol.spec.latch == "conversation" and dr.conversation_id is not None:
                self._latch(dr.conversation_id, pol.ident)
        if dr.gate is not None:
            gate_scores = list(scores[len(dr.policies):])
            per_gate = [gate_scores.pop(0) if g.probe is not None and not g.soft else None for g in dr.gate.gs.gates]
            here = applied[len(dr.policies):] if applied is not None else (0.0,) * len(dr.gate_actions)
            new = dr.gate.decide(pos, per_gate)
            nxt += list(new)
            soft: list[float | None] = [None] * len(per_gate)
            if row_gate is not None:  # the row gate's in-graph score and g at this position
                k = dr.gate.gs.row_gate
                per_gate[k], soft[k] = row_gate
            dr.gate_trace.append({"position": pos, "scores": per_gate, "armed": dr.gate.armed,
                                  "scales": list(here), "soft": soft})
        dr.decided[pos + 1] = tuple(nxt)

    def _latch(self, conv: str, ident: str) -> None:
        self.latches.setdefault(conv, set()).add(ident)
        self.latches.move_to_end(conv)
        while len(self.latches) > MAX_CONVERSATIONS:
            self.latches.popitem(last=False)

    # ---- status -----------------------------------------------------------------------------
    def status(self) -> dict:
        self.sync_device(end=False)
        self.decide_pending()
        return {"probes": sorted(n for n in self.probes if not n.startswith("~")), "requests": len(self.requests),
                "engaged_requests": sorted(dr.key for dr in self.requests.values() if dr.engaged()),
                "latched_conversations": len(self.latches), "dynamic_actions": self.actions,
                "rejected_actions": self.rejected, "replayed_steps": self.replayed_steps,
                "graph_replays": self.graph_replays, "graph_captures": step_graphs.captures,
                "graph_capture_ms": round(step_graphs.capture_seconds * 1e3, 1)}


class _ScorePlan:
    """Where a step's scores come from and go (built by `after_forward` when the monitored and
    gated rows differ from the last step's, or a probe they read changed): the capture rows read,
    each probe's rows among them (one matmul per probe), the gated rows, and per request the flat
    index of each score its decision needs (`work`: request, from a monitor (else a gated row),
    index of that entry, picks, row gate's pick)."""

    def __init__(self, key: tuple[list, list], probes: dict[str, _Probe]):
        self.key = key
        monitors, gated = key
        self.cap_rows = [idx for _, _, idx in monitors]
        wanted: dict[str, list[int]] = {}
        row_of: dict[tuple[int, int], int] = {}  # (id(request), site) -> row among the monitored
        names: dict[str, None] = {}
        for j, (dr, site, _) in enumerate(monitors):
            row_of[(id(dr), site)] = j
            for name, _ in dr.score_refs():
                names[name] = None
                pr = probes.get(name)
                if pr is not None and pr.site == site:
                    rows = wanted.setdefault(name, [])
                    if not rows or rows[-1] != j:  # j ascends: a repeat can only be the last
                        rows.append(j)
        #: the probe objects the layout was built with (a probe replaced or deleted: rebuilt)
        self.probes = [(name, probes.get(name)) for name in names]
        self.probe_rows: list[tuple[_Probe, list[int]]] = []
        layout: dict[tuple[str, int], int] = {}
        offset = 0
        for name, rows in wanted.items():
            pr = probes[name]
            self.probe_rows.append((pr, rows))
            for r_i, j in enumerate(rows):
                layout[(name, j)] = offset + r_i * pr.spec.size
            offset += len(rows) * pr.spec.size
        self.gate_rows = [row for _, row in gated]
        gpick = {id(dr): offset + 2 * i for i, (dr, _) in enumerate(gated)}
        self.work: list[tuple[DynRequest, bool, int, list[int | None], int | None]] = []
        done: set[int] = set()
        for i, (dr, _, _) in enumerate(monitors):
            if id(dr) in done:
                continue
            done.add(id(dr))
            picks: list[int | None] = []
            for name, component in dr.score_refs():
                pr = probes.get(name)
                j = row_of.get((id(dr), pr.site)) if pr is not None else None
                picks.append(None if j is None else layout[(name, j)] + component)
            self.work.append((dr, True, i, picks, gpick.get(id(dr))))
        for i, (dr, _) in enumerate(gated):  # gated requests without a host probe
            if id(dr) not in done:
                done.add(id(dr))
                self.work.append((dr, False, i, [], gpick[id(dr)]))

        #: every row it reads is a contiguous run (views only: `step_graphs` may capture it), the
        #: eager scorings in a row, and the graph once captured
        self.views = _is_run(self.cap_rows) and all(_is_run(rows) for _, rows in self.probe_rows)
        self.eager_runs = 0
        self.graph: step_graphs.ScoreGraph | None = None
        #: captured, its check against the eager scores not yet read (`step_graphs.capture_scores`)
        self.pending: step_graphs.PendingScoreGraph | None = None

    def current(self, probes: dict[str, _Probe]) -> bool:
        """Are the probes the layout read still the registered ones?"""
        return all(probes.get(name) is pr for name, pr in self.probes)


def _is_run(rows: list[int]) -> bool:
    """Are `rows` one contiguous ascending run (`_rows` gives a view)?"""
    return bool(rows) and rows == list(range(rows[0], rows[0] + len(rows)))


def _rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """`t[rows]` without a blocking host-to-device copy: a view when the rows are one contiguous
    ascending run (the monitors' capture rows usually are), else an index copied from pinned
    memory without waiting (a plain `.to(device)` of a host index would wait for the forward)."""
    if _is_run(rows):
        return t[rows[0]: rows[0] + len(rows)]
    return t.index_select(0, to_device_async(torch.tensor(rows, dtype=torch.long), t.device))
