"""The reference fork's declarative steering gates (`steering` on `/v1/completions` and
`/v1/chat/completions`, issue 16) on the real engine (CPU, float32).

Each scope x trigger x apply the fork accepts is checked token by token against the transformers
oracle steering by hand the positions the fork's semantics name (the fork evaluates gates from the
first generated token fed back, position n, and its actions apply from the next step, n + 1):

* `always` + `this_token` / `rest_of_request` / `rest_of_conversation` add == static steering at
  every position from n + 1 on; `always` + `next_step` add steers position n + 1 only;
* a host probe (`next_step` / `rest_of_request`) whose threshold sits between the scores fires at
  a known position k and engages at k + 1 exactly (the pulse at k + 1 only);
* `this_token` + probe add (the fork's per-row in-graph monitor): at the probe's site only, the
  request's row term there is scaled per position by the soft gate of that *same* position's
  pre-edit score (the oracle runs `GateState` by hand, as tests/test_dynamic_steering.py runs
  `PolicyState`, and the gate with `RefEdit.gate`); the g the op used is reported per position; a
  probe crossing its threshold at a known position changes that position's token, not the next;
* `attenuate` scales the request's own static decode steering from n + 1 on;
* `rest_of_conversation` latches a registered name across requests with the same
  `conversation_id` and disengages once the name is re-registered with other content.

Refused combinations and malformed fields are a 400 naming the field; the engine keeps serving.
"""

from __future__ import annotations

import numpy as np
import pytest

from app.api.compat import completions as completion_extras
from app.api.compat import gates as gate_compat
from app.api.routes.fork_registry import VectorRegistry
from app.api.schemas.generation import CompletionRequest
from app.fork.vectors import pack_vectors
from engine_ext import GenerationParams
from engine_ext.dynamic.gates import GateSet, GateState
from engine_ext.dynamic.specs import DynamicRequest
from engine_ext.reference.hf import RefEdit

PROMPT = "Once upon a time"
MAX_TOKENS = 8
PARAMS = GenerationParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
#: the action steers below the probe (the probe sees it), as in tests/test_dynamic_steering.py
STEER_LAYER, STEER_HOOK = 2, "post_attn"
PROBE_LAYER, PROBE_HOOK = 3, "post_block"
#: margin kept between any score and a threshold placed between scores (score units)
MARGIN = 0.5


def _vec(seed: int, scale: float = 1.0, n: int = 192) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)


def packed(vec: np.ndarray, layer: int = STEER_LAYER, hook: str = STEER_HOOK) -> dict:
    return {hook: pack_vectors(vec[None], [layer])}


def inline(vec: np.ndarray, layer: int = STEER_LAYER, hook: str = STEER_HOOK) -> dict:
    return {"kind": "inline", "packed": packed(vec, layer, hook)}


def add_gate(scope: str, steer: dict, when: dict | None = None, strength: float | None = None) -> dict:
    apply = {"kind": "add", "steer": steer}
    if strength is not None:
        apply["strength"] = strength
    return {"when": when or {"kind": "always"}, "scope": scope, "apply": apply}


def probe_when(vec: np.ndarray, threshold: float, sharpness: float | None = None) -> dict:
    w = {"kind": "probe", "probe": inline(vec, PROBE_LAYER, PROBE_HOOK), "threshold": threshold}
    if sharpness is not None:
        w["sharpness"] = sharpness
    return w


@pytest.fixture(scope="module")
def steer_vec():
    return _vec(1, 10.0)


@pytest.fixture(scope="module")
def probe_vec():
    return _vec(0)


@pytest.fixture(scope="module")
def registry():
    return VectorRegistry()


def run_gates(engine, steering, *, registry=None, cid=None, latches=None, prompt=PROMPT, **fork_fields):
    """The completions route's path without HTTP: the fork fields -> spec + gate set -> engine."""
    registry = registry or VectorRegistry()
    req = CompletionRequest(prompt=prompt, max_tokens=MAX_TOKENS, steering=steering, conversation_id=cid, **fork_fields)
    extras = completion_extras.build(req, engine, resolve=registry.resolve)
    gs = gate_compat.gate_set(extras.gates, extras.static_decode, cid, registry, latches or gate_compat.ConversationLatches())
    dyn = DynamicRequest(conversation_id=cid, gates=gs) if gs is not None else None
    g = engine.generate(prompt, PARAMS, None if extras.spec.is_empty() else extras.spec, dynamic=dyn)
    assert g.intervention is not None and g.intervention.status == "ok", g.intervention and g.intervention.errors
    return g, g.intervention.dynamic["gates"] if g.intervention.dynamic else None


