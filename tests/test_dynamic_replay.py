"""Fast tier (no engine): a steady decode step repeated (`engine_ext.dynamic.replay.Replay`)
plans exactly what planning it request by request does. The same scripted run — threshold
policies with hysteresis, a minimum hold and a latch, a request with static steering under the
dynamic action at two positions only, a static-only request, a request joining mid-run, one
finishing, one recomputed after a preemption, a status read between steps, deferred and
immediate plans — is driven on two CPU `WorkerState`s, one with repeats and one without: every
step's row and capture tables, every trace, action count and error, and the checksum are equal,
and the run with repeats did repeat steps (and fell back where a decision flipped)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from engine_ext.dynamic.specs import DYNAMIC_ARGS_KEY, DynamicRequest, Policy, Probe
from engine_ext.program import ModelDims, PromptInfo, compile_program, program_to_extra_args
from engine_ext.specs import Interventions, Steer, canonical_json
from engine_ext.worker.state import WorkerConfig, WorkerState

L, H, PROMPT, STEPS = 4, 32, 6, 24
VEC = np.linspace(-0.2, 0.2, H).astype(np.float32)


def _policies() -> dict[str, list[Policy]]:
    def pol(**kw) -> Policy:
        return Policy.make(probe="p", sites=["L1.post_attn"], vector=VEC, **kw)

    return {"hyst": [pol(on=0.5, off=-0.5)], "hold": [pol(on=0.3, min_hold=3)],
            "latch": [pol(on=0.8, latch="request", scale=2.0)], "static_only": [],
            "conv": [pol(on=0.4, latch="conversation", scale=1.5)],
            "conv2": [pol(on=0.2, latch="conversation", scale=0.5)],
            "under_static": [pol(on=0.5, off=-0.5)], "late": [pol(on=0.0)],
            "prop": [pol(mode="proportional", target=0.1, gain=0.4, min_scale=-1.0, max_scale=1.5, initial_scale=0.5)],
            "prop_clamped": [pol(mode="proportional", target=0.0, gain=2.0, min_scale=0.25, max_scale=0.75,
                                 initial_scale=0.25)],
            "prop_to_zero": [pol(mode="proportional", target=-2.0, gain=0.3, min_scale=0.0, max_scale=1.0,
                                 initial_scale=0.5)]}


def _score(rid: str, pos: int, seed: int) -> float:
    """A score per (request, position): long runs on one side of the thresholds, some flips."""
    rng = np.random.default_rng([seed, sum(map(ord, rid)), pos // 4])
    side = 1.0 if rng.random() < 0.5 else -1.0
    return float(side * (0.6 + 0.3 * rng.random()))


BATCH = ("hyst", "hold", "latch", "conv", "conv2", "static_only", "under_static", "prop", "prop_clamped")


def _drive(replay: bool, seed: int, defer: bool, static_only: bool = True,
           batch: tuple[str, ...] = BATCH, device: bool = False,
           empty_after: tuple[int, ...] = ()) -> tuple[WorkerState, list, dict]:
    """The scripted run; `empty_after`: the steps followed by an empty one (the runner's
    `execute_model` with no rows: no plan, its `after_forward`), as vLLM's asynchronous scheduling
    runs when every request of the batch has reached its last token."""
    st = WorkerState(L, H, 256, torch.device("cpu"), torch.float32, WorkerConfig(max_capture_rows=64))
    st.dynamic.replay_enabled = replay
    st.dynamic.device_decisions = device
    folded: list[tuple] = []  # every action folded into the checksum: (step ordinal, crc, p0, p1)
    fold = st.planner.checksum.fold_step

    def recording_fold(actions, step=None):
        ordinal = st.planner.checksum.step if step is None else step
        folded.extend((ordinal, int(a[0]) & 0xFFFFFFFF, int(a[1]), int(a[2])) for a in np.asarray(actions).tolist())
        return fold(actions, step)

    st.planner.checksum.fold_step = recording_fold
    fold_prepared = st.planner.checksum.fold_prepared

    def recording_fold_prepared(arr):  # a held steady plan's steps (static requests alone)
        folded.extend((st.planner.checksum.step, int(a[0]), int(a[1]), int(a[2])) for a in arr.tolist())
        return fold_prepared(arr)

    st.planner.checksum.fold_prepared = recording_fold_prepared
    direction = np.random.default_rng(0).standard_normal(H).astype(np.float32)
    st.dynamic.set_probe(Probe.make("p", "L2.post_block", direction=direction).to_json())
    pols = _policies()
    nc: dict[str, int] = {}

    def register(rid: str) -> None:
        steer = ()
        if rid == "static_only":
            steer = (Steer.make(["L1.post_attn"], VEC * 0.5),)
        elif rid == "under_static":  # a base slot under the dynamic action at two positions only
            steer = (Steer.make(["L1.post_attn"], VEC * 0.25, positions=[PROMPT + 3, PROMPT + 4]),)
        prog = compile_program(Interventions(steer=steer), PromptInfo(list(range(PROMPT)), None, None, 64),
                               ModelDims(L, H, 100, 0.02), key=f"k-{rid}", named_vector_dims=lambda n: None)
        extra = program_to_extra_args(prog)
        if pols[rid]:
            conv = {"conv": "conversation-1", "conv2": "conversation-2"}.get(rid)
            extra[DYNAMIC_ARGS_KEY] = canonical_json(DynamicRequest.make(pols[rid], conversation_id=conv).wire(()))
        st.register(rid, extra)
        nc[rid] = 0

    for rid in batch:
        if static_only or rid != "static_only":
            register(rid)
    tables = []
    for step in range(STEPS):
        if step == 6 and "hyst" in batch:
            register("late")
        if step == 15 and "hold" in nc:
            st.finish("hold")
            del nc["hold"]
        # preempted: recomputes its last two positions (the second after a long chain of repeats)
        rewind = {"latch": 2} if step == 11 and "latch" in nc else {"hyst": 2} if step == 21 and "hyst" in nc else {}
        rids = list(nc)
        lens = []
        for rid in rids:
            if nc[rid] == 0:
                lens.append(PROMPT)
            elif rid in rewind:
                nc[rid] -= rewind[rid]
                lens.append(rewind[rid] + 1)
            else:
                lens.append(1)
        qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        computed = np.asarray([nc[r] for r in rids], np.int32)
        if st.plan_step(rids, qsl, computed, defer=defer):
            st.finish_step()
        rows = int(qsl[-1])
        # the slots by what the op reads from them (slot numbers depend on what else holds slots)
        b = st.buffers

        def content(x: int) -> str:
            if x < 0:
                return ""
            return repr((int(b.slot_mode[x]), float(b.slot_a[x]), zlib.crc32(b.slot_c[x].numpy().tobytes()),
                         int(b.slot_adim[x]), int(b.slot_clamp[x]), int(b.slot_gate[x])))

        keys = np.vectorize(content, otypes=[object])(st.planner.hs[:rows])
        tables.append((keys, st.planner.hc[:rows].copy()))
        for dr, pos, _, idx in st.dynamic.step_monitors():  # the score each monitored row reads
            want = _score(dr.req_id, pos, seed)
            st.buffers.cap_x[idx] = torch.from_numpy(direction * np.float32(want / float(direction @ direction)))
            st.buffers.cap_r[idx] = 0.0
        st.after_forward()
        if step in empty_after:
            st.after_forward()
        if step == 8:
            st.dynamic.status()  # takes the pending decisions: the next step is planned the usual way
        for rid, n in zip(rids, lens):
            nc[rid] += n
    st.dynamic.sync_device()  # a chain decided on the device: its read-backs taken (as `result` does)
    st.dynamic.decide_pending()
    # every request's decision state as the host holds it (bookkeeping done in bulk or request
    # by request must leave the same), and the conversations latched
    results = {f"state-{rid}": ([(s.engaged, s.held, s.latched, s.scale) for s in dr.states],
                                sorted(dr.decided.items()), dr.last_scored, dr.actions)
               for rid, dr in st.dynamic.requests.items()}
    results["latches"] = [(k, sorted(v)) for k, v in st.dynamic.latches.items()]  # in LRU order
    results.update({rid: st.dynamic.result(rid) for rid in nc if rid != "static_only"})
    results["checksum"] = st.planner.checksum.status()
    results["folded"] = sorted(folded)
    return st, tables, results


@pytest.mark.parametrize("defer", [False, True], ids=["at-once", "deferred"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_repeated_steps_plan_what_planning_request_by_request_does(seed, defer):
    fast, t_fast, r_fast = _drive(True, seed, defer)
    slow, t_slow, r_slow = _drive(False, seed, defer)
    assert slow.dynamic.replayed_steps == 0
    assert fast.dynamic.replayed_steps >= 3, fast.dynamic.replayed_steps
    for step, ((hs_a, hc_a), (hs_b, hc_b)) in enumerate(zip(t_fast, t_slow)):
        assert np.array_equal(hs_a, hs_b), step
        assert np.array_equal(hc_a, hc_b), step
    assert r_fast == r_slow
    assert fast.planner.checksum.status() == slow.planner.checksum.status()
    assert fast.dynamic.actions == slow.dynamic.actions > 0
    a, b = fast.dynamic.status(), slow.dynamic.status()
    assert a.pop("replayed_steps") == fast.dynamic.replayed_steps and b.pop("replayed_steps") == 0
    assert a == b


def test_steps_of_dynamic_requests_only_fold_the_same_checksum():
    """Without the static-only request, a repeated step's actions are folded on their own (not
    appended to static plans' actions): the same checksum as planning request by request."""
    _, _, fast = _drive(True, 4, False, static_only=False)
    _, _, slow = _drive(False, 4, False, static_only=False)
    assert fast == slow and fast["checksum"]["action_count"] > 0


