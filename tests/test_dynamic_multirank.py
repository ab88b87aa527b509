"""Dynamic steering at tensor-parallel size 2 on CPU (real vLLM, bundled model, fp32) against one
rank: the same policies (and the reference fork's declarative gates) on the same prompts take the
same decisions and produce the same tokens;
the ranks' applied-action checksums (dynamic actions included, payload bytes and all) agree; a
dynamic action skipped on one rank only is reported as `consistent: false` with both checksums.

The module starts its engines one after the other (a one-rank engine, closed, then TP=2), so at
most one vLLM engine runs at a time; it does not use the session engine. Run it alone with
`scripts/run_tests.sh tests/test_dynamic_multirank.py` (or `-m multirank`).

Tolerances: TP=2 sums the row-parallel matmuls in another order (last-bit differences, see
tests/test_multirank.py): scores within SCORE_RTOL relative + SCORE_ATOL; the thresholds sit
further than MARGIN from every one-rank score, so decisions compare exactly, and so do tokens.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine_ext import GenerationParams
from engine_ext.dynamic.specs import DynamicRequest, Policy, Probe
from tests.conftest import model_path

pytestmark = pytest.mark.multirank

SCORE_RTOL, SCORE_ATOL = 1e-3, 1e-2
MARGIN = 0.5
PARAMS = GenerationParams(max_tokens=12, ignore_eos=True, logprobs=0)
PROMPTS = ["The capital of Thaethas is", "The river of Isle of Sorith is", "The leader of Garrow is"]


def _vec(seed: int, scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(192) * scale).astype(np.float32)


PROBE = Probe.make("mr-dir", "L3.post_block", direction=_vec(0))
PROJ = Probe.make("mr-proj", "L4.post_attn", direction=_vec(1) / np.linalg.norm(_vec(1)))


def _threshold(on: float) -> Policy:
    return Policy.make(probe="mr-dir", sites=["L2.post_attn"], vector=_vec(1, 4.0), on=on, off=on - 1.0, min_hold=2)


def _proportional(target: float) -> Policy:
    return Policy.make(probe="mr-proj", mode="proportional", sites=["L4.post_attn"], vector=_vec(1, 4.0), target=target,
                       gain=0.9 / float(np.linalg.norm(_vec(1, 4.0))), min_scale=-20.0, max_scale=20.0)


def _gates(on0: float, on: float) -> list:
    """The fork's gates per prompt: a host probe (rest_of_request), an always pulse, a soft this_token gate."""
    from app.fork.gates import parse_gates
    from app.fork.vectors import pack_vectors
    from engine_ext.dynamic.gates import GateSet

    steer = {"kind": "inline", "packed": {"post_attn": pack_vectors(_vec(1, 4.0)[None], [2])}}
    # the soft gate's vector also at the probe's site, where the gate scales it per token
    both = {"kind": "inline", "packed": {"post_attn": pack_vectors(_vec(1, 4.0)[None], [2]),
                                         "post_block": pack_vectors(_vec(2, 4.0)[None], [3])}}
    probe = {"kind": "inline", "packed": {"post_block": pack_vectors(_vec(0)[None], [3])}}
    raw = [[{"when": {"kind": "probe", "probe": probe, "threshold": on0}, "scope": "rest_of_request",
             "apply": {"kind": "add", "steer": steer}}],
           [{"when": {"kind": "always"}, "scope": "next_step", "apply": {"kind": "add", "steer": steer, "strength": 2.0}}],
           [{"when": {"kind": "probe", "probe": probe, "threshold": on, "sharpness": 0.05}, "scope": "this_token",
             "apply": {"kind": "add", "steer": both}}]]
    return [DynamicRequest(gates=GateSet(tuple(parse_gates(r, lambda n, k: None, num_layers=6, hidden=192)))) for r in raw]


def _run(eng, policies_per_prompt) -> list:
    """The prompts in one batch, each with its own policies (or its own `DynamicRequest`)."""
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        futs = [pool.submit(eng.generate, p, PARAMS, None,
                            dynamic=pols if isinstance(pols, DynamicRequest) else DynamicRequest.make(pols))
                for p, pols in zip(PROMPTS, policies_per_prompt)]
        gens = [f.result() for f in futs]
    for g in gens:
        assert g.intervention.status == "ok", g.intervention.errors
    return gens