def oracle_fixed(hf_ref, prompt_ids, steer_at: dict[int, list[tuple[np.ndarray, float]]], max_tokens=MAX_TOKENS):
    """Greedy generation with `scale * vector` added at the steer site at the given positions."""
    ids, n = list(prompt_ids), len(prompt_ids)
    for _ in range(max_tokens):
        edits = [RefEdit.steer((STEER_LAYER, STEER_HOOK), v, scale=s, positions=[p])
                 for p, parts in steer_at.items() if p < len(ids) for v, s in parts]
        run = hf_ref.run(ids, edits, n_prompt=n)
        ids.append(int(run.logits[-1].argmax()))
    return ids[n:]


def oracle_gates(hf_ref, prompt_ids, gs: GateSet, max_tokens=MAX_TOKENS):
    """Greedy generation with the gate set run by hand (`GateState` on the oracle's host-probe
    scores; each component's vectors added at the next position; the row gate of a `this_token`
    probe, `RefEdit.gate`, at its probe's site wherever the components apply). Returns the
    tokens, the decided scales per position and the row gate's (score, g) per position."""
    ids, n = list(prompt_ids), len(prompt_ids)
    state = GateState(gs, n)
    comps = gs.components()
    decided: dict[int, tuple[float, ...]] = {}
    sites = sorted({(g.probe.site.layer, g.probe.site.hook) for g in gs.gates if g.probe is not None and not g.soft})
    rg = gs.gates[gs.row_gate] if gs.row_gate is not None else None
    soft: dict[int, tuple[float, float]] = {}
    for _ in range(max_tokens):
        edits = []
        for pos in range(n, len(ids)):
            here = decided.get(pos, ())
            for (sv, _), sc in zip(comps, here):
                if sc:
                    edits += [RefEdit.steer((s.layer, s.hook), v, scale=sc, positions=[pos]) for s, v in zip(sv.sites, sv.vectors)]
            if rg is not None and state.row_gated(here):
                term = gs.row_term(here, rg.probe.site)
                edits.append(RefEdit.gate((rg.probe.site.layer, rg.probe.site.hook), rg.probe.weights[0],
                                          np.zeros(rg.probe.weights.shape[1], np.float32) if term is None else term,
                                          threshold=rg.threshold, sharpness=rg.sharp, positions=[pos]))
        run = hf_ref.run(ids, edits, capture=sites, n_prompt=n)
        last = len(ids) - 1
        scores = [float(g.probe.scores(run.captures[(g.probe.site.layer, g.probe.site.hook)][last].numpy())[0])
                  if g.probe is not None and not g.soft else None for g in gs.gates]
        if rg is not None and last in run.gates.get((rg.probe.site.layer, rg.probe.site.hook), {}):
            soft[last] = run.gates[(rg.probe.site.layer, rg.probe.site.hook)][last]
        decided[last + 1] = state.decide(last, scores)
        ids.append(int(run.logits[-1].argmax()))
    return ids[n:], decided, soft


def steered_positions(gates: dict) -> list[int]:
    return [e["position"] for e in gates["trace"] if any(e["scales"])]


@pytest.fixture(scope="module")
def from_second(engine, hf_ref, steer_vec):
    """The oracle's tokens with the steer vector at every position from n + 1 on."""
    ids = engine.tokenize(PROMPT)
    n = len(ids)
    return oracle_fixed(hf_ref, ids, {p: [(steer_vec, 1.0)] for p in range(n + 1, n + MAX_TOKENS)})


