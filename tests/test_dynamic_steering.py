"""Dynamic steering on the real engine (CPU, float32) against the transformers oracle running the
same policy by hand, token by token (`oracle` below: full recomputation each step, the probe read
at the monitored site, `PolicyState.decide`, the action added at the next position only).

Tolerances: probe scores within SCORE_RTOL (relative) + SCORE_ATOL of the oracle's (vLLM's
kernels sum in another order); thresholds are placed where the nearest score is further away
than that, so engagement decisions are compared exactly, and token ids are compared exactly.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine_ext import GenerationParams, SpecError
from engine_ext.dynamic.policy import PolicyState
from engine_ext.dynamic.specs import DynamicRequest, Policy, Probe
from engine_ext.reference.hf import RefEdit
from engine_ext.specs import Interventions, Steer

SCORE_RTOL, SCORE_ATOL = 1e-3, 1e-2
#: margin kept between any score and a threshold the tests place (in score units)
MARGIN = 0.5
PROMPT = "The capital of Thaethas is"
PARAMS = GenerationParams(max_tokens=10, ignore_eos=True, logprobs=0)
#: the action steers below the probe: the probe sees it at every steered position
PROBE_SITE, STEER_SITE = "L3.post_block", "L2.post_attn"


def _rng_vec(seed: int, n: int = 192) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


@pytest.fixture(scope="module")
def probe(engine):
    p = Probe.make("dyn-test-dir", PROBE_SITE, direction=_rng_vec(0))
    engine.register_probe(p)
    yield p
    engine.set_dynamic_policies([])
    engine.delete_probe(p.name)


@pytest.fixture(scope="module")
def steer_vec():
    return _rng_vec(1) * 4.0


def oracle(hf_ref, prompt_ids, max_tokens, probes: dict, policies):
    """Greedy generation with the policies run by hand: returns (token ids, per-policy trace)."""
    states = [PolicyState.start(p) for p in policies]
    ids, n = list(prompt_ids), len(prompt_ids)
    decided: dict[int, tuple[float, ...]] = {}
    trace = [[] for _ in policies]
    sites = sorted({probes[p.probe].site for p in policies})
    for _ in range(max_tokens):
        edits = []
        for pos in range(n, len(ids)):
            for pol, sc in zip(policies, decided.get(pos, ())):
                if sc:
                    edits += [RefEdit.steer((s.layer, s.hook), pol.vector, scale=sc, positions=[pos]) for s in pol.sites]
        run = hf_ref.run(ids, edits, capture=[(s.layer, s.hook) for s in sites], n_prompt=n)
        last = len(ids) - 1
        nxt = []
        for k, (pol, st) in enumerate(zip(policies, states)):
            pr = probes[pol.probe]
            value = run.captures[(pr.site.layer, pr.site.hook)][last].numpy()
            score = float(pr.scores(value)[pol.component])
            here = decided.get(last, (0.0,) * len(policies))[k]
            trace[k].append({"position": last, "score": score, "engaged": here != 0.0, "scale": here})
            nxt.append(st.decide(score))
        decided[last + 1] = tuple(nxt)
        ids.append(int(run.logits[-1].argmax()))
    return ids[n:], trace


def run_dynamic(engine, policies, prompt=PROMPT, params=PARAMS, **kw):
    g = engine.generate(prompt, params, dynamic=DynamicRequest.make(policies, **kw))
    assert g.intervention is not None and g.intervention.status == "ok", g.intervention and g.intervention.errors
    return g, g.intervention.dynamic["trace"]


def baseline_scores(engine, probe, steer_vec):
    """The probe's scores of an unsteered generation (a policy that never fires)."""
    pol = Policy.make(probe=probe.name, sites=[STEER_SITE], vector=steer_vec, on=1e30)
    g, trace = run_dynamic(engine, [pol])
    assert not any(e["engaged"] for e in trace[0])
    return g, [e["score"] for e in trace[0]]


def assert_scores_close(got, want):
    for i, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= SCORE_ATOL + SCORE_RTOL * abs(b), f"score {i}: engine {a} vs oracle {b}"