def test_proportional_policies_repeat_exactly_and_a_scale_of_zero_falls_back():
    """Proportional control alone: every repeated step decides the batch's scales at once and
    composes their slots; one request's scale is clamped to 0 (no action: the step falls back,
    and steps are planned request by request while it stays there). The same tables, traces and
    checksum as planning request by request."""
    batch = ("prop", "prop_clamped")
    fast, t_fast, r_fast = _drive(True, 5, False, batch=batch)
    slow, t_slow, r_slow = _drive(False, 5, False, batch=batch)
    assert fast.dynamic.replayed_steps >= 10
    assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(t_fast, t_slow))
    assert r_fast == r_slow and r_fast["checksum"]["action_count"] > 0
    fast, t_fast, r_fast = _drive(True, 5, False, batch=batch + ("prop_to_zero",))
    slow, t_slow, r_slow = _drive(False, 5, False, batch=batch + ("prop_to_zero",))
    assert fast.dynamic.replay_fallbacks >= 1
    assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(t_fast, t_slow))
    assert r_fast == r_slow
    assert any(e["scale"] == 0.0 for e in r_fast["prop_to_zero"]["trace"][0])


@pytest.mark.parametrize("replay", [False, True], ids=["request-by-request", "repeated"])
def test_proportional_chains_leave_no_slot_behind(replay):
    """A chain's proportional windows hold slots of their own while it repeats (rewritten in
    place, `SlotTable.rewrite_scaled`); once every request has finished and an empty step has run, no
    slot is in use, with or without a fall-back (a scale clamped to 0) in the run."""
    for batch in (("prop", "prop_clamped"), ("prop", "prop_clamped", "prop_to_zero")):
        st, _, _ = _drive(replay, 5, False, batch=batch)
        assert len(st.slots) > 0
        for rid in list(st.dynamic.requests):
            st.finish(rid)
        if st.plan_step([], np.zeros(1, np.int32), np.zeros(0, np.int32)):
            st.finish_step()
        st.after_forward()
        assert len(st.slots) == 0, batch