# ---- always ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("scope", ["this_token", "rest_of_request", "rest_of_conversation"])
def test_always_add_equals_static_steering_from_the_step_the_fork_starts_it(engine, registry, steer_vec, from_second, scope):
    registry.register("gates-steer", "steer", {(STEER_HOOK, STEER_LAYER): steer_vec})
    steer = {"kind": "name", "name": "gates-steer"} if scope == "rest_of_conversation" else inline(steer_vec)
    g, gates = run_gates(engine, [add_gate(scope, steer)], registry=registry)
    n = len(g.prompt_token_ids)
    assert gates["armed_at"] == n and gates["fired"] == [0] and not gates["pulse"]
    assert steered_positions(gates) == list(range(n + 1, n + MAX_TOKENS - 1))
    assert g.token_ids == from_second
    plain = engine.generate(PROMPT, PARAMS)
    assert g.token_ids[:2] == plain.token_ids[:2] and g.token_ids != plain.token_ids


def test_always_next_step_add_steers_exactly_one_token(engine, hf_ref, steer_vec):
    g, gates = run_gates(engine, [add_gate("next_step", inline(steer_vec), strength=2.0)])
    n = len(g.prompt_token_ids)
    assert gates["pulse"] and steered_positions(gates) == [n + 1]
    assert g.token_ids == oracle_fixed(hf_ref, g.prompt_token_ids, {n + 1: [(steer_vec, 2.0)]})
    assert g.token_ids != engine.generate(PROMPT, PARAMS).token_ids


# ---- host probes ------------------------------------------------------------------------------------
def _known_step(scores: list[float]) -> tuple[int, float]:
    """An index k >= 1 whose score exceeds every earlier one by a margin, and a threshold between."""
    ks = [i for i in range(1, len(scores)) if scores[i] > max(scores[:i]) + 2 * MARGIN]
    assert ks, f"no score rises above the earlier ones: {scores}"
    k = ks[0]
    return k, 0.5 * (scores[k] + max(scores[:k]))


@pytest.mark.parametrize("scope", ["next_step", "rest_of_request"])
def test_a_probe_firing_at_a_known_step_engages_exactly_one_step_later(engine, hf_ref, steer_vec, probe_vec, scope):
    never = [add_gate(scope, inline(steer_vec), when=probe_when(probe_vec, 1e30))]
    plain, gates = run_gates(engine, never)
    n = len(plain.prompt_token_ids)
    assert gates["armed_at"] is None and not steered_positions(gates)
    assert plain.token_ids == engine.generate(PROMPT, PARAMS).token_ids
    # gates are evaluated from the first generated token fed back (position n) on, not at the prompt
    trace = gates["trace"]
    assert trace[0]["position"] == n - 1 and [e["position"] for e in trace[1:]] == list(range(n, n + MAX_TOKENS - 1))
    scores = [e["scores"][0] for e in trace[1:]]
    # the probe direction, or its opposite, rises at some step
    sign = 1.0
    if not any(scores[i] > max(scores[:i]) + 2 * MARGIN for i in range(1, len(scores))):
        sign, scores = -1.0, [-s for s in scores]
    k, thr = _known_step(scores)
    g, gates = run_gates(engine, [add_gate(scope, inline(steer_vec), when=probe_when(sign * probe_vec, thr))])
    fired_at = n + k
    assert gates["armed_at"] == fired_at
    want = [fired_at + 1] if scope == "next_step" else list(range(fired_at + 1, n + MAX_TOKENS - 1))
    assert steered_positions(gates) == want
    # position p's token is sampled from the forward at p: unchanged up to the first steered one
    assert g.token_ids[: k + 2] == plain.token_ids[: k + 2]
    assert g.token_ids == oracle_fixed(hf_ref, g.prompt_token_ids, {p: [(steer_vec, 1.0)] for p in want})
    st = engine.dynamic_status()
    assert st["determinism"]["consistent"] is True
    assert not any(name.startswith("~") for w in st["workers"] for name in w["probes"])


def _plain_probe_scores(engine, probe_vec) -> list[float]:
    """The probe's scores at the probe site on the unsteered run, positions n - 1, n, n + 1, ...
    (a host probe that never fires reads them)."""
    _, gates = run_gates(engine, [add_gate("rest_of_request", inline(_vec(9)), when=probe_when(probe_vec, 1e30))])
    return [e["scores"][0] for e in gates["trace"]]


