"""Steering, capture and patching inside vLLM's forward (real engine on CPU, float32), checked
against the transformers oracle (`engine_ext.reference.hf`) and against the engine itself.

Tolerances (float32 on CPU; vLLM's kernels sum in another order than transformers'):
captures within CAPTURE_ATOL + CAPTURE_RTOL * |value|; logprobs within LOGPROB_ATOL.
Equalities marked "bit-exact" are exact comparisons of float bits.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from engine_ext import GenerationParams, SpecError
from engine_ext.reference.hf import RefEdit
from engine_ext.sites import HOOKS
from engine_ext.specs import Capture, Interventions, Noise, Patch, Steer

from .conftest import capture_until_evicted, drop_captures_until_evicted

CAPTURE_ATOL, CAPTURE_RTOL = 2e-4, 2e-4
LOGPROB_ATOL = 2e-3
ONE = GenerationParams(max_tokens=1, logprobs=0)


def fact(tasks, i=0):
    return tasks["facts"][i]


def assert_close_capture(got: np.ndarray, want: np.ndarray, what: str):
    err = np.abs(got - want) - (CAPTURE_ATOL + CAPTURE_RTOL * np.abs(want))
    assert (err <= 0).all(), f"{what}: max excess {err.max():.3g}"


def hf_sites(engine):
    return [(L, h) for L in range(engine.info.num_layers) for h in HOOKS]


# ---- capture ---------------------------------------------------------------------------------
def test_captures_equal_the_reference_at_every_hook_and_layer(engine, hf_ref, tasks):
    prompt = fact(tasks, 3)["prompt"]
    sites = [f"L{L}.{h}" for L, h in hf_sites(engine)]
    gen = engine.capture(prompt, sites, "all_prompt")
    ref = hf_ref.run(engine.tokenize(prompt), capture="all")
    n = len(gen.prompt_token_ids)
    assert len(gen.captures) == len(sites) * n
    for (L, h) in hf_sites(engine):
        for p in range(n):
            assert_close_capture(gen.captures[(L, h, p)], ref.captures[(L, h)][p].numpy(), f"L{L}.{h}@{p}")


def test_capture_of_generated_positions(engine, hf_ref, tasks):
    prompt = fact(tasks, 5)["prompt"]
    params = GenerationParams(max_tokens=4, ignore_eos=True, logprobs=0)
    gen = engine.generate(prompt, params, Interventions(capture=Capture.make(["L2.post_block"], "all_generated")))
    n = len(gen.prompt_token_ids)
    assert sorted(p for (_, _, p) in gen.captures) == [n, n + 1, n + 2]  # the last token is never fed back
    ref = hf_ref.run(gen.prompt_token_ids + gen.token_ids[:-1], capture=[(2, "post_block")])
    for p in (n, n + 1, n + 2):
        assert_close_capture(gen.captures[(2, "post_block", p)], ref.captures[(2, "post_block")][p].numpy(), f"gen@{p}")


# ---- steering ----------------------------------------------------------------------------------
def _vec(engine, seed=0, norm=6.0):
    v = np.random.default_rng(seed).standard_normal(engine.info.hidden_size).astype(np.float32)
    return v / np.linalg.norm(v) * norm


@pytest.mark.parametrize("site, phase", [("L1.pre_attn", "both"), ("L2.post_attn", "prefill"), ("L3.post_block", "decode"),
                                         ("L1.mlp_in", "both"), ("L2.mlp_out", "decode")])
def test_steered_generation_matches_reference(engine, hf_ref, tasks, site, phase):
    prompt = fact(tasks, 7)["prompt"]
    v = _vec(engine, 1)
    params = GenerationParams(max_tokens=5, ignore_eos=True, logprobs=0)
    spec = Interventions(steer=(Steer.make([site], v, scale=1.5, positions="all", phase=phase),))
    gen = engine.generate(prompt, params, spec)
    assert gen.intervention.status == "ok"
    layer, hook = int(site[1]), site.split(".")[1]
    ids = engine.tokenize(prompt)
    edit = RefEdit.steer((layer, hook), v, scale=1.5, positions=range(len(ids)) if phase != "decode" else (),
                         gen=phase != "prefill", phase=phase)
    ref = hf_ref.generate(ids, 5, edits=[edit], stop_at_eos=False)
    assert gen.token_ids == ref.token_ids
    assert np.allclose(gen.logprobs, ref.logprobs, atol=LOGPROB_ATOL)
    plain = engine.generate(prompt, params)
    assert plain.logprobs != gen.logprobs  # the steering did something


def test_named_vectors_and_global_steering_compose(engine, hf_ref, tasks):
    prompt = fact(tasks, 9)["prompt"]
    a, b = _vec(engine, 2), _vec(engine, 3)
    engine.register_vector("cb-test-a", a)
    assert engine.list_vectors()["cb-test-a"] == engine.info.hidden_size
    try:
        engine.set_global_steer([Steer.make(["L1.post_block"], name="cb-test-a", scale=1.0)])
        spec = Interventions(steer=(Steer.make(["L1.post_block"], b, scale=0.5),))
        got = engine.score(prompt, [fact(tasks, 9)["answer_id"]], spec)
        ids = engine.tokenize(prompt)
        # per-request steering first, then the global one (the engine's documented order)
        ref = hf_ref.score(ids, [fact(tasks, 9)["answer_id"]], edits=[
            RefEdit.steer((1, "post_block"), b, scale=0.5, positions=range(len(ids)), gen=True),
            RefEdit.steer((1, "post_block"), a, scale=1.0, positions=range(len(ids)), gen=True)])
        for t, lp in got.items():
            assert abs(lp - ref[t]) <= LOGPROB_ATOL
        with pytest.raises(SpecError):
            engine.delete_vector("cb-test-a")  # in use by the global steering
    finally:
        engine.clear_global_steer()
    assert engine.delete_vector("cb-test-a") and "cb-test-a" not in engine.list_vectors()
    with pytest.raises(SpecError) as err:
        engine.generate(prompt, ONE, Interventions(steer=(Steer.make(["L1.post_block"], name="cb-test-a"),)))
    assert err.value.field == "steer[0].name"


# ---- patching ----------------------------------------------------------------------------------
def test_replacing_every_site_of_a_layer_with_its_own_values_is_bit_exact(engine, tasks):
    prompt = fact(tasks, 11)["prompt"]
    params = GenerationParams(max_tokens=4, logprobs=0)
    clean = engine.generate(prompt, params)
    for layer in (0, engine.info.num_layers - 1):
        run = f"self-{layer}"
        engine.capture(prompt, [f"L{layer}.{h}" for h in HOOKS], "all_prompt", keep_as=run, return_values=False)
        spec = Interventions(patch=tuple(Patch.make(f"L{layer}.{h}", "all_prompt", {"run": run}) for h in HOOKS))
        patched = engine.generate(prompt, params, spec)
        assert patched.intervention.status == "ok"
        assert patched.token_ids == clean.token_ids
        assert patched.logprobs == clean.logprobs  # bit-exact
        engine.drop_source(run)


def test_patching_corrupt_with_clean_values_restores_the_clean_answer(engine, hf_ref, tasks):
    pair = next(p for p in tasks["pairs"] if p["equal_length"])
    clean_p, corrupt_p = pair["clean_prompt"], pair["corrupt_prompt"]
    ans, foil = pair["answer_id"], pair["foil_id"]
    layer = engine.info.num_layers // 2
    engine.capture(clean_p, [f"L{layer}.pre_attn"], "all_prompt", keep_as="clean-pair", return_values=False)
    spec = Interventions(patch=(Patch.make(f"L{layer}.pre_attn", "all_prompt", {"run": "clean-pair"}),),
                         score_token_ids=(ans, foil))
    patched = engine.generate(corrupt_p, ONE, spec)
    clean = engine.score(clean_p, [ans, foil])
    corrupt = engine.score(corrupt_p, [ans, foil])
    assert patched.token_ids == engine.generate(clean_p, ONE).token_ids  # the clean answer
    assert patched.scores[0][ans] == clean[ans] and patched.scores[0][foil] == clean[foil]  # bit-exact
    assert corrupt[ans] < clean[ans]
    # and the oracle agrees on the patched logprobs
    ref_caps = hf_ref.run(engine.tokenize(clean_p), capture=[(layer, "pre_attn")]).captures[(layer, "pre_attn")]
    ids = engine.tokenize(corrupt_p)
    ref = hf_ref.score(ids, [ans, foil], edits=[RefEdit.patch((layer, "pre_attn"), range(len(ids)), ref_caps.numpy())])
    assert abs(patched.scores[0][ans] - ref[ans]) <= LOGPROB_ATOL
    engine.drop_source("clean-pair")


@pytest.mark.parametrize("alpha", [0.5, 1.0])
def test_lerp_zero_and_mean_ablation_match_reference(engine, hf_ref, tasks, alpha):
    item = fact(tasks, 13)
    prompt, ans = item["prompt"], item["answer_id"]
    span = item["subject_span"]
    pos = list(range(span[0], span[1]))
    ids = engine.tokenize(prompt)
    engine.capture(prompt, ["L2.post_attn"], "all_prompt", keep_as="mean-src", return_values=False)
    caps = hf_ref.run(ids, capture=[(2, "post_attn")]).captures[(2, "post_attn")].numpy()
    mean = caps.mean(0)
    for source, target in (("zeros", None), ({"mean_of": "mean-src"}, np.tile(mean, (len(pos), 1)))):
        got = engine.score(prompt, [ans], Interventions(patch=(Patch.make("L2.post_attn", pos, source, alpha=alpha),)))
        edit = RefEdit.zero((2, "post_attn"), pos, alpha=alpha) if target is None else \
            RefEdit.patch((2, "post_attn"), pos, target, alpha=alpha)
        ref = hf_ref.score(ids, [ans], edits=[edit])
        assert abs(got[ans] - ref[ans]) <= LOGPROB_ATOL, (source, got, ref)
    engine.drop_source("mean-src")


def test_noise_corruption_of_the_subject_matches_reference_and_is_seeded(engine, hf_ref, tasks):
    item = fact(tasks, 15)
    prompt, ans = item["prompt"], item["answer_id"]
    span = {"span": item["subject"]}
    noisy = [engine.score(prompt, [ans], Interventions(noise=Noise.make([span], scale=3.0, seed=s))) for s in (1, 1, 2)]
    assert noisy[0] == noisy[1] and noisy[0] != noisy[2]
    ids = engine.tokenize(prompt)
    pos = list(range(*item["subject_span"]))
    ref = hf_ref.score(ids, [ans], edits=[hf_ref.noise_edit(pos, scale=3.0, seed=1, std=engine.info.embedding_std)])
    assert abs(noisy[0][ans] - ref[ans]) <= LOGPROB_ATOL
    assert noisy[0][ans] < engine.score(prompt, [ans])[ans]


# ---- isolation ---------------------------------------------------------------------------------
def test_unintervened_request_is_unaffected_by_its_batch_neighbours(engine, tasks):
    prompts = [fact(tasks, i)["prompt"] for i in (20, 21, 22, 23)]
    engine.capture(prompts[2], ["L1.post_attn"], "all_prompt", keep_as="nb-src", return_values=False)
    # Every request runs all 5 steps so both runs have the same batch shape at every step: without
    # batch invariance a CPU GEMM over 3 rows can round differently from one over 4
    # (docs/validation.md "Batch invariance on the CPU"), and then a steered neighbour that stops early would move the last bit without any leak between rows.
    params = GenerationParams(max_tokens=5, ignore_eos=True, logprobs=0)
    with_iv = [None,
               Interventions(steer=(Steer.make(["L1.pre_attn", "L3.post_block"], _vec(engine, 4), scale=2.0),)),
               Interventions(patch=(Patch.make("L1.post_attn", "all_prompt", {"run": "nb-src"}),)),
               Interventions(capture=Capture.make(["L0.post_block", "L2.pre_attn"], "all"))]
    engine.reset_prefix_cache()
    a = engine.generate(prompts, params, with_iv)
    engine.reset_prefix_cache()
    b = engine.generate(prompts, params, [None] * 4)
    assert [len(g.token_ids) for g in a + b] == [5] * 8
    assert a[0].token_ids == b[0].token_ids and a[0].logprobs == b[0].logprobs  # bit-exact
    assert a[1].logprobs != b[1].logprobs  # the steered neighbour really was steered
    assert all(g.intervention.status == "ok" for g in a[1:])
    engine.drop_source("nb-src")


def test_patched_request_never_leaks_into_the_prefix_cache(engine, tasks):
    # longer than one KV block (32 tokens on CPU), so that the prefix cache really holds blocks
    prompt = " ".join(fact(tasks, i)["prompt"] for i in range(30, 40))
    assert len(engine.tokenize(prompt)) >= 40
    params = GenerationParams(max_tokens=3, logprobs=0)
    engine.reset_prefix_cache()
    fresh = engine.generate(prompt, params)
    engine.reset_prefix_cache()
    steer = Interventions(steer=(Steer.make(["L0.pre_attn"], _vec(engine, 5, 20.0), positions="all_prompt"),))
    steered = engine.generate(prompt, params, steer)
    assert steered.logprobs != fresh.logprobs
    rerun = engine.generate(prompt, params)
    assert rerun.token_ids == fresh.token_ids and rerun.logprobs == fresh.logprobs  # bit-exact
    again = engine.generate(prompt, params)
    assert again.num_cached_tokens >= 32, "the rerun did not reuse cached blocks: the test would prove nothing"
    assert again.logprobs == fresh.logprobs
    # a request patched from position p on shares the blocks before p with unintervened requests
    late = Interventions(steer=(Steer.make(["L0.pre_attn"], _vec(engine, 5, 20.0), positions=[40]),))
    shared = engine.generate(prompt, params, late)
    assert shared.num_cached_tokens >= 32 and shared.logprobs != fresh.logprobs


def test_concurrent_async_requests_keep_their_own_interventions(engine, tasks):
    prompt = fact(tasks, 31)["prompt"]
    vecs = [_vec(engine, 10 + i) for i in range(4)]
    specs = [Interventions(steer=(Steer.make(["L2.pre_attn"], v, scale=2.0),)) for v in vecs]
    solo = [engine.generate(prompt, GenerationParams(max_tokens=3, logprobs=0), s) for s in specs]

    async def together():
        return await asyncio.gather(*(engine.agenerate(prompt, GenerationParams(max_tokens=3, logprobs=0), s) for s in specs))

    for s, t in zip(solo, asyncio.run(together())):
        assert s.token_ids == t.token_ids
        assert np.allclose(s.logprobs, t.logprobs, atol=1e-5)


# ---- sources and failures -------------------------------------------------------------------------
def test_missing_or_evicted_source_voids_the_request(engine, tasks):
    prompt = fact(tasks, 32)["prompt"]
    spec = Interventions(patch=(Patch.make("L1.pre_attn", "all_prompt", {"run": "never-stored"}),))
    gen = engine.generate(prompt, ONE, spec)
    assert gen.intervention.voided and "never-stored" in gen.intervention.errors[0]
    # fill the (small) test store until the first run is evicted
    first = engine.capture(prompt, ["L1.pre_attn"], "all_prompt", keep_as="evict-0", return_values=False)
    assert first.intervention.stored_as == "evict-0"
    all_sites = [f"L{L}.{h}" for L in range(engine.info.num_layers) for h in ("pre_attn", "post_attn", "post_block")]
    evicted = capture_until_evicted(engine, prompt, all_sites, "evict-0", "evict-")
    assert "evict-0" in evicted and not engine.has_source("evict-0")
    gen = engine.generate(prompt, ONE, Interventions(patch=(Patch.make("L1.pre_attn", "all_prompt", {"run": "evict-0"}),)))
    assert gen.intervention.voided and "evict-0" in gen.intervention.errors[0]
    drop_captures_until_evicted(engine, "evict-")


def test_leased_source_survives_store_pressure(engine, tasks):
    prompt = fact(tasks, 33)["prompt"]
    engine.capture(prompt, ["L1.pre_attn"], "all_prompt", keep_as="leased", return_values=False)
    assert engine.lease_source("leased")
    try:
        sites = [f"L{L}.{h}" for L in range(engine.info.num_layers) for h in ("pre_attn", "post_attn", "post_block")]
        for i in range(40):
            engine.capture(prompt, sites, "all_prompt", keep_as=f"press-{i}", return_values=False)
        assert engine.has_source("leased")
    finally:
        engine.release_source("leased")
        for i in range(40):
            engine.drop_source(f"press-{i}")


def test_a_capture_with_lease_is_stored_leased_and_survives_store_pressure(engine, tasks):
    """`Capture(lease=True)`: the workers lease the run as they store it; a drop removes it
    leased or not. Without keep_as a lease is a SpecError naming the field."""
    prompt = fact(tasks, 33)["prompt"]
    spec = Interventions(capture=Capture.make(["L1.pre_attn"], "all_prompt", keep_as="leased-at-store",
                                              return_values=False, lease=True))
    assert engine.generate(prompt, ONE, spec).intervention.stored_as == "leased-at-store"
    try:
        assert engine.source_info("leased-at-store")["leases"] == 1
        sites = [f"L{L}.{h}" for L in range(engine.info.num_layers) for h in ("pre_attn", "post_attn", "post_block")]
        for i in range(40):
            engine.capture(prompt, sites, "all_prompt", keep_as=f"press-l-{i}", return_values=False)
        assert engine.has_source("leased-at-store")
    finally:
        assert engine.drop_source("leased-at-store")
        for i in range(40):
            engine.drop_source(f"press-l-{i}")
    assert not engine.has_source("leased-at-store")
    plain = Capture.make(["L1.pre_attn"], "all_prompt", keep_as="x")
    assert "lease" not in plain.to_json()  # the canonical form of a capture without it is unchanged
    with pytest.raises(SpecError) as exc:
        Capture.make(["L1.pre_attn"], "all_prompt", lease=True)
    assert exc.value.field == "capture.lease"


BAD_SPECS = [
    (Interventions(steer=(Steer.make(["L99.pre_attn"], np.zeros(4)),)), "steer[0].sites[0]"),
    (Interventions(patch=(Patch.make("L1.pre_attn", [{"span": "Atlantis"}], "zeros"),)), "patch[0].positions[0].span"),
    (Interventions(capture=Capture.make(["L1.pre_attn"], [500])), "capture.positions[0]"),
    (Interventions(score_token_ids=(10**7,)), "score_token_ids[0]"),
]


@pytest.mark.parametrize("spec, field", BAD_SPECS)
def test_bad_specs_are_refused_before_admission(engine, tasks, spec, field):
    before = engine.intervention_status()["workers"][0]["action_count"]
    with pytest.raises(SpecError) as err:
        engine.generate(fact(tasks, 0)["prompt"], ONE, spec)
    assert err.value.field == field
    assert engine.intervention_status()["workers"][0]["action_count"] == before
    assert engine.in_flight == 0
    assert len(engine.generate(fact(tasks, 0)["prompt"], ONE).token_ids) == 1


def test_vector_dimension_mismatch_is_refused(engine, tasks):
    with pytest.raises(SpecError) as err:
        engine.generate(fact(tasks, 0)["prompt"], ONE,
                        Interventions(steer=(Steer.make(["L1.pre_attn"], np.zeros(engine.info.hidden_size + 1)),)))
    assert err.value.field == "steer[0].vector"


def test_checksum_counts_applied_actions_and_ranks_agree(engine, tasks):
    st0 = engine.intervention_status()
    engine.generate(fact(tasks, 1)["prompt"], ONE, Interventions(steer=(Steer.make(["L0.post_attn"], _vec(engine, 7)),)))
    st1 = engine.intervention_status()
    w0, w1 = st0["workers"][0], st1["workers"][0]
    assert w1["action_count"] > w0["action_count"] and w1["action_checksum"] != w0["action_checksum"]
    assert st1["determinism"]["consistent"] is True and st1["determinism"]["ranks"] == 1
