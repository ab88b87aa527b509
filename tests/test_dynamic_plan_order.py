"""Fast tier (no engine): the order inside the dynamic plan (`DynamicWorker.plan_rows_begin` and its
`finish`, driven through `WorkerState.plan_step`). The monitors' capture rows are handed out
before the previous step's decisions are taken, and the decisions' trace entries are recorded
after the step's forward is launched; neither may change what is scored, decided or traced; a
monitor row refused for lack of capture rows leaves that position unscored, nothing misread. Driven on a CPU `WorkerState` with the decode steps of
`benchmarks/dynamic_planner_bench.py` (no forward: the capture rows hold fixed random values)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_ext.dynamic.specs import DYNAMIC_ARGS_KEY, DynamicRequest, Policy, Probe
from engine_ext.program import ModelDims, PromptInfo, compile_program, program_to_extra_args
from engine_ext.specs import Interventions, canonical_json
from engine_ext.worker.state import WorkerConfig, WorkerState

L, H, PROMPT, N = 4, 32, 6, 3


def _state(dyn: DynamicRequest) -> WorkerState:
    st = WorkerState(L, H, 256, torch.device("cpu"), torch.float32, WorkerConfig(max_capture_rows=64))
    rng = np.random.default_rng(0)
    st.dynamic.set_probe(Probe.make("p", "L2.post_block", direction=rng.standard_normal(H)).to_json())
    st.buffers.cap_x.copy_(torch.from_numpy(rng.standard_normal(tuple(st.buffers.cap_x.shape)).astype(np.float32)))
    for i in range(N):
        prog = compile_program(Interventions(), PromptInfo(list(range(PROMPT)), None, None, 32), ModelDims(L, H, 100, 0.02),
                               key=f"k{i}", named_vector_dims=lambda n: None)
        extra = program_to_extra_args(prog)
        extra[DYNAMIC_ARGS_KEY] = canonical_json(dyn.wire(()))
        st.register(f"r{i}", extra)
    return st


def _plan(st: WorkerState, positions: list[int]) -> None:
    """A decode step's plan: request i computes position positions[i] (one row each)."""
    st.plan_step([f"r{i}" for i in range(N)], np.arange(N + 1, dtype=np.int32), np.asarray(positions, np.int32))


def test_traces_monitors_and_decisions_line_up_step_by_step():
    # engaged from the first score on: the scores are fixed random values of either sign
    pol = Policy.make(probe="p", sites=["L1.post_attn"], vector=np.ones(H, np.float32) * 0.1, on=-1e30)
    st = _state(DynamicRequest.make([pol]))
    st.plan_step([f"r{i}" for i in range(N)], np.arange(0, PROMPT * N + 1, PROMPT, dtype=np.int32), np.zeros(N, np.int32))
    st.after_forward()
    for step in range(5):
        _plan(st, [PROMPT + step] * N)
        # one monitor row per request and step, for the position this step computes
        assert [(m[1], m[3]) for m in st.dynamic.step_monitors()] == [(PROMPT + step, i) for i in range(N)]
        st.after_forward()
    for i in range(N):
        res = st.dynamic.result(f"r{i}")
        trace = res["trace"][0]
        # the prompt's last position, then every decode position, each once and in order
        assert [e["position"] for e in trace] == list(range(PROMPT - 1, PROMPT + 5))
        # engaged where the decision taken one position earlier applied (the first: nothing yet)
        assert [e["engaged"] for e in trace] == [False] + [True] * 5
        assert res["actions"] == 5 and not res["errors"]
    # the first decode step engages (a decision that flips): planned request by request, as is the
    # second (it builds the record); the other three repeat it (`Replay`)
    assert st.dynamic.replayed_steps == 3 and st.dynamic.replay_fallbacks == 0


def test_a_position_recomputed_while_its_decision_is_pending_is_not_scored_twice():
    pol = Policy.make(probe="p", sites=["L1.post_attn"], vector=np.ones(H, np.float32) * 0.1, on=1e30)
    st = _state(DynamicRequest.make([pol]))
    st.plan_step([f"r{i}" for i in range(N)], np.arange(0, PROMPT * N + 1, PROMPT, dtype=np.int32), np.zeros(N, np.int32))
    st.after_forward()
    _plan(st, [PROMPT] * N)
    st.after_forward()  # scores position PROMPT; its decisions are pending now
    assert st.dynamic._pending is not None
    # the same position again (a recomputation) before those decisions are taken: no monitor row
    _plan(st, [PROMPT] * N)
    assert st.dynamic.step_monitors() == []
    st.after_forward()
    _plan(st, [PROMPT + 1] * N)
    assert [m[1] for m in st.dynamic.step_monitors()] == [PROMPT + 1] * N
    st.after_forward()
    trace = st.dynamic.result("r0")["trace"][0]
    assert [e["position"] for e in trace] == [PROMPT - 1, PROMPT, PROMPT + 1]