def test_this_token_probe_add_is_a_soft_per_token_gate(engine, hf_ref, steer_vec, probe_vec):
    # threshold and sharpness put the gate between 0 and 1 for the scores this prompt gives
    scores = _plain_probe_scores(engine, probe_vec)[1:]
    thr, sharp = float(np.median(scores)), 4.0 / (float(np.std(scores)) + 1e-6)
    # the add vector at the probe's site (gated there) and at a lower site (the fork: ungated there)
    steer = {"kind": "inline", "packed": {**packed(0.5 * steer_vec), **packed(_vec(2, 10.0), PROBE_LAYER, PROBE_HOOK)}}
    raw = [add_gate("this_token", steer, when=probe_when(probe_vec, thr, sharp))]
    g, gates = run_gates(engine, raw)
    n = len(g.prompt_token_ids)
    assert gates["armed_at"] == n and not gates["pulse"]
    trace = {e["position"]: e for e in gates["trace"]}
    # the scales carry no soft factor: the component applies at full strength from n + 1 on ...
    assert [trace[p]["scales"] for p in sorted(trace)] == [[0.0], [0.0]] + [[1.0]] * (MAX_TOKENS - 2)
    # ... and the op's g of each gated position is reported (none before the gate acts)
    soft = {p: e["soft"][0] for p, e in trace.items()}
    assert soft[n - 1] is None and soft[n] is None
    assert all(soft[p] is not None for p in range(n + 1, n + MAX_TOKENS - 1))
    assert any(0.01 < soft[p] < 0.99 for p in range(n + 1, n + MAX_TOKENS - 1)), soft  # soft, per token
    extras = completion_extras.build(CompletionRequest(prompt=PROMPT, steering=raw), engine)
    ref_ids, decided, ref_soft = oracle_gates(hf_ref, g.prompt_token_ids, GateSet(tuple(extras.gates)))
    assert g.token_ids == ref_ids
    assert sorted(ref_soft) == list(range(n + 1, n + MAX_TOKENS - 1))
    # g per position equals the oracle's (vLLM's CPU kernels vs transformers: fp32 last bits)
    assert np.allclose([soft[p] for p in sorted(ref_soft)], [ref_soft[p][1] for p in sorted(ref_soft)], rtol=0, atol=1e-3)
    assert np.allclose([trace[p]["scores"][0] for p in sorted(ref_soft)], [ref_soft[p][0] for p in sorted(ref_soft)],
                       rtol=1e-3, atol=1e-3)
    assert engine.dynamic_status()["determinism"]["consistent"] is True


def test_a_soft_gate_beside_a_host_probe_gate_reports_its_g(engine, steer_vec, probe_vec):
    """A request with a host-probe gate (its rows monitored, scored on the host) and a soft
    `this_token` gate: the op's g is still reported at every gated position, the same as with the
    soft gate alone (the host-probe gate never fires here, so the two runs compute the same)."""
    scores = _plain_probe_scores(engine, probe_vec)[1:]
    thr, sharp = float(np.median(scores)), 4.0 / (float(np.std(scores)) + 1e-6)
    soft = add_gate("this_token", inline(steer_vec, PROBE_LAYER, PROBE_HOOK), when=probe_when(probe_vec, thr, sharp))
    never = add_gate("rest_of_request", inline(_vec(9)), when=probe_when(probe_vec, 1e30))
    g1, alone = run_gates(engine, [soft])
    g2, both = run_gates(engine, [never, soft])
    assert g2.token_ids == g1.token_ids
    s1 = [e["soft"][0] for e in alone["trace"]]
    s2 = [e["soft"][1] for e in both["trace"]]
    assert [x is None for x in s2] == [x is None for x in s1] and sum(x is not None for x in s1) == MAX_TOKENS - 2
    assert np.allclose([x for x in s2 if x is not None], [x for x in s1 if x is not None], rtol=0, atol=1e-6)
    assert all(e["soft"][0] is None for e in both["trace"])  # the host-probe gate has no row gate