def test_probe_firing_at_a_known_token_engages_at_exactly_the_next_step(engine, hf_ref, probe, steer_vec):
    plain, scores = baseline_scores(engine, probe, steer_vec)
    # the latest scored position k >= 1 whose score exceeds every earlier one by a margin
    k = max(i for i in range(1, len(scores)) if scores[i] > max(scores[:i]) + 2 * MARGIN)
    on = 0.5 * (scores[k] + max(scores[:k]))
    pol = Policy.make(probe=probe.name, sites=[STEER_SITE], vector=steer_vec, on=on, off=-1e30, scale=1.0)
    g, trace = run_dynamic(engine, [pol])
    engaged = [e["engaged"] for e in trace[0]]
    # scored positions are n-1 (the last prompt token) onward: the score at entry k fires, so
    # the position of entry k + 1 is the first one steered
    assert engaged == [False] * (k + 1) + [True] * (len(engaged) - k - 1)
    n = len(g.prompt_token_ids)
    assert trace[0][k]["position"] == n - 1 + k
    # forwards before the first steered one are the unsteered ones; steering changed the others
    assert g.token_ids[: k + 1] == plain.token_ids[: k + 1]
    assert np.allclose(g.logprobs[: k + 1], plain.logprobs[: k + 1], atol=1e-5, rtol=0)
    assert all(abs(e["score"] - b) > 1e-3 for e, b in zip(trace[0][k + 1:], scores[k + 1:]))
    # token by token against the transformers oracle running the same policy by hand
    ref_ids, ref_trace = oracle(hf_ref, g.prompt_token_ids, PARAMS.max_tokens, {probe.name: probe}, [pol])
    assert g.token_ids == ref_ids
    assert [e["engaged"] for e in ref_trace[0]] == engaged
    assert_scores_close([e["score"] for e in trace[0]], [e["score"] for e in ref_trace[0]])
    st = engine.dynamic_status()
    assert st["determinism"]["consistent"] is True and st["determinism"]["action_count"] >= 1
    assert any(p["name"] == probe.name for p in st["probes"])


