"""Directional clamps (the reference fork's `steering_clamps`): the spec and its errors, the fork's
three wire forms (pure), and on the real engine (CPU, float32) against the transformers oracle —
one site, each phase, combined with additive steering, several directions at once, global clamps,
and through the HTTP API in the fork's forms."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from engine_ext import GenerationParams, SpecError
from engine_ext.program import ModelDims, PromptInfo, compile_program, decode_vector
from engine_ext.reference.hf import RefEdit
from engine_ext.specs import Capture, Clamp, Interventions, Steer
from app.fork.clamps import parse_clamp_spec
from app.fork.vectors import pack_vectors
from tests.test_interventions import LOGPROB_ATOL, ONE, _vec, fact

DIMS = ModelDims(num_layers=4, hidden_size=8, vocab_size=100, embedding_std=1.0)
V8 = [1.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0]


# ---- the spec ------------------------------------------------------------------------------------
def test_clamp_forms_and_unit_direction():
    c = Clamp.make("L1.post_block", V8, value=0.5)
    assert (c.min, c.max, c.strength, c.positions, c.phase) == (0.5, 0.5, 1.0, "all", "both")
    assert np.allclose(c.unit(), np.asarray(V8) / 3.0) and abs(np.linalg.norm(c.unit()) - 1) < 1e-6
    one_sided = Clamp.make("L1.post_block", V8, max=2.0, strength=0.5, phase="decode")
    assert (one_sided.min, one_sided.max) == (None, 2.0)


@pytest.mark.parametrize("kwargs, field", [
    ({}, "clamp.min"),
    ({"value": 1.0, "min": 0.0}, "clamp.value"),
    ({"min": 2.0, "max": 1.0}, "clamp.min"),
    ({"max": float("inf")}, "clamp.max"),
    ({"min": float("nan")}, "clamp.min"),
    ({"value": 0.0, "strength": 1.5}, "clamp.strength"),
    ({"value": 0.0, "strength": float("nan")}, "clamp.strength"),
    ({"value": 0.0, "phase": "both_phases"}, "clamp.phase"),
    ({"value": 0.0, "vector": [0.0] * 8}, "clamp.vector"),
    ({"value": 0.0, "vector": [1.0, float("nan")] + [0.0] * 6}, "clamp.vector"),
    ({"value": 0.0, "vector": [1.0, float("inf")] + [0.0] * 6}, "clamp.vector"),
])
def test_bad_clamps_name_the_field(kwargs, field):
    vector = kwargs.pop("vector", V8)
    with pytest.raises(SpecError) as err:
        Clamp.make("L1.post_block", vector, **kwargs)
    assert err.value.field == field


def test_clamps_compile_to_unit_directions_and_are_bounded_per_site():
    prompt = PromptInfo(list(range(5)), max_tokens=3)

    def compile_(*clamps, steer=()):
        return compile_program(Interventions(steer=steer, clamp=clamps), prompt, DIMS, key="k", named_vector_dims=lambda n: None)

    prog = compile_(Clamp.make("L1.post_block", V8, min=-1.0, phase="prefill"))
    (wire,) = prog["clamp"]
    assert np.allclose(decode_vector(wire["dir"]), np.asarray(V8) / 3.0)
    assert (wire["lo"], wire["hi"], wire["st"], wire["phase"], wire["pos"], wire["gen"]) == (-1.0, None, 1.0, "prefill", [0, 1, 2, 3, 4], True)
    # clamp-free programs carry no clamp key (their hash is what it was)
    plain = compile_(steer=(Steer.make(["L1.post_block"], V8),))
    assert "clamp" not in plain
    with pytest.raises(SpecError) as err:
        compile_(Clamp.make("L1.post_block", V8[:-1], value=0.0))
    assert err.value.field == "clamp[0].vector"
    with pytest.raises(SpecError) as err:
        compile_(Clamp.make("L9.post_block", V8, value=0.0))
    assert err.value.field == "clamp[0].sites[0]"
    # at most 4 clamps act at one (site, position); disjoint phases do not add up
    four = [Clamp.make("L2.mlp_in", V8, value=float(k)) for k in range(4)]
    compile_(*four, Clamp.make("L3.mlp_in", V8, value=0.0))
    compile_(*four[:2], *[Clamp.make("L2.mlp_in", V8, value=1.0, phase=p) for p in ("prefill", "prefill", "decode", "decode")])
    with pytest.raises(SpecError) as err:
        compile_(*four, Clamp.make(["L0.pre_attn", "L2.mlp_in"], V8, value=0.0, phase="decode"))
    assert err.value.field == "clamp[4].sites[1]" and "at most 4" in err.value.message


# ---- the fork's wire forms ---------------------------------------------------------------------------
def _wire_map(rows: np.ndarray, layers, lo, hi, st) -> dict:
    data = base64.b64encode(np.ascontiguousarray(rows, "<f8").tobytes()).decode()
    return {"hooks": {"post_block": {"shape": list(rows.shape), "layer_indices": layers, "data": data, "lo": lo, "hi": hi,
                                     "strength": st}}}


def test_the_forks_three_clamp_forms_parse_to_the_same_clamps():
    a, b = np.asarray(V8, np.float32), np.arange(1, 9, dtype=np.float32)
    entries = {"post_block": {"2": [{"vector": a.tolist(), "min": -1.0, "max": 1.0}, {"vector": b.tolist(), "value": 0.0}],
                              "1": [{"vector": b.tolist(), "max": 3.0, "strength": 0.25}]}}
    packed = {"post_block": {**pack_vectors(np.stack([a, b, b]), [2, 2, 1]), "bounds": [[-1.0, 1.0], [0.0, 0.0], [None, 3.0]],
                             "strengths": [1.0, 1.0, 0.25]}}
    wire = _wire_map(np.stack([b, a, b]), [1, 2, 2], [None, -1.0, 0.0], [3.0, 1.0, 0.0], [0.25, 1.0, 1.0])
    got = [parse_clamp_spec(form, "steering_clamps", phase="decode", num_layers=4, hidden=8) for form in (entries, packed, wire)]
    for clamps in got:
        # layers ascending, entry order kept within a layer (the fork's concatenation order)
        assert [(str(c.sites[0]), c.min, c.max, c.strength, c.phase) for c in clamps] == [
            ("L1.post_block", None, 3.0, 0.25, "decode"), ("L2.post_block", -1.0, 1.0, 1.0, "decode"),
            ("L2.post_block", 0.0, 0.0, 1.0, "decode")]
        assert [np.array_equal(c.vector, v) for c, v in zip(clamps, (b, a, b))] == [True] * 3


@pytest.mark.parametrize("spec, field", [
    ({"post_block": {"2": [{"vector": V8, "min": 2.0, "max": 1.0}]}}, "c.post_block.2[0].min"),
    ({"post_block": {"2": [{"vector": V8}]}}, "c.post_block.2[0].min"),
    ({"post_block": {"2": [{"vector": V8, "value": 1.0, "max": 1.0}]}}, "c.post_block.2[0].value"),
    ({"post_block": {"2": [{"vector": V8, "value": 1.0, "strength": -0.1}]}}, "c.post_block.2[0].strength"),
    ({"post_block": {"2": [{"vector": [0.0] * 8, "value": 1.0}]}}, "c.post_block.2[0].vector"),
    ({"post_block": {"2": [{"vector": V8[:-1], "value": 1.0}]}}, "c.post_block.2[0].vector"),
    ({"post_block": {"2": [{"vector": V8, "value": 1.0, "gain": 2}]}}, "c.post_block.2[0].gain"),
    ({"post_block": {"2": [{"value": 1.0}]}}, "c.post_block.2[0].vector"),
    ({"post_block": {"2": {"vector": V8, "value": 1.0}}}, "c.post_block.2"),
    ({"post_block": {"7": [{"vector": V8, "value": 1.0}]}}, "c.post_block.7"),
    ({"post_mlp": {"2": [{"vector": V8, "value": 1.0}]}}, "c.post_mlp"),
    ({"post_block": {**pack_vectors(np.ones((1, 8)), [1]), "bounds": [[2.0, 1.0]], "strengths": [1.0]}}, "c.post_block.bounds[0]"),
    ({"post_block": {**pack_vectors(np.ones((1, 8)), [1]), "bounds": [[0.0, 1.0]], "strengths": [2.0]}}, "c.post_block.strengths[0]"),
    ({"post_block": {**pack_vectors(np.zeros((1, 8)), [1]), "bounds": [[0.0, 1.0]], "strengths": [1.0]}}, "c.post_block.data"),
    ({"post_block": {**pack_vectors(np.ones((1, 8)), [1]), "bounds": [[0.0, 1.0]]}}, "c.post_block.strengths"),
    (_wire_map(np.ones((1, 8)), [1], [None], [float("nan")], [1.0]), "c.hooks.post_block.hi[0]"),
    (_wire_map(np.ones((1, 7)), [1], [None], [1.0], [1.0]), "c.hooks.post_block.shape"),
    ("all", "c"),
])
def test_bad_fork_clamps_name_the_field(spec, field):
    with pytest.raises(SpecError) as err:
        parse_clamp_spec(spec, "c", phase="both", num_layers=4, hidden=8)
    assert err.value.field == field, err.value


# ---- on the engine -------------------------------------------------------------------------------
def _unit(engine, seed):
    v = _vec(engine, seed, 1.0).astype(np.float64)
    return (v / np.linalg.norm(v)).astype(np.float32)


def _proj(captures: dict, site: tuple[int, str], u: np.ndarray) -> dict[int, float]:
    layer, hook = site
    return {p: float(np.dot(x.astype(np.float64), u)) for (lay, h, p), x in captures.items() if (lay, h) == (layer, hook)}


GEN4 = GenerationParams(max_tokens=4, ignore_eos=True, logprobs=0)


def _vs_oracle(engine, hf_ref, prompt, spec: Interventions, edits: list[RefEdit]):
    gen = engine.generate(prompt, GEN4, spec)
    assert spec is None or gen.intervention.status == "ok", gen.intervention.errors
    ref = hf_ref.generate(engine.tokenize(prompt), 4, edits=edits, stop_at_eos=False)
    assert gen.token_ids == ref.token_ids
    assert np.allclose(gen.logprobs, ref.logprobs, atol=LOGPROB_ATOL)
    return gen


@pytest.mark.parametrize("site", ["L2.post_block", "L1.mlp_in"])
def test_clamp_at_one_site_bounds_the_projection_and_matches_the_oracle(engine, hf_ref, tasks, site):
    prompt = fact(tasks, 3)["prompt"]
    layer, hook = int(site[1]), site.split(".")[1]
    u = _unit(engine, 40)
    plain = engine.capture(prompt, [site], "all_prompt").captures
    p0 = _proj(plain, (layer, hook), u)
    hi = float(np.percentile(list(p0.values()), 40))  # binds at most positions, not at all
    clamp = Clamp.make([site], u * 3.0, max=hi)  # any norm: the direction is normalised
    n = len(engine.tokenize(prompt))
    _vs_oracle(engine, hf_ref, prompt, Interventions(clamp=(clamp,)),
               [RefEdit.clamp((layer, hook), u * 3.0, max=hi, positions=range(n), gen=True)])
    got = engine.generate(prompt, ONE, Interventions(clamp=(clamp,), capture=Capture.make([site], "all_prompt"))).captures
    p1 = _proj(got, (layer, hook), u)
    moved = 0
    for p, before in p0.items():
        x, x0 = got[(layer, hook, p)], plain[(layer, hook, p)]
        if before <= hi:  # inside the bounds: untouched, bit for bit (positions before the first clamped one)
            if p < min(q for q, b in p0.items() if b > hi):
                assert np.array_equal(x, x0), p
            continue
        moved += 1
        assert abs(p1[p] - hi) < 1e-4 * max(1.0, abs(hi)), (p, p1[p], hi)
        # the orthogonal complement is what the stream carried at this site (the first clamped position)
    first = min(q for q, b in p0.items() if b > hi)
    x, x0 = got[(layer, hook, first)].astype(np.float64), plain[(layer, hook, first)].astype(np.float64)
    assert np.allclose(x - np.dot(x, u) * u, x0 - np.dot(x0, u) * u, atol=1e-4)
    assert moved >= 2


def test_phase_variants_clamp_only_their_positions(engine, hf_ref, tasks):
    prompt = fact(tasks, 5)["prompt"]
    site, key = "L1.post_attn", (1, "post_attn")
    u = _unit(engine, 41)
    n = len(engine.tokenize(prompt))
    cap = Capture.make([site], "all")
    plain = engine.generate(prompt, GEN4, Interventions(capture=cap))
    for phase in ("prefill", "decode"):
        clamp = Clamp.make([site], u, value=0.0, phase=phase)  # directional ablation
        gen = _vs_oracle(engine, hf_ref, prompt, Interventions(clamp=(clamp,)),
                         [RefEdit.clamp(key, u, min=0.0, max=0.0, positions=range(n), gen=True, phase=phase)])
        got = engine.generate(prompt, GEN4, Interventions(clamp=(clamp,), capture=cap))
        assert got.token_ids == gen.token_ids
        proj = _proj(got.captures, key, u)
        fed = sorted(proj)
        assert fed[-1] == n + 2  # every position ever fed: prompt + 3 generated
        for p in fed:
            ablated = (p < n) == (phase == "prefill")
            if ablated:
                assert abs(proj[p]) < 1e-5, (phase, p, proj[p])
            elif phase == "decode":  # prompt positions come before any clamp: unchanged bit for bit
                assert np.array_equal(got.captures[key + (p,)], plain.captures[key + (p,)]), p
            else:
                assert abs(proj[p]) > 1e-3, (phase, p)


def test_clamp_comes_after_additive_steering_at_the_same_site(engine, hf_ref, tasks):
    prompt = fact(tasks, 7)["prompt"]
    site, key = "L2.post_attn", (2, "post_attn")
    u = _unit(engine, 42)
    n = len(engine.tokenize(prompt))
    steer = Steer.make([site], u * 40.0)  # pushes the projection far up ...
    clamp = Clamp.make([site], u, min=-0.5, max=0.5, strength=0.75)  # ... and the clamp pulls 3/4 of the way back
    spec = Interventions(steer=(steer,), clamp=(clamp,))
    edits = [RefEdit.steer(key, u * 40.0, positions=range(n), gen=True),
             RefEdit.clamp(key, u, min=-0.5, max=0.5, strength=0.75, positions=range(n), gen=True)]
    _vs_oracle(engine, hf_ref, prompt, spec, edits)
    plain = engine.capture(prompt, [site], "all_prompt").captures
    got = engine.generate(prompt, ONE, Interventions(steer=(steer,), clamp=(clamp,), capture=Capture.make([site], "all_prompt"))).captures
    p0, p1 = _proj(plain, key, u), _proj(got, key, u)
    # position 0 sees the clamp act on plain + 40 u: 0.5 + 0.25 * (p0 + 40 - 0.5)
    assert abs(p1[0] - (0.5 + 0.25 * (p0[0] + 40.0 - 0.5))) < 1e-3
    steered_only = engine.score(prompt, [fact(tasks, 7)["answer_id"]], Interventions(steer=(steer,)))
    both = engine.score(prompt, [fact(tasks, 7)["answer_id"]], spec)
    assert steered_only != both


def test_several_directions_are_corrected_together_as_the_fork_does(engine, hf_ref, tasks):
    prompt = fact(tasks, 9)["prompt"]
    key = (3, "mlp_out")
    u1, u2 = _unit(engine, 43), _unit(engine, 44)
    u2 = ((u1 + u2) / np.linalg.norm(u1 + u2)).astype(np.float32)  # not orthogonal: order-free only if simultaneous
    n = len(engine.tokenize(prompt))
    clamps = (Clamp.make("L3.mlp_out", u1, value=0.0), Clamp.make("L3.mlp_out", u2, min=1.0, strength=0.5))
    edits = [RefEdit.clamp(key, u1, min=0.0, max=0.0, positions=range(n), gen=True),
             RefEdit.clamp(key, u2, min=1.0, strength=0.5, positions=range(n), gen=True)]
    gen = _vs_oracle(engine, hf_ref, prompt, Interventions(clamp=clamps), edits)
    swapped = engine.generate(prompt, GEN4, Interventions(clamp=clamps[::-1]))
    assert np.allclose(swapped.logprobs, gen.logprobs, atol=1e-5)  # one correction from the same value: order-free
    # at position 0 (nothing before it is clamped): both corrections from the same value, summed
    cap = Capture.make(["L3.mlp_out"], [0])
    x0 = engine.capture(prompt, ["L3.mlp_out"], [0]).captures[key + (0,)].astype(np.float64)
    got = engine.generate(prompt, ONE, Interventions(clamp=clamps, capture=cap)).captures[key + (0,)].astype(np.float64)
    p1, p2 = x0 @ u1, x0 @ u2
    together = x0 + (0.0 - p1) * u1 + 0.5 * (max(p2, 1.0) - p2) * u2
    assert np.allclose(got, together, atol=1e-4)
    s1 = x0 - p1 * u1  # one after the other would differ (the directions overlap)
    one_by_one = s1 + 0.5 * (max(s1 @ u2, 1.0) - s1 @ u2) * u2
    assert not np.allclose(got, one_by_one, atol=1e-3)


def test_global_clamps_compose_with_request_clamps_and_are_cleared(engine, hf_ref, tasks):
    prompt = fact(tasks, 11)["prompt"]
    key = (1, "post_block")
    ug, ur = _unit(engine, 45), _unit(engine, 46)
    n = len(engine.tokenize(prompt))
    local = Clamp.make("L1.post_block", ur, max=0.0)
    before = engine.generate(prompt, GEN4)
    try:
        engine.set_global_steer([], [Clamp.make("L1.post_block", ug, value=0.0, phase="decode")])
        assert engine.global_steer == [] and len(engine.global_clamps) == 1
        # the global clamp alone (requests without interventions get it too) ...
        _vs_oracle(engine, hf_ref, prompt, None, [RefEdit.clamp(key, ug, min=0.0, max=0.0, gen=True, phase="decode")])
        # ... and under a request's own clamp (global first, as the fork concatenates them)
        _vs_oracle(engine, hf_ref, prompt, Interventions(clamp=(local,)),
                   [RefEdit.clamp(key, ug, min=0.0, max=0.0, gen=True, phase="decode"),
                    RefEdit.clamp(key, ur, max=0.0, positions=range(n), gen=True)])
        # four clamps at one site at most, global ones included: refused before admission, naming the entry
        with pytest.raises(SpecError) as err:
            engine.generate(prompt, ONE, Interventions(clamp=tuple(Clamp.make("L1.post_block", ur, value=float(k)) for k in range(4))))
        assert err.value.field == "clamp[3].sites[0]" and "global" in err.value.message
        # ... but phases that never meet do not add up: three request clamps at prompt positions are fine
        ok = engine.generate(prompt, ONE, Interventions(clamp=tuple(Clamp.make("L1.post_block", ur, min=float(-k), phase="prefill")
                                                                    for k in range(4))))
        assert ok.intervention.status == "ok"
        # a vectors-only change keeps the global clamps when the caller passes none
        engine.set_global_steer([Steer.make(["L0.pre_attn"], _vec(engine, 47, 1.0))])
        assert len(engine.global_clamps) == 1
    finally:
        engine.clear_global_steer()
    assert engine.global_clamps == [] and engine.global_steer == []
    after = engine.generate(prompt, GEN4)
    assert after.token_ids == before.token_ids and after.logprobs == before.logprobs


# ---- over HTTP, in the fork's forms --------------------------------------------------------------------
def test_completions_take_the_forks_clamp_tiers(http, engine, hf_ref, tasks):
    prompt = fact(tasks, 13)["prompt"]
    u = _unit(engine, 48)
    n = len(engine.tokenize(prompt))
    base = {"prompt": prompt, "max_tokens": 4, "logprobs": 0, "ignore_eos": True}
    body = {**base, "steering_clamps": {"post_block": {"2": [{"vector": (u * 5).tolist(), "max": 0.0}]}},
            "decode_steering_clamps": {"mlp_in": {"1": [{"vector": u.tolist(), "value": 0.0, "strength": 0.5}]}}}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    native = http.post("/v1/completions", json={**base, "interventions": {"clamp": [
        {"sites": "L2.post_block", "vector": (u * 5).tolist(), "max": 0.0},
        {"sites": ["L1.mlp_in"], "vector": u.tolist(), "value": 0.0, "strength": 0.5, "phase": "decode"}]}})
    assert native.status_code == 200, native.text
    assert native.json()["choices"][0]["logprobs"] == lp
    ref = hf_ref.generate(engine.tokenize(prompt), 4, stop_at_eos=False, edits=[
        RefEdit.clamp((2, "post_block"), u, max=0.0, positions=range(n), gen=True),
        RefEdit.clamp((1, "mlp_in"), u, min=0.0, max=0.0, strength=0.5, gen=True, phase="decode")])
    assert np.allclose(lp["token_logprobs"], ref.logprobs, atol=LOGPROB_ATOL)


def test_bad_clamps_over_http_name_the_field_and_leave_the_engine_untouched(http, engine, tasks):
    prompt = fact(tasks, 0)["prompt"]
    h, n_layers = engine.info.hidden_size, engine.info.num_layers
    ok = [0.1] * h
    before = http.post("/v1/generate", json={"prompt": prompt, "max_tokens": 3, "ignore_eos": True, "logprobs": 0}).json()
    nan_vec = "[" + ", ".join(["NaN"] + ["0.5"] * (h - 1)) + "]"
    cases = [
        ("/v1/completions", {"steering_clamps": {"post_block": {"1": [{"vector": ok, "min": 1.0, "max": 0.0}]}}}, "steering_clamps.post_block.1[0].min"),
        ("/v1/completions", {"steering_clamps": {"post_block": {"1": [{"vector": [0.0] * h, "value": 0.0}]}}}, "steering_clamps.post_block.1[0].vector"),
        ("/v1/completions", {"prefill_steering_clamps": {"post_block": {"1": [{"vector": ok[:-1], "value": 0.0}]}}}, "prefill_steering_clamps.post_block.1[0].vector"),
        ("/v1/completions", {"decode_steering_clamps": {"pre_attn": {str(n_layers): [{"vector": ok, "value": 0.0}]}}}, f"decode_steering_clamps.pre_attn.{n_layers}"),
        ("/v1/completions", {"steering_clamps": {"post_block": {"1": [{"vector": ok, "max": 1.0, "strength": 2}]}}}, "steering_clamps.post_block.1[0].strength"),
        ("/v1/completions", {"steering_clamps": {"post_block": {"1": [{"vector": ok, "value": 0.0}] * 5}}}, "steering_clamps.post_block.1"),
        ("/v1/completions", {"interventions": {"clamp": [{"sites": "L1.post_block", "vector": ok}]}}, "interventions.clamp[0].min"),
        ("/v1/generate", {"interventions": {"clamp": [{"sites": "L1.post_block", "vector": ok, "value": 0, "positions": [99]}]}}, "interventions.clamp[0].positions[0]"),
        ("/v1/steering/set", {"clamps": {"post_block": {"1": [{"vector": ok, "min": 2, "max": 1}]}}}, "clamps.post_block.1[0].min"),
        ("/v1/steering/set", {"decode_clamps": {"post_block": {"1": [{"vector": ok, "value": 0.0}] * 5}}}, "decode_clamps.post_block.1"),
        ("/v1/steering/set", {"clamp": [{"sites": "L1.post_block", "vector": ok, "value": 0, "positions": "last_prompt"}]}, "clamp[0].positions"),
    ]
    for path, extra, field in cases:
        body = {"prompt": prompt, "max_tokens": 1, **extra} if path != "/v1/steering/set" else extra
        r = http.post(path, json=body)
        assert r.status_code == 400, (field, r.text)
        assert r.json()["field"] == field, (field, r.json())
    raw = '{"prompt": "x", "steering_clamps": {"post_block": {"1": [{"vector": %s, "value": 0}]}}}' % nan_vec
    r = http.post("/v1/completions", content=raw.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["field"] == "steering_clamps.post_block.1[0].vector", r.text
    assert http.get("/v1/steering").json()["clamp"] == []
    after = http.post("/v1/generate", json={"prompt": prompt, "max_tokens": 3, "ignore_eos": True, "logprobs": 0}).json()
    assert after["token_ids"] == before["token_ids"] and after["logprobs"] == before["logprobs"]


def test_global_clamps_on_steering_set_merge_list_and_clear(http, engine, hf_ref, tasks):
    prompt = fact(tasks, 15)["prompt"]
    u, w = _unit(engine, 49), _unit(engine, 50)
    n = len(engine.tokenize(prompt))
    base = {"prompt": prompt, "max_tokens": 4, "logprobs": 0, "ignore_eos": True}
    try:
        r = http.post("/v1/steering/set", json={"clamps": {"post_block": {"2": [{"vector": u.tolist(), "value": 0.0}]}},
                                                "prefill_clamps": {"post_attn": {"1": [{"vector": w.tolist(), "max": 0.0}]}}})
        assert r.status_code == 200, r.text
        assert r.json()["sites"] == ["L1.post_attn", "L2.post_block"]
        assert http.get("/v1/status").json()["global_steering"] == ["L1.post_attn", "L2.post_block"]
        listed = http.get("/v1/steering").json()
        assert listed["active_layers"] == {} and [(c["sites"], c["min"], c["max"], c["phase"]) for c in listed["clamp"]] == [
            (["L2.post_block"], 0.0, 0.0, "both"), (["L1.post_attn"], None, 0.0, "prefill")]
        got = http.post("/v1/completions", json=base).json()["choices"][0]["logprobs"]["token_logprobs"]
        ref = hf_ref.generate(engine.tokenize(prompt), 4, stop_at_eos=False, edits=[
            RefEdit.clamp((2, "post_block"), u, min=0.0, max=0.0, positions=range(n), gen=True),
            RefEdit.clamp((1, "post_attn"), w, max=0.0, positions=range(n), phase="prefill")])
        assert np.allclose(got, ref.logprobs, atol=LOGPROB_ATOL)
        # merge: a new both-phase clamp at L2.post_block replaces the one there; the prefill one stays;
        # the native entries POST back unchanged
        r = http.post("/v1/steering/set", json={"clamps": {"post_block": {"2": [{"vector": w.tolist(), "min": 5.0}]}}})
        assert r.status_code == 200, r.text
        listed = http.get("/v1/steering").json()["clamp"]
        assert [(c["sites"], c["min"]) for c in listed] == [(["L1.post_attn"], None), (["L2.post_block"], 5.0)]
        r = http.post("/v1/steering/set", json={"clamp": listed, "replace": True})
        assert r.status_code == 200 and http.get("/v1/steering").json()["clamp"] == listed
    finally:
        assert http.post("/v1/steering/clear").status_code == 200
    assert http.get("/v1/steering").json() == {"active_layers": {}, "steer": [], "clamp": []}


def test_steering_modules_carry_clamps_before_the_requests_own(http, engine, hf_ref, tasks):
    prompt = fact(tasks, 17)["prompt"]
    u, w = _unit(engine, 51), _unit(engine, 52)
    n = len(engine.tokenize(prompt))
    base = {"prompt": prompt, "max_tokens": 4, "logprobs": 0, "ignore_eos": True}
    module_clamp = [{"vector": (u * 2).tolist(), "max": -0.5, "strength": 0.8}]
    inline = {"post_block": {"1": [{"vector": w.tolist(), "value": 0.0}]}}
    try:
        r = http.post("/v1/steering/modules/register", json={"name": "clampy", "decode_clamps": {"post_attn": {"2": module_clamp}}})
        assert r.status_code == 200, r.text
        listed = http.get("/v1/steering/modules").json()
        assert "clampy" in listed["modules"]
        assert listed["details"]["clampy"] == [{"site": "L2.post_attn", "phase": "decode", "norm": pytest.approx(2.0, rel=1e-6),
                                                "kind": "clamp", "min": None, "max": -0.5, "strength": 0.8}]
        got = http.post("/v1/completions", json={**base, "steering_name": "clampy", "steering_clamps": inline})
        assert got.status_code == 200, got.text
        same = http.post("/v1/completions", json={**base, "interventions": {"clamp": [
            {"sites": "L2.post_attn", "vector": (u * 2).tolist(), "max": -0.5, "strength": 0.8, "phase": "decode"},
            {"sites": "L1.post_block", "vector": w.tolist(), "value": 0.0}]}})
        lp = got.json()["choices"][0]["logprobs"]["token_logprobs"]
        assert same.json()["choices"][0]["logprobs"]["token_logprobs"] == lp
        ref = hf_ref.generate(engine.tokenize(prompt), 4, stop_at_eos=False, edits=[
            RefEdit.clamp((2, "post_attn"), u, max=-0.5, strength=0.8, gen=True, phase="decode"),
            RefEdit.clamp((1, "post_block"), w, min=0.0, max=0.0, positions=range(n), gen=True)])
        assert np.allclose(lp, ref.logprobs, atol=LOGPROB_ATOL)
        # re-registering replaces the clamps; unregistering removes the module entirely
        r = http.post("/v1/steering/modules/register", json={"name": "clampy", "vectors": {"post_block": {"1": (u * 0.1).tolist()}}})
        assert r.status_code == 200 and http.get("/v1/steering/modules").json()["details"]["clampy"][0]["kind"] == "vector"
    finally:
        http.post("/v1/steering/modules/unregister", json={"name": "clampy"})
    assert "clampy" not in http.get("/v1/steering/modules").json()["modules"]
    r = http.post("/v1/completions", json={**base, "steering_name": "clampy"})
    assert r.status_code == 400 and r.json()["field"] == "steering_name"


def test_a_dynamic_action_is_clamped_after_it_as_the_fork_orders_them(engine, tasks):
    """A dynamic action composed onto a position's static slot keeps that slot's clamps, applied
    after the action's add (the fork: steer, then clamp)."""
    from engine_ext.dynamic.specs import DynamicRequest, Policy, Probe

    prompt = fact(tasks, 19)["prompt"]
    site, key = "L2.post_attn", (2, "post_attn")
    u = _unit(engine, 53)
    probe = Probe.make("clamp-test-probe", "L3.post_block", direction=_unit(engine, 54))
    engine.register_probe(probe)
    try:
        pol = Policy.make(probe=probe.name, sites=[site], vector=u * 30.0, on=-1e30, scale=1.0)  # always engaged
        cap = Capture.make([site], "all")
        params = GenerationParams(max_tokens=5, ignore_eos=True, logprobs=0)
        n = len(engine.tokenize(prompt))
        steered = engine.generate(prompt, params, Interventions(capture=cap), dynamic=DynamicRequest.make([pol]))
        clamp = Clamp.make([site], u, max=0.25, positions="all_generated")
        clamped = engine.generate(prompt, params, Interventions(capture=cap, clamp=(clamp,)), dynamic=DynamicRequest.make([pol]))
        for g in (steered, clamped):
            assert g.intervention.status == "ok", g.intervention.errors
            assert all(e["engaged"] for e in g.intervention.dynamic["trace"][0][1:])
        p_steered, p_clamped = _proj(steered.captures, key, u), _proj(clamped.captures, key, u)
        acted = [p for p in p_steered if p > n]  # generated positions fed back after an engaged decision
        assert acted and all(p_steered[p] > 10.0 for p in acted)
        assert all(abs(p_clamped[p] - 0.25) < 1e-4 for p in acted), {p: p_clamped[p] for p in acted}
    finally:
        engine.delete_probe(probe.name)