def test_this_token_gate_acts_on_the_token_whose_score_crosses(engine, hf_ref, steer_vec, probe_vec):
    """A sharp gate whose probe crosses its threshold first at a known position q: the tokens and
    logprobs of every earlier forward are the plain run's, the forward at q is steered (the old
    one-token-late rule would have steered q + 1 first)."""
    scores = _plain_probe_scores(engine, probe_vec)[1:]  # positions n, n + 1, ...
    sign = 1.0
    if not any(scores[i] > max(scores[:i]) + 2 * MARGIN for i in range(1, len(scores))):
        sign, scores = -1.0, [-x for x in scores]
    k, thr = _known_step(scores)
    plain = engine.generate(PROMPT, PARAMS)
    n = len(plain.prompt_token_ids)
    q = n + k
    raw = [add_gate("this_token", inline(steer_vec, PROBE_LAYER, PROBE_HOOK),
                    when=probe_when(sign * probe_vec, thr, 50.0 / MARGIN))]
    g, gates = run_gates(engine, raw)
    soft = {e["position"]: e["soft"][0] for e in gates["trace"]}
    assert all(soft[p] < 1e-6 for p in range(n + 1, q)) and soft[q] > 1.0 - 1e-6, (q, soft)
    # generated token i comes from the forward at n - 1 + i: unchanged through the forward at q - 1
    i = q - n + 1
    assert g.token_ids[:i] == plain.token_ids[:i]
    assert np.allclose(g.logprobs[:i], plain.logprobs[:i], atol=1e-4)
    assert g.token_ids[i] != plain.token_ids[i] or abs(g.logprobs[i] - plain.logprobs[i]) > 1e-2
    extras = completion_extras.build(CompletionRequest(prompt=PROMPT, steering=raw), engine)
    ref_ids, _, ref_soft = oracle_gates(hf_ref, g.prompt_token_ids, GateSet(tuple(extras.gates)))
    assert g.token_ids == ref_ids
    assert ref_soft[q][1] > 1.0 - 1e-6 and all(ref_soft[p][1] < 1e-6 for p in range(n + 1, q))


# ---- attenuate ------------------------------------------------------------------------------------
def test_attenuate_scales_the_requests_static_decode_steering(engine, hf_ref, steer_vec):
    static = {"decode_steering_vectors": packed(steer_vec)}
    g, gates = run_gates(engine, [{"when": {"kind": "always"}, "scope": "rest_of_request",
                                   "apply": {"kind": "attenuate", "strength": 0.5}}], **static)
    n = len(g.prompt_token_ids)
    assert gates["armed_at"] == n and gates["attenuate"] == 0.5
    want = {n: [(steer_vec, 1.0)], **{p: [(steer_vec, 0.5)] for p in range(n + 1, n + MAX_TOKENS)}}
    assert g.token_ids == oracle_fixed(hf_ref, g.prompt_token_ids, want)
    full = engine.generate(PROMPT, PARAMS, completion_extras.build(CompletionRequest(prompt=PROMPT, **static), engine).spec)
    assert g.token_ids != full.token_ids


# ---- over HTTP --------------------------------------------------------------------------------------
def _complete(http, body: dict) -> dict:
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True,
                                           "logprobs": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _tokens(body: dict) -> list[str]:
    return body["choices"][0]["logprobs"]["tokens"]


def _register(http, name: str, vec: np.ndarray, kind: str = "steer") -> None:
    r = http.post("/v1/steering/vectors/register", json={"name": name, "kind": kind, "packed": packed(vec)})
    assert r.status_code == 200, r.text


def test_rest_of_conversation_latches_by_name_and_disengages_on_new_content(http, engine, steer_vec, from_second):
    steered, plain = engine.token_strings(from_second), _tokens(_complete(http, {}))
    assert steered != plain
    _register(http, "gates-conv", steer_vec)
    gate = add_gate("rest_of_conversation", {"kind": "name", "name": "gates-conv"})
    try:
        first = _complete(http, {"steering": [gate], "conversation_id": "gates-c1"})
        assert _tokens(first) == steered and first["conversation_id"] == "gates-c1"
        assert first["intervention"]["dynamic"]["gates"]["latch"][0][0] == "gates-conv"
        # a later turn is bridged with the latched vector: its own gates are not evaluated (the fork)
        own = add_gate("next_step", inline(_vec(7, 8.0)))
        second = _complete(http, {"conversation_id": "gates-c1", "steering": [own]})
        assert _tokens(second) == steered and second["intervention"]["dynamic"]["gates"]["bridged"] is True
        assert _tokens(_complete(http, {"conversation_id": "gates-c1"})) == steered
        # another conversation is not latched
        assert _tokens(_complete(http, {"conversation_id": "gates-c2"})) == plain
        # the name re-registered with other content: the latch disengages (and stays dropped)
        _register(http, "gates-conv", steer_vec * 2)
        assert _tokens(_complete(http, {"conversation_id": "gates-c1"})) == plain
        _register(http, "gates-conv", steer_vec)
        assert _tokens(_complete(http, {"conversation_id": "gates-c1"})) == plain
        # without a conversation_id, rest_of_conversation steers the request only
        assert _tokens(_complete(http, {"steering": [gate]})) == steered
        # a streamed turn latches as well
        body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True, "steering": [gate],
                "conversation_id": "gates-c3"}
        with http.stream("POST", "/v1/completions", json=body) as s:
            assert s.status_code == 200 and "gates" in "".join(s.iter_lines())
        assert _tokens(_complete(http, {"conversation_id": "gates-c3"})) == steered
    finally:
        http.post("/v1/steering/vectors/unregister", json={"name": "gates-conv", "kind": "steer"})