def test_a_flip_during_a_repeated_step_falls_back_exactly():
    """Over the three seeds, some repeated step meets a decision that flips: it is undone and
    planned the usual way (the test above checks the result equals)."""
    assert sum(_drive(True, seed, False)[0].dynamic.replay_fallbacks for seed in (1, 2, 3)) >= 1


THRESHOLD_BATCH = ("hyst", "hold", "latch", "conv", "conv2", "static_only", "under_static")


@pytest.mark.parametrize("batch", [THRESHOLD_BATCH, BATCH, ("prop", "prop_clamped", "prop_to_zero")],
                         ids=["threshold", "mixed", "proportional"])
@pytest.mark.parametrize("defer", [False, True], ids=["at-once", "deferred"])
@pytest.mark.parametrize("seed", [1, 2, 6])
def test_decisions_taken_on_the_device_equal_the_hosts(seed, defer, batch):
    """Policies decided on the device (`device_decisions`, CPU tensors here): no wait, each
    window's entries (and a proportional policy's payload) rewritten from the device's decisions
    after the upload, the host taking the same decisions from the read-back two steps later. Every step's tables, every trace, action count
    and error equal planning request by request on the host; the checksum folds as many actions
    (its value differs: the device's actions are folded when read back, with their step's ordinal)."""
    dev, t_dev, r_dev = _drive(True, seed, defer, batch=batch, device=True)
    host, t_host, r_host = _drive(False, seed, defer, batch=batch)
    assert dev.dynamic.device_decisions, "a device decision differed from the host's"
    assert dev.dynamic.replayed_steps >= 3
    # read-backs where every decision held are taken as arrays (the rest request by request)
    assert dev.dynamic.device_held_reads >= (10 if batch[0] == "prop" else 3), dev.dynamic.device_held_reads
    for step, ((hs_a, hc_a), (hs_b, hc_b)) in enumerate(zip(t_dev, t_host)):
        assert np.array_equal(hs_a, hs_b), step
        assert np.array_equal(hc_a, hc_b), step
    c_dev, c_host = r_dev.pop("checksum"), r_host.pop("checksum")
    # the same actions, each under the ordinal of the step that applied it (the rolling value
    # differs only because the device's are folded when read back)
    assert r_dev.pop("folded") == r_host.pop("folded")
    assert r_dev == r_host
    assert c_dev["action_count"] == c_host["action_count"] > 0
    assert dev.dynamic.actions == host.dynamic.actions