def test_hysteresis_releases_below_off_after_min_hold(engine, hf_ref, probe, steer_vec):
    _, scores = baseline_scores(engine, probe, steer_vec)
    ordered = sorted(scores)
    on = ordered[len(ordered) // 2] - 1e-3  # engages on about half the scores
    off = on - 1.0
    pol = Policy.make(probe=probe.name, sites=[STEER_SITE], vector=steer_vec, on=on, off=off, min_hold=2, scale=1.0)
    g, trace = run_dynamic(engine, [pol], params=GenerationParams(max_tokens=24, ignore_eos=True))
    tr = trace[0]
    # the engine followed the rule on its own scores
    st = PolicyState.start(pol)
    want = [False]
    for e in tr[:-1]:
        want.append(st.decide(e["score"]) != 0.0)
    assert [e["engaged"] for e in tr] == want
    # it engaged, held for at least min_hold tokens, and released
    runs, cur = [], 0
    for e in tr:
        if e["engaged"]:
            cur += 1
        elif cur:
            runs.append(cur)
            cur = 0
    assert runs, "the policy never engaged and released; choose another threshold"
    assert min(runs) >= 2
    for i in range(1, len(tr)):
        if tr[i - 1]["engaged"] and not tr[i]["engaged"]:
            assert tr[i - 1]["score"] < off  # released only below 'off'
    ref_ids, ref_trace = oracle(hf_ref, g.prompt_token_ids, 24, {probe.name: probe}, [pol])
    near = min(min(abs(e["score"] - on), abs(e["score"] - off)) for e in ref_trace[0])
    if near > MARGIN:  # a score within the oracle tolerance of a threshold would make the comparison a coin flip
        assert g.token_ids == ref_ids
        assert [e["engaged"] for e in ref_trace[0]] == [e["engaged"] for e in tr]


def test_proportional_control_converges_to_the_target(engine, hf_ref, steer_vec):
    """Monitor and steer at the same site along the steering direction: the score is the
    projection of the steered stream onto that direction, which the controller drives from 20
    below the target to it. Stated tolerance: over the last 8 of 24 tokens the mean |error| is
    <= PROP_MEAN_ABS and the mean signed error within PROP_BIAS (the model's own token-to-token
    wobble of that projection, a few units, is what a controller acting one token late cannot
    cancel)."""
    unit = steer_vec / np.linalg.norm(steer_vec)
    pr = Probe.make("dyn-test-proj", "L4.post_attn", direction=unit)
    engine.register_probe(pr)
    try:
        norm = float(np.linalg.norm(steer_vec))
        params = GenerationParams(max_tokens=24, ignore_eos=True)
        base_pol = Policy.make(probe=pr.name, mode="proportional", sites=["L4.post_attn"], vector=steer_vec,
                               target=0.0, gain=0.0, min_scale=0.0, max_scale=0.0)
        _, tr0 = run_dynamic(engine, [base_pol], params=params)
        base = [e["score"] for e in tr0[0]]
        target = float(np.mean(base)) + 20.0
        pol = Policy.make(probe=pr.name, mode="proportional", sites=["L4.post_attn"], vector=steer_vec, target=target,
                          gain=0.9 / norm, min_scale=-20.0, max_scale=20.0)
        g, trace = run_dynamic(engine, [pol], params=params)
        scores = [e["score"] for e in trace[0]]
        err = [s - target for s in scores[-8:]]
        assert float(np.mean(np.abs(err))) <= PROP_MEAN_ABS, f"scores {scores} vs target {target}"
        assert abs(float(np.mean(err))) <= PROP_BIAS, f"scores {scores} vs target {target}"
        assert float(np.mean(np.abs(np.asarray(base[-8:]) - target))) > 3 * PROP_MEAN_ABS  # uncontrolled: far off
        scales = [e["scale"] for e in trace[0]]
        assert scales[0] == 0.0 and all(-20.0 <= x <= 20.0 for x in scales)
        ref_ids, ref_trace = oracle(hf_ref, g.prompt_token_ids, 24, {pr.name: pr}, [pol])
        assert g.token_ids == ref_ids
        assert_scores_close(scores, [e["score"] for e in ref_trace[0]])
    finally:
        engine.delete_probe(pr.name)


#: proportional control tolerances (score units; see the test's docstring)
PROP_MEAN_ABS, PROP_BIAS = 5.0, 3.0


def test_latching_across_two_turns_of_one_conversation(engine, probe, steer_vec):
    _, scores = baseline_scores(engine, probe, steer_vec)
    k = next(i for i in range(1, len(scores)) if scores[i] > max(scores[:i]) + 2 * MARGIN)
    on = 0.5 * (scores[k] + max(scores[:k]))
    pol = Policy.make(probe=probe.name, sites=[STEER_SITE], vector=steer_vec, on=on, off=on, latch="conversation")
    g1, t1 = run_dynamic(engine, [pol], conversation_id="conv-latch-1")
    assert any(e["engaged"] for e in t1[0])
    assert g1.intervention.dynamic["latched"] == [True]
    turn2 = PROMPT + g1.text + " and"
    g2, t2 = run_dynamic(engine, [pol], prompt=turn2, conversation_id="conv-latch-1")
    # the second turn starts engaged (its first generated position) and never releases
    assert [e["engaged"] for e in t2[0]] == [False] + [True] * (len(t2[0]) - 1)
    # another conversation starts released: it follows the rule from its own scores
    g3, t3 = run_dynamic(engine, [pol], prompt=turn2, conversation_id="conv-latch-2")
    assert t3[0][0]["engaged"] is False
    assert t3[0][1]["engaged"] is (t3[0][0]["score"] >= on)
    if not t3[0][1]["engaged"]:  # the steered second turn saw another stream from its first generated position
        assert t2[0][1]["score"] != t3[0][1]["score"]


def test_global_policy_applies_to_plain_requests(engine, probe, steer_vec):
    pol = Policy.make(probe=probe.name, sites=[STEER_SITE], vector=steer_vec, on=-1e30, scale=1.0)
    engine.set_dynamic_policies([pol])
    try:
        own = Policy.make(probe=probe.name, sites=[STEER_SITE], vector=steer_vec, on=1e30, scale=0.5)
        g, g2 = engine.generate([PROMPT, PROMPT], PARAMS, dynamic=DynamicRequest.make([own]))
        tr = g.intervention.dynamic["trace"][0]
        assert [e["engaged"] for e in tr] == [False] + [True] * (len(tr) - 1)
        # the result's policies (the global one first, then the request's own) as `Policy.to_api`,
        # each result with its own copy (they travel from the worker as indices: dynamic.trace)
        assert g.intervention.dynamic["policies"] == [pol.to_api(), own.to_api()]
        assert g2.intervention.dynamic["policies"] == g.intervention.dynamic["policies"]
        assert g2.intervention.dynamic["policies"][0]["vector"] is not g.intervention.dynamic["policies"][0]["vector"]
        g_off = engine.generate(PROMPT, PARAMS, dynamic=DynamicRequest.make([], use_global=False))
        assert g_off.intervention is None
    finally:
        engine.set_dynamic_policies([])


@pytest.mark.parametrize("make, field", [
    (lambda: Probe.make("p", "L1.post_block", direction=[float("nan")] * 192), "direction"),
    (lambda: Probe.make("p", "L1.nowhere", direction=[1.0] * 192), "site"),
    (lambda: Probe.make("p", "L1.post_block", kind="bank", weights=[[1.0] * 192, [1.0] * 191]), "weights"),
    (lambda: Probe.make("p", "L1.post_block", kind="bank", weights=[[1.0] * 192], bias=[0.0, 1.0]), "bias"),
    (lambda: Probe.make("bad name!", "L1.post_block", direction=[1.0] * 192), "name"),
    (lambda: Policy.make(probe="p", sites=["L1.post_block"], vector=[1.0] * 192, on=1.0, off=2.0), "policy.off"),
    (lambda: Policy.make(probe="p", sites=["L1.post_block"], vector=[1.0] * 192, on=1.0, min_hold=-1), "policy.min_hold"),
    (lambda: Policy.make(probe="p", mode="proportional", sites=["L1.post_block"], vector=[1.0] * 192, target=1.0,
                         gain=1.0, min_scale=2.0, max_scale=1.0), "policy.max_scale"),
    (lambda: Policy.make(probe="p", sites=["L1.post_block"], vector=[float("inf")] * 192, on=1.0), "policy.vector"),
])
def test_malformed_specs_name_the_field(make, field):
    with pytest.raises(SpecError) as exc:
        make()
    assert exc.value.field == field


def test_bad_input_against_the_model_is_refused_and_the_engine_keeps_serving(engine, probe, steer_vec):
    with pytest.raises(SpecError) as exc:
        engine.register_probe(Probe.make("p-dim", "L1.post_block", direction=[1.0] * 64))
    assert exc.value.field == "direction"
    with pytest.raises(SpecError) as exc:
        engine.register_probe(Probe.make("p-layer", "L99.post_block", direction=[1.0] * 192))
    assert exc.value.field == "site"
    cases = [
        (dict(probe="nope", sites=[STEER_SITE], vector=steer_vec, on=1.0), "dynamic.policies[0].probe"),
        (dict(probe=probe.name, sites=["L42.post_attn"], vector=steer_vec, on=1.0), "dynamic.policies[0].sites[0]"),
        (dict(probe=probe.name, sites=[STEER_SITE], vector=[1.0] * 10, on=1.0), "dynamic.policies[0].vector"),
        (dict(probe=probe.name, sites=[STEER_SITE], vector_name="no-such-vector", on=1.0), "dynamic.policies[0].vector_name"),
        (dict(probe=probe.name, sites=[STEER_SITE], vector=steer_vec, on=1.0, component=3), "dynamic.policies[0].component"),
    ]
    for pj, field in cases:
        with pytest.raises(SpecError) as exc:
            engine.generate(PROMPT, PARAMS, dynamic={"policies": [{**pj, "vector": list(map(float, pj["vector"]))}
                                                                    if "vector" in pj else pj]})
        assert exc.value.field == field, (pj, exc.value)
    assert engine.generate(PROMPT, GenerationParams(max_tokens=2)).token_ids


def test_fit_probe_from_two_prompt_sets(engine, tasks):
    facts = tasks["facts"]
    pos = [f["prompt"] for f in facts if f["relation"] == "capital"][:4]
    neg = [f["prompt"] for f in facts if f["relation"] != "capital"][:4]
    assert len(pos) == 4 and len(neg) == 4
    for method in ("mean_diff", "least_squares", "logistic"):
        out = engine.fit_probe(f"fit-{method}", "L4.post_block", pos, neg, method=method)
        try:
            p = out["probe"]
            assert p.kind == ("direction" if method == "mean_diff" else "linear")
            assert min(out["positive_scores"]) > max(out["negative_scores"]), method  # separates its training sets
            assert any(x["name"] == p.name for x in engine.list_probes())
        finally:
            engine.delete_probe(f"fit-{method}")


def test_a_dynamic_request_salts_its_kv_from_its_first_generated_position(engine, probe, steer_vec):
    """The request carries the seam's KV salt from position n_prompt on (tests/test_seam.py checks
    that the salt covers exactly the blocks ending after that position): its prompt blocks stay
    shareable, no block holding a generated position is ever reused by another request. (On the
    bundled CPU engine a KV block is larger than the model's context, so reuse itself cannot be
    observed here.)"""
    from engine_ext.dynamic.specs import DYNAMIC_ARGS_KEY
    from engine_ext.program import KV_SALT_KEY

    pol = Policy.make(probe=probe.name, sites=[STEER_SITE], vector=steer_vec, on=1.0)
    prep = engine._prepare(PROMPT, PARAMS, None, dynamic=DynamicRequest.make([pol]))
    extra = prep.sampling.extra_args
    first, salt = extra[KV_SALT_KEY]
    assert first == len(prep.ids) and salt.endswith(prep.key)
    assert DYNAMIC_ARGS_KEY in extra
    other = engine._prepare(PROMPT, PARAMS, None, dynamic=DynamicRequest.make([pol]))
    assert other.sampling.extra_args[KV_SALT_KEY][1] != salt  # never shared between two dynamic requests
    static = Interventions(steer=(Steer.make([STEER_SITE], steer_vec, positions=[2]),))
    both = engine._prepare(PROMPT, PARAMS, static, dynamic=DynamicRequest.make([pol]))
    assert both.sampling.extra_args[KV_SALT_KEY][0] == 2  # the earlier of the static and the dynamic start
    plain = engine._prepare(PROMPT, PARAMS, None)
    assert plain.sampling.extra_args is None


def test_dynamic_action_composes_with_static_steering_at_the_same_site(engine, hf_ref, probe, steer_vec):
    """Static steering of every generated position at the policy's own site, plus the policy: the
    engine adds the policy's vector on top of the static slot (static first, then dynamic), as
    the oracle does with the two edits in that order."""
    static_vec = _rng_vec(9) * 2.0
    _, scores = baseline_scores(engine, probe, steer_vec)
    on = float(np.median(scores)) + 1e-3
    pol = Policy.make(probe=probe.name, sites=[STEER_SITE], vector=steer_vec, on=on, off=on - 1.0, scale=1.0)
    spec = Interventions(steer=(Steer.make([STEER_SITE], static_vec, positions="all_generated"),))
    g = engine.generate(PROMPT, PARAMS, spec, dynamic=DynamicRequest.make([pol]))
    assert g.intervention.status == "ok", g.intervention.errors
    trace = g.intervention.dynamic["trace"][0]
    n = len(g.prompt_token_ids)
    # the oracle, by hand: static edit at every generated position, the policy's on top
    states = PolicyState.start(pol)
    ids, decided, ref = list(g.prompt_token_ids), {}, []
    for _ in range(PARAMS.max_tokens):
        gen_pos = list(range(n, len(ids)))
        edits = [RefEdit.steer((2, "post_attn"), static_vec, positions=gen_pos)] if gen_pos else []
        edits += [RefEdit.steer((2, "post_attn"), steer_vec, scale=decided[p], positions=[p]) for p in gen_pos if decided.get(p)]
        run = hf_ref.run(ids, edits, capture=[(3, "post_block")], n_prompt=n)
        score = float(probe.scores(run.captures[(3, "post_block")][-1].numpy())[0])
        ref.append((score, bool(decided.get(len(ids) - 1))))
        decided[len(ids)] = states.decide(score)
        ids.append(int(run.logits[-1].argmax()))
    near = min(abs(s - t) for s, _ in ref for t in (on, on - 1.0))
    assert any(e["engaged"] for e in trace) and not all(e["engaged"] for e in trace[1:])
    if near > MARGIN:
        assert g.token_ids == ids[n:]
        assert [e["engaged"] for e in trace] == [e for _, e in ref]
    assert_scores_close([e["score"] for e in trace][: len(ref)], [s for s, _ in ref])