def test_named_probe_and_steer_sources_resolve_in_the_fork_registry(http, engine, steer_vec, probe_vec, from_second):
    r = http.post("/v1/steering/vectors/register", json={"name": "gates-probe", "kind": "probe",
                                                         "packed": packed(probe_vec, PROBE_LAYER, PROBE_HOOK)})
    assert r.status_code == 200, r.text
    _register(http, "gates-named", steer_vec)
    try:
        when = {"kind": "probe", "probe": {"kind": "name", "name": "gates-probe"}, "threshold": -1e30}
        body = _complete(http, {"steering": [add_gate("rest_of_request", {"kind": "name", "name": "gates-named"}, when=when)]})
        gates = body["intervention"]["dynamic"]["gates"]
        n = gates["trace"][1]["position"]
        assert gates["armed_at"] == n and _tokens(body) == engine.token_strings(from_second)
        # the probe's score is the registered direction's projection (the same as an inline source's)
        inline_body = _complete(http, {"steering": [add_gate("rest_of_request", inline(steer_vec),
                                                              when=probe_when(probe_vec, -1e30))]})
        assert [e["scores"] for e in inline_body["intervention"]["dynamic"]["gates"]["trace"]] == \
            [e["scores"] for e in gates["trace"]]
        # a probe name is not a steer name (two namespaces, as in the fork)
        r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "steering": [
            add_gate("rest_of_request", {"kind": "name", "name": "gates-probe"})]})
        assert r.status_code == 400 and r.json()["field"] == "steering[0].apply.steer.name"
    finally:
        http.post("/v1/steering/vectors/unregister", json={"name": "gates-probe", "kind": "probe"})
        http.post("/v1/steering/vectors/unregister", json={"name": "gates-named", "kind": "steer"})


def test_chat_completions_take_the_gates(http, engine, steer_vec):
    from tests.test_api_fork_surface import TEMPLATE

    msgs = [{"role": "user", "content": "Hello"}]
    body = {"messages": msgs, "chat_template": TEMPLATE, "max_tokens": 4, "ignore_eos": True}
    plain = http.post("/v1/chat/completions", json=body).json()
    r = http.post("/v1/chat/completions", json={**body, "steering": [add_gate("rest_of_request", inline(steer_vec * 4))]})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["intervention"]["dynamic"]["gates"]["armed_at"] is not None
    assert out["choices"][0]["message"]["content"] != plain["choices"][0]["message"]["content"]
    bad = http.post("/v1/chat/completions", json={**body, "steering": [{"when": {"kind": "always"}, "scope": "x",
                                                                        "apply": {"kind": "attenuate", "strength": 1}}]})
    assert bad.status_code == 400 and bad.json()["field"] == "steering[0].scope"