def _engine(**kw):
    from engine_ext import Engine

    eng = Engine(model=str(model_path()), device="cpu", **kw).start()
    eng.register_probe(PROBE)
    eng.register_probe(PROJ)
    return eng


@pytest.fixture(scope="module")
def one_rank():
    """Thresholds chosen on one rank, and that engine's generations with them. The engine core runs
    in its own process: closing an in-process engine would tear down vLLM's process-global state
    under the session's shared engine."""
    eng = _engine(multiprocess=True)
    try:
        never = Policy.make(probe="mr-dir", sites=["L2.post_attn"], vector=_vec(1, 4.0), on=1e30)
        base = _run(eng, [[never]] * len(PROMPTS))
        scores = [e["score"] for g in base for e in g.intervention.dynamic["trace"][0]]
        on = float(np.median(scores))
        while min(abs(s - on) for s in scores) < MARGIN or min(abs(s - on + 1.0) for s in scores) < MARGIN:
            on += 0.37
        target = float(np.mean([e["score"] for e in _run(eng, [[_proportional(0.0)]] * 3)[0].intervention.dynamic["trace"][0]])) + 20.0
        policies = [[_threshold(on)], [_proportional(target)], [_threshold(on), _proportional(target)]]
        gens = _run(eng, policies)
        # the first prompt's gate: a threshold among its own generated positions' scores
        own = [e["score"] for e in base[0].intervention.dynamic["trace"][0][1:]]
        on0 = float(np.median(own))
        while min(abs(x - on0) for x in own) < MARGIN:
            on0 += 0.37
        gates = _gates(on0, on)
        gate_gens = _run(eng, gates)
        status = eng.dynamic_status()
    finally:
        eng.close()
    return {"on": on, "target": target, "policies": policies, "gens": gens, "status": status, "gates": gates,
            "gate_gens": gate_gens}


@pytest.fixture(scope="module")
def tp2(one_rank):
    eng = _engine(tensor_parallel_size=2)
    yield eng
    eng.close()


def test_decisions_and_outputs_equal_the_one_rank_run(one_rank, tp2):
    gens = _run(tp2, one_rank["policies"])
    engaged_somewhere = False
    for g1, g2 in zip(one_rank["gens"], gens):
        assert g2.token_ids == g1.token_ids
        for t1, t2 in zip(g1.intervention.dynamic["trace"], g2.intervention.dynamic["trace"]):
            assert [e["engaged"] for e in t2] == [e["engaged"] for e in t1]
            assert [e["position"] for e in t2] == [e["position"] for e in t1]
            for a, b in zip(t2, t1):
                assert abs(a["score"] - b["score"]) <= SCORE_ATOL + SCORE_RTOL * abs(b["score"])
            engaged_somewhere |= any(e["engaged"] for e in t1)
            # the decided scales are the same numbers (the proportional ones within the scores' tolerance)
            assert np.allclose([e["scale"] for e in t2], [e["scale"] for e in t1], rtol=1e-3, atol=1e-3)
        assert g2.intervention.dynamic["actions"] == g1.intervention.dynamic["actions"]
    assert engaged_somewhere
    st = tp2.dynamic_status()
    assert st["determinism"]["consistent"] is True, st["determinism"]
    assert {(w["tp_rank"], w["pp_rank"]) for w in st["workers"]} == {(0, 0), (1, 0)}
    assert len({w["action_checksum"] for w in st["workers"]}) == 1
    assert all(w["dynamic_actions"] > 0 for w in st["workers"])