@pytest.mark.parametrize("device", [False, True], ids=["host", "device"])
@pytest.mark.parametrize("batch", [THRESHOLD_BATCH, ("prop", "prop_clamped")], ids=["threshold", "proportional"])
def test_an_empty_step_after_a_chain_keeps_each_trace_in_order(batch, device):
    """An empty step (no rows: no plan, only `after_forward`; vLLM's asynchronous scheduling runs
    one when every request of the batch has reached its last token) in a chain of repeated steps
    and after the last one: the pending decisions it takes come after the chain's bookkeeping, so
    every trace runs in position order and all of it equals planning request by request (on the
    GPU this showed as the last position's entry written before the chain's)."""
    empty = (10, 14, STEPS - 1)
    fast, t_fast, r_fast = _drive(True, 7, False, batch=batch, device=device, empty_after=empty)
    slow, t_slow, r_slow = _drive(False, 7, False, batch=batch, empty_after=empty)
    assert fast.dynamic.replayed_steps >= 3
    for rid, res in r_fast.items():
        if isinstance(res, dict) and "trace" in res:
            positions = [e["position"] for e in res["trace"][0]]
            assert positions == sorted(positions), (rid, positions)
    if device:
        r_fast.pop("checksum"), r_slow.pop("checksum")
    assert r_fast == r_slow


def test_a_status_read_does_not_end_a_chain_decided_on_the_device():
    """A status read between steps takes every read-back (the host's state is current) and the
    chain decided on the device goes on: every step after the first two is repeated, and the
    traces and folded actions equal planning request by request."""
    from tests.test_dynamic_plan_order import N, PROMPT, _plan, _state

    pol = Policy.make(probe="p", sites=["L1.post_attn"], vector=np.ones(32, np.float32) * 0.1, on=-1e30)
    runs = []
    for device in (True, False):
        st = _state(DynamicRequest.make([pol]))
        st.dynamic.device_decisions, st.dynamic.replay_enabled = device, device
        st.plan_step([f"r{i}" for i in range(N)], np.arange(0, PROMPT * N + 1, PROMPT, dtype=np.int32), np.zeros(N, np.int32))
        st.after_forward()
        for step in range(8):
            _plan(st, [PROMPT + step] * N)
            st.after_forward()
            if step == 4:
                status = st.dynamic.status()
                assert status["dynamic_actions"] == N * (step + 1)  # current: every step's actions
        runs.append((st, [st.dynamic.result(f"r{i}") for i in range(N)], st.planner.checksum.status()))
    (dev, r_dev, c_dev), (host, r_host, c_host) = runs
    assert dev.dynamic.replayed_steps == 8 - 2
    assert r_dev == r_host and c_dev["action_count"] == c_host["action_count"] == N * 8


def test_the_device_setting_and_its_default():
    from engine_ext.dynamic.repeat_steps import device_setting

    assert [device_setting(v) for v in ("auto", "1", "0", "on", "off", True, False)] == [
        "auto", True, False, True, False, True, False]
    with pytest.raises(ValueError, match="expected 1, 0 or auto"):
        device_setting("sometimes")
    # "auto" takes decisions on the device only on a GPU (for chains with a proportional policy):
    # on the CPU the chains repeat on the host, exactly as with the setting off
    st = WorkerState(L, H, 256, torch.device("cpu"), torch.float32, WorkerConfig(max_capture_rows=64))
    assert st.dynamic.device_decisions == "auto"
    auto, _, r_auto = _drive(True, 1, False, batch=("prop", "prop_clamped"), device="auto")
    host, _, r_host = _drive(True, 1, False, batch=("prop", "prop_clamped"), device=False)
    assert auto.dynamic.device_held_reads == 0 and auto.dynamic.replayed_steps == host.dynamic.replayed_steps > 0
    assert r_auto == r_host