def _bad_cases(h: int) -> list[tuple[object, str, str]]:
    ok_steer = inline(np.ones(h, np.float32))
    ok_probe = inline(np.ones(h, np.float32), PROBE_LAYER, PROBE_HOOK)
    always = {"kind": "always"}
    att = {"kind": "attenuate", "strength": 0.5}
    add = {"kind": "add", "steer": ok_steer}
    probe = {"kind": "probe", "probe": ok_probe, "threshold": 0.0}
    two_rows = {"kind": "inline", "packed": {"post_block": pack_vectors(np.ones((2, h), np.float32), [1, 2])}}
    return [
        ({"when": always}, "steering", "must be a list"),
        (["gate"], "steering[0]", "must be an object"),
        ([{"when": always, "scope": "rest_of_request"}], "steering[0].apply", "required"),
        ([{"when": always, "scope": "rest_of_request", "apply": add, "extra": 1}], "steering[0].extra", "unknown"),
        ([{"when": {"kind": "sometimes"}, "scope": "rest_of_request", "apply": add}], "steering[0].when.kind", "always"),
        ([{"when": always, "scope": "forever", "apply": add}], "steering[0].scope", "this_token"),
        ([{"when": always, "scope": "rest_of_request", "apply": {"kind": "clamp"}}], "steering[0].apply.kind", "not supported"),
        ([{"when": always, "scope": "rest_of_request", "apply": {"kind": "scale"}}], "steering[0].apply.kind", "add"),
        ([{"when": probe, "scope": "this_token", "apply": att}], "steering[0].scope", "not supported"),
        ([{"when": always, "scope": "rest_of_conversation", "apply": add}], "steering[0].apply.steer", "registered vector name"),
        ([{"when": {**probe, "threshold": "high"}, "scope": "next_step", "apply": add}], "steering[0].when.threshold", "number"),
        ([{"when": {k: v for k, v in probe.items() if k != "threshold"}, "scope": "next_step", "apply": add}],
         "steering[0].when.threshold", "required"),
        ([{"when": {**probe, "sharpness": -1.0}, "scope": "next_step", "apply": add}], "steering[0].when.sharpness", "non-negative"),
        ([{"when": {**probe, "probe": two_rows}, "scope": "next_step", "apply": add}], "steering[0].when.probe.packed", "exactly one"),
        ([{"when": {**probe, "probe": {"kind": "name", "name": "gates-nope"}}, "scope": "next_step", "apply": add}],
         "steering[0].when.probe.name", "unknown probe vector name"),
        ([{"when": probe, "scope": "next_step", "apply": {"kind": "add", "steer": {"kind": "name", "name": ""}}}],
         "steering[0].apply.steer.name", "non-empty"),
        ([{"when": always, "scope": "next_step", "apply": {"kind": "add", "steer": {"kind": "file"}}}],
         "steering[0].apply.steer.kind", "'name' or 'inline'"),
        ([{"when": always, "scope": "next_step", "apply": {"kind": "add", "steer": {"kind": "inline", "packed": {}}}}],
         "steering[0].apply.steer.packed", "non-empty"),
        ([{"when": always, "scope": "next_step", "apply": {"kind": "add", "steer": inline(np.ones(h - 1, np.float32))}}],
         "steering[0].apply.steer.packed.post_attn.shape", "hidden size"),
        ([{"when": always, "scope": "next_step", "apply": {"kind": "add", "steer": inline(np.ones(h, np.float32), 99)}}],
         "steering[0].apply.steer.packed.post_attn.layer_indices[0]", "out of range"),
        ([{"when": always, "scope": "next_step", "apply": {"kind": "add", "steer": ok_steer, "strength": None}}],
         "steering[0].apply.strength", "number"),
        ([{"when": always, "scope": "next_step", "apply": {"kind": "attenuate"}}], "steering[0].apply.strength", "required"),
        ([{"when": always, "scope": "next_step", "apply": add}] * 17, "steering", "at most"),
    ]


def test_refused_gates_are_a_400_naming_the_field_and_the_engine_keeps_serving(http, engine):
    before = _complete(http, {})
    for steering, field, words in _bad_cases(engine.info.hidden_size):
        for body in ({"steering": steering}, {"steering": steering, "stream": True}):
            r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, **body})
            assert r.status_code == 400, (field, r.text)
            err = r.json()
            assert err["field"] == field and err["error"].startswith(field), (field, err)
            assert words in err["error"], (words, err)
    after = _complete(http, {})
    assert _tokens(after) == _tokens(before)
    assert http.get("/v1/status").json()["in_flight_requests"] == 0
    # an empty list is no gates (the fork's `if not raw`)
    assert "intervention" not in _complete(http, {"steering": []})