def test_clamped_positions_salt_the_kv_from_the_first_one_on():
    """The prefix cache: a clamp modifies its positions (of its phase), so KV from the first of
    them on is salted (never shared with a request computing it differently); before it, shared."""
    from engine_ext.program import KV_SALT_KEY, first_modified_position, program_to_extra_args

    prompt = PromptInfo(list(range(6)), max_tokens=3)

    def first(*clamps):
        prog = compile_program(Interventions(clamp=clamps), prompt, DIMS, key="k", named_vector_dims=lambda n: None)
        return first_modified_position(prog), program_to_extra_args(prog, kv_salt="s").get(KV_SALT_KEY)

    assert first(Clamp.make("L1.post_block", V8, value=0.0, positions=[3, 4])) == (3, [3, "s"])
    assert first(Clamp.make("L1.post_block", V8, value=0.0)) == (0, [0, "s"])
    assert first(Clamp.make("L1.post_block", V8, value=0.0, phase="decode")) == (6, [6, "s"])  # generated tokens only
    assert first(Clamp.make("L1.post_block", V8, value=0.0, positions=[4], phase="decode")) == (None, None)  # never acts


def test_chat_completions_take_clamps_too(http, engine):
    u = _unit(engine, 56)
    base = {"messages": [{"role": "user", "content": "Where is Tarn?"}], "max_tokens": 2, "logprobs": True,
            "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}
    plain = http.post("/v1/chat/completions", json=base)
    clamped = http.post("/v1/chat/completions", json={**base, "steering_clamps": {"post_block": {"1": [{"vector": u.tolist(), "value": 0.0}]}}})
    assert plain.status_code == 200 and clamped.status_code == 200, clamped.text
    assert clamped.json()["intervention"]["status"] == "ok"
    assert clamped.json()["choices"][0]["logprobs"] != plain.json()["choices"][0]["logprobs"]
    bad = http.post("/v1/chat/completions", json={**base, "steering_clamps": {"post_block": {"1": [{"vector": u.tolist(), "value": 0.0,
                                                                                                    "strength": 3}]}}})
    assert bad.status_code == 400 and bad.json()["field"] == "steering_clamps.post_block.1[0].strength"