def test_a_status_read_between_steps_sees_every_decision_taken():
    pol = Policy.make(probe="p", sites=["L1.post_attn"], vector=np.ones(H, np.float32) * 0.1, on=-1e30)
    st = _state(DynamicRequest.make([pol]))
    st.plan_step([f"r{i}" for i in range(N)], np.arange(0, PROMPT * N + 1, PROMPT, dtype=np.int32), np.zeros(N, np.int32))
    st.after_forward()
    # a plan takes the prompt's decisions; before this step's after_forward, a result is read
    _plan(st, [PROMPT] * N)
    assert [e["position"] for e in st.dynamic.result("r1")["trace"][0]] == [PROMPT - 1]
    assert st.dynamic.status()["engaged_requests"] == ["k0", "k1", "k2"]


_HYSTERESIS_SCORES = {"r0": [-1.0, 1.0, 1.0, 0.0, -1.0, -1.0, 1.0, 0.0],
                      "r1": [1.0, 0.0, -1.0, 0.0, 1.0, 1.0, -1.0, 1.0],
                      "r2": [0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]}
_HYSTERESIS = Policy.make(probe="p", sites=["L1.post_attn"], vector=np.ones(H, np.float32) * 0.1, on=0.5, off=-0.5)


def _run_hysteresis(defer: bool) -> tuple[WorkerState, dict[str, list[bool]]]:
    """Drive three requests through the decode steps of `_HYSTERESIS_SCORES` (each score written
    into the monitored capture row before `after_forward`). Returns the state and, per request and
    step, whether the plan steered its row. `defer`: each step planned as on vLLM's V2 runner
    (`plan_step(defer=True)`, then `finish_step` right before the forward)."""
    from engine_ext.sites import Site

    st = _state(DynamicRequest.make([_HYSTERESIS]))
    direction = np.asarray(st.dynamic.probes["p"].w[0])
    steer_site = Site(1, "post_attn").index()
    scores = _HYSTERESIS_SCORES

    def score_rows(step: int) -> None:  # the score each monitored row will read (fp32 rounding aside)
        for dr, _, _, idx in st.dynamic.step_monitors():
            st.buffers.cap_x[idx] = torch.from_numpy(direction * np.float32(scores[dr.req_id][step] / (direction @ direction)))
            st.buffers.cap_r[idx] = 0.0

    st.plan_step([f"r{i}" for i in range(N)], np.arange(0, PROMPT * N + 1, PROMPT, dtype=np.int32), np.zeros(N, np.int32))
    score_rows(0)
    st.after_forward()
    steered: dict[str, list[bool]] = {rid: [] for rid in scores}
    for step in range(len(scores["r0"]) - 1):
        if defer:
            assert st.plan_step([f"r{i}" for i in range(N)], np.arange(N + 1, dtype=np.int32),
                                np.full(N, PROMPT + step, np.int32), defer=True)
            # the monitors are handed out, the previous step's scores not yet waited for
            assert len(st.dynamic.step_monitors()) == N and st.dynamic._pending is not None
            assert st.planner._open is not None
            st.finish_step()
            assert st.planner._open is None and st.dynamic._pending is None
        else:
            _plan(st, [PROMPT + step] * N)
        for i, rid in enumerate(scores):
            steered[rid].append(bool(st.planner.hs[i, steer_site] >= 0))
        score_rows(step + 1)
        st.after_forward()
    st.dynamic.decide_pending()
    return st, steered


@pytest.mark.parametrize("defer", [False, True])
def test_decisions_taken_ahead_that_do_not_hold_are_undone_and_taken_exactly(defer):
    """Scores chosen per request and step (written into the monitors' capture rows) make threshold
    policies with hysteresis engage and release at known positions; the rows the plan steers, the
    trace and the action count follow `PolicyState.decide` run by hand, whether each step is
    planned at once or left open until `finish_step` (`defer`)."""
    from engine_ext.dynamic.policy import PolicyState

    st, steered = _run_hysteresis(defer)
    steps = len(_HYSTERESIS_SCORES["r0"]) - 1
    for rid, seq in _HYSTERESIS_SCORES.items():
        ref = PolicyState.start(_HYSTERESIS)
        engaged_at = [ref.decide(x) != 0.0 for x in seq]  # engaged at the position after each score
        assert steered[rid] == engaged_at[:steps], rid
        res = st.dynamic.result(rid)
        trace = res["trace"][0]
        assert [e["position"] for e in trace] == list(range(PROMPT - 1, PROMPT + steps))
        assert [e["engaged"] for e in trace] == [False] + engaged_at[:steps], rid
        assert np.allclose([e["score"] for e in trace], seq, atol=1e-4)
        assert res["actions"] == sum(engaged_at[:steps]) and not res["errors"]


def test_a_deferred_plan_equals_planning_at_once():
    """The same steps planned at once and deferred: the same rows steered, the same traces and
    the same checksum (the same actions folded in the same order)."""
    (a, steered_a), (b, steered_b) = _run_hysteresis(False), _run_hysteresis(True)
    assert steered_a == steered_b
    assert a.planner.checksum.status() == b.planner.checksum.status()
    assert a.planner.checksum.status()["action_count"] > 0
    for rid in _HYSTERESIS_SCORES:
        assert a.dynamic.result(rid)["trace"] == b.dynamic.result(rid)["trace"]