# ---- the decision rule alone (no engine) ------------------------------------------------------------
def _gate(scope: str, when: str = "always", apply: str = "add", strength: float = 1.0, threshold: float = 0.0,
          sharpness: float = 1.0):
    from engine_ext.dynamic.gates import Gate, SiteVectors
    from engine_ext.dynamic.specs import Probe
    from engine_ext.sites import Site

    probe = Probe("~p", Site(3, "post_block"), "direction", np.ones((1, 4), np.float32), np.zeros(1, np.float32)) if when == "probe" else None
    steer = SiteVectors((Site(2, "post_attn"),), (np.ones(4, np.float32),)) if apply == "add" else None
    return Gate(scope, when, probe, threshold, sharpness, apply, strength, steer, None)


def _run(gs: GateSet, scores_per_pos: list[list[float | None]], n: int = 5) -> list[tuple[float, ...]]:
    """Decisions from the prompt's last position (n - 1) on; returns the scales at n, n + 1, ..."""
    st = GateState(gs, n)
    return [st.decide(n - 1 + i, s) for i, s in enumerate(scores_per_pos)]


def test_gates_arm_together_once_and_the_widest_scope_sets_the_lifetime():
    pulse, sticky = _gate("next_step"), _gate("rest_of_request", "probe", threshold=1.0)
    # the probe does not fire at the arming evaluation: the pulse arms the request alone, and a
    # later firing of the probe changes nothing (gates are not evaluated once armed)
    got = _run(GateSet((pulse, sticky)), [[None, 9.0], [None, 0.0], [None, 9.0], [None, 9.0]])
    assert got == [(0.0, 0.0), (1.0, 0.0), (0.0, 0.0), (0.0, 0.0)]
    # both fire at once: the widest scope wins and the pulse's vector stays too (one override in the fork)
    got = _run(GateSet((pulse, sticky)), [[None, 0.0], [None, 9.0], [None, 0.0], [None, 0.0]])
    assert got == [(0.0, 0.0), (1.0, 1.0), (1.0, 1.0), (1.0, 1.0)]


def test_probe_trigger_is_strict_and_sharpness_zero_counts_as_one():
    at = _gate("rest_of_request", "probe", threshold=2.0, sharpness=0.0)
    # the prompt's 5.0 is not evaluated, 2.0 == threshold does not fire, 2.5 does (sharpness 0 would never)
    assert _run(GateSet((at,)), [[5.0], [2.0], [2.5], [0.0]]) == [(0.0,), (0.0,), (1.0,), (1.0,)]
    # the prompt's last position is never evaluated (the fork's decode phase)
    assert _run(GateSet((_gate("next_step"),)), [[None], [None], [None]]) == [(0.0,), (1.0,), (0.0,)]


def test_attenuate_is_sticky_alone_ends_with_a_pulse_and_scales_the_adds():
    from engine_ext.dynamic.gates import SiteVectors
    from engine_ext.sites import Site

    static = SiteVectors((Site(2, "post_attn"),), (np.ones(4, np.float32),))
    att = _gate("next_step", apply="attenuate", strength=0.25)
    assert _run(GateSet((att,), static), [[None]] * 4) == [(0.0,), (-0.75,), (-0.75,), (-0.75,)]
    both = GateSet((_gate("next_step", strength=2.0), att), static)
    assert _run(both, [[None, None]] * 4) == [(0.0, 0.0), (0.5, -0.75), (0.0, 0.0), (0.0, 0.0)]
    # a negative strength is clipped at 0 (the fork's max(0, strength))
    neg = GateSet((_gate("rest_of_request", apply="attenuate", strength=-3.0),), static)
    assert _run(neg, [[None]] * 3)[-1] == (-1.0,)


def test_a_bridged_request_ignores_its_own_gates():
    from engine_ext.dynamic.gates import SiteVectors
    from engine_ext.sites import Site

    latched = SiteVectors((Site(2, "post_attn"),), (np.ones(4, np.float32),))
    gs = GateSet((_gate("next_step", strength=3.0),), None, ((latched, 0.5),))
    assert _run(gs, [[None]] * 4) == [(0.0, 0.0), (0.5, 0.0), (0.5, 0.0), (0.5, 0.0)]