def test_the_forks_gates_decide_alike_at_two_ranks(one_rank, tp2):
    gens = _run(tp2, one_rank["gates"])
    for g1, g2 in zip(one_rank["gate_gens"], gens):
        a, b = g1.intervention.dynamic["gates"], g2.intervention.dynamic["gates"]
        assert g2.token_ids == g1.token_ids
        assert a["armed_at"] is not None and b["armed_at"] == a["armed_at"] and b["fired"] == a["fired"]
        assert [e["position"] for e in b["trace"]] == [e["position"] for e in a["trace"]]
        assert [e["scales"] for e in b["trace"]] == [e["scales"] for e in a["trace"]]
        # the row gate's g the op used, per position (None where it did not act)
        sa, sb = ([-1.0 if x is None else x for e in t["trace"] for x in e["soft"]] for t in (a, b))
        assert np.allclose(sb, sa, rtol=1e-3, atol=1e-3)
    assert any(x is not None and 0.0 < x < 1.0
               for e in one_rank["gate_gens"][2].intervention.dynamic["gates"]["trace"] for x in e["soft"])
    st = tp2.dynamic_status()
    assert st["determinism"]["consistent"] is True, st["determinism"]


def test_decisions_on_the_device_at_two_ranks_equal_the_host_path(one_rank, tp2):
    """(Before the fault test below, which makes the ranks' checksums differ for good.)
    Threshold and proportional policies decided on the device (`device_decisions`) at
    tensor-parallel size 2:
    every rank decides from its own (rank-identical) scores and folds the actions it read back
    a fixed number of steps later, so the checksums agree; tokens, engaged flags and action
    counts equal the same batch planned request by request on the host."""
    pols = [[_threshold(one_rank["on"])], [_proportional(one_rank["target"])], [_threshold(one_rank["on"])]]

    def repeated() -> list[int]:
        return [w["replayed_steps"] for w in sorted(tp2.dynamic_status()["workers"], key=lambda w: w["tp_rank"])]

    def run_with(rpc: str, value: bool) -> list:
        """The batch with a worker switch set, put back to its default afterwards."""
        tp2._rpc(rpc, value)
        try:
            return _run(tp2, pols)
        finally:
            tp2._rpc(rpc, not value)

    host = run_with("cb_set_dyn_replay", False)
    before = repeated()
    dev = run_with("cb_set_dyn_device", True)
    after = repeated()
    assert all(a > b for a, b in zip(after, before)), (before, after)
    assert after[0] - before[0] == after[1] - before[1]
    for g1, g2 in zip(host, dev):
        assert g2.intervention.status == "ok", g2.intervention.errors
        assert g2.token_ids == g1.token_ids
        t1, t2 = g1.intervention.dynamic["trace"][0], g2.intervention.dynamic["trace"][0]
        assert [e["engaged"] for e in t2] == [e["engaged"] for e in t1]
        assert [e["position"] for e in t2] == [e["position"] for e in t1]
        assert np.allclose([e["scale"] for e in t2], [e["scale"] for e in t1], rtol=1e-3, atol=1e-3)
        assert g2.intervention.dynamic["actions"] == g1.intervention.dynamic["actions"]
    st = tp2.dynamic_status()
    assert st["determinism"]["consistent"] is True, st["determinism"]


def test_a_dynamic_action_skipped_on_one_rank_is_reported(one_rank, tp2):
    """Runs last in the module: the fault leaves the ranks' checksums apart for good."""
    pol = Policy.make(probe="mr-dir", sites=["L2.post_attn"], vector=_vec(1, 4.0), on=-1e30)  # engaged from the first token
    before = tp2.dynamic_status()
    assert before["determinism"]["consistent"] is True
    assert tp2.inject_fault("skip_action", tp_rank=1, pp_rank=0)
    g = tp2.generate(PROMPTS[0], GenerationParams(max_tokens=3, ignore_eos=True), dynamic=DynamicRequest.make([pol]))
    assert g.token_ids  # the mismatch never fails a request
    st = tp2.dynamic_status()
    det = st["determinism"]
    assert det["consistent"] is False
    sums = {w["tp_rank"]: w["action_checksum"] for w in st["workers"]}
    assert det["checksums"] == {"tp0/pp0": sums[0], "tp1/pp0": sums[1]} and sums[0] != sums[1]
    acts = {w["tp_rank"]: w["dynamic_actions"] for w in st["workers"]}
    assert acts[0] == acts[1] + 1  # rank 1 applied (and folded) one dynamic action fewer
    assert tp2.generate(PROMPTS[1], GenerationParams(max_tokens=2)).token_ids