def _gated_state(policies: list, host_gate: bool, host_layer: int = 2) -> WorkerState:
    """`_state` with, per request, the given policies and a soft `this_token` row gate (plus, with
    `host_gate`, a `rest_of_request` gate whose probe, at layer `host_layer`, is scored on the host)."""
    import dataclasses

    from engine_ext.dynamic.gates import Gate, GateSet, SiteVectors
    from engine_ext.sites import Site

    rng = np.random.default_rng(1)
    site = Site(2, "post_block")

    def probe(name: str, site: Site = site) -> Probe:
        return Probe(name, site, "direction", rng.standard_normal((1, H)).astype(np.float32), np.zeros(1, np.float32))

    def steer() -> SiteVectors:
        return SiteVectors((Site(1, "post_attn"),), (rng.standard_normal(H).astype(np.float32) * 0.1,))

    gates = [Gate("this_token", "probe", probe("~soft"), 0.0, 4.0, "add", 1.0, steer())]
    if host_gate:
        gates.insert(0, Gate("rest_of_request", "probe", probe("~host", Site(host_layer, "post_block")), 1e30, 1.0, "add", 1.0, steer()))
    return _state(dataclasses.replace(DynamicRequest.make(policies), gates=GateSet(tuple(gates))))


@pytest.mark.parametrize("host_gate", [False, True], ids=["policy+soft-gate", "host-gate+soft-gate"])
def test_a_request_whose_monitor_row_is_refused_is_not_decided_as_gated_only(host_gate):
    """A request with host-probe scores (a policy's probe or a probe gate) and a soft row gate:
    when the step's capture rows run out and its monitor row is refused, the position is not
    scored (an error says so) and nothing is misread: no exception, the other requests' decisions
    and traces are the ones of a run with room enough, and the refused request goes on once rows
    are free again."""
    pol = Policy.make(probe="p", sites=["L1.post_attn"], vector=np.ones(H, np.float32) * 0.1, on=-1e30)
    policies = [] if host_gate else [pol]

    def run(shrink: bool) -> WorkerState:
        st = _gated_state(policies, host_gate)
        st.plan_step([f"r{i}" for i in range(N)], np.arange(0, PROMPT * N + 1, PROMPT, dtype=np.int32), np.zeros(N, np.int32))
        st.after_forward()
        for step in range(4):
            if shrink:  # step 1: room for the first request's monitor row only
                st.planner.b.max_capture_rows = 1 if step == 1 else 64
            _plan(st, [PROMPT + step] * N)
            st.after_forward()
        st.dynamic.decide_pending()
        return st

    full, short = run(False), run(True)
    first = short.dynamic.result("r0")
    assert not first["errors"] and first == full.dynamic.result("r0")
    for rid in ("r1", "r2"):
        res, ref = short.dynamic.result(rid), full.dynamic.result(rid)
        assert any("no capture row left" in e for e in res["errors"]), res["errors"]
        skipped = PROMPT + 1  # the position step 1 computed is not scored, nor decided
        gate_pos = [e["position"] for e in res["gates"]["trace"]]
        assert gate_pos == [p for p in (e["position"] for e in ref["gates"]["trace"]) if p != skipped]
        if not host_gate:
            pos = [e["position"] for e in res["trace"][0]]
            assert pos == [p for p in (e["position"] for e in ref["trace"][0]) if p != skipped]
            assert PROMPT + 3 in pos


def test_a_request_monitored_at_two_sites_with_one_row_refused_is_not_scored():
    """A policy's probe and a gate's probe at two sites; the step has one capture row: the first
    request gets it at the first site and none at the second, so no request is scored at that
    position (no decision on part of its scores, no 'probe deleted' misreport), and all go on."""
    pol = Policy.make(probe="p", sites=["L1.post_attn"], vector=np.ones(H, np.float32) * 0.1, on=-1e30)
    st = _gated_state([pol], host_gate=True, host_layer=3)
    st.plan_step([f"r{i}" for i in range(N)], np.arange(0, PROMPT * N + 1, PROMPT, dtype=np.int32), np.zeros(N, np.int32))
    st.after_forward()
    for step in range(3):
        st.planner.b.max_capture_rows = 1 if step == 1 else 64
        _plan(st, [PROMPT + step] * N)
        if step == 1:
            assert st.dynamic.step_monitors() == []
        st.after_forward()
    st.dynamic.decide_pending()
    for i in range(N):
        res = st.dynamic.result(f"r{i}")
        assert [e["position"] for e in res["trace"][0]] == [PROMPT - 1, PROMPT, PROMPT + 2]
        assert [e["position"] for e in res["gates"]["trace"]] == [PROMPT - 1, PROMPT, PROMPT + 2]
        assert res["errors"] == [f"position {PROMPT + 1}: no capture row left for the probe; not scored"]
