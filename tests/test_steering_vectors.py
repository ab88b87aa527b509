"""Steering-vector helpers (app/dashboard/steering/vectors.py): the contrastive mean difference against
numpy, and a vector built through the real server (`POST /v1/capture`) against the engine's own
captures."""

from __future__ import annotations

import numpy as np
import pytest

from app.dashboard.steering import vectors as V
from engine_ext.bundled import bundled_tasks
from engine_ext.errors import SpecError
from engine_ext.sites import Site


# ---- pure helpers ----------------------------------------------------------------------------------
def _acts(rng: np.random.Generator, lengths: list[int], hidden: int = 16) -> list[np.ndarray]:
    return [rng.normal(size=(n, hidden)).astype(np.float32) for n in lengths]


def test_mean_difference_last_prompt_matches_numpy():
    rng = np.random.default_rng(0)
    a, b = _acts(rng, [3, 5, 4]), _acts(rng, [6, 2])
    expected = np.mean([x[-1] for x in a], axis=0) - np.mean([x[-1] for x in b], axis=0)
    got = V.mean_difference(a, b, "last_prompt")
    assert got.dtype == np.float32 and got.shape == (16,)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_mean_difference_all_prompt_weighs_prompts_equally():
    rng = np.random.default_rng(1)
    a, b = _acts(rng, [1, 9]), _acts(rng, [4])
    expected = np.mean([x.mean(axis=0) for x in a], axis=0) - b[0].mean(axis=0)
    np.testing.assert_allclose(V.mean_difference(a, b, "all_prompt"), expected, rtol=1e-6, atol=1e-6)
    # not the mean over all rows pooled together (that would favour the 9-token prompt)
    pooled = np.concatenate(a).mean(axis=0) - b[0].mean(axis=0)
    assert not np.allclose(V.mean_difference(a, b, "all_prompt"), pooled)


def test_mean_difference_one_dimensional_values_are_one_position():
    a, b = [np.array([1.0, 2.0])], [np.array([0.5, -1.0])]
    np.testing.assert_array_equal(V.mean_difference(a, b), np.array([0.5, 3.0], dtype=np.float32))


@pytest.mark.parametrize("args, field", [
    (([], [np.ones((1, 4))]), "prompts_a"),
    (([np.ones((1, 4))], []), "prompts_b"),
    (([np.ones((1, 4))], [np.ones((1, 5))]), "activations"),
    (([np.ones((1, 4))], [np.ones((1, 4))], "every"), "positions"),
    (([np.ones((0, 4))], [np.ones((1, 4))]), "activations"),
])
def test_mean_difference_bad_input_names_the_field(args, field):
    with pytest.raises(V.VectorInputError) as err:
        V.mean_difference(*args)
    assert err.value.field == field


def test_normalise_modes():
    v = np.array([3.0, 4.0], dtype=np.float32)
    np.testing.assert_array_equal(V.normalise(v, "none"), v)
    np.testing.assert_allclose(V.normalise(v, "unit"), [0.6, 0.8], rtol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(V.normalise(v, "activation", 10.0)), 10.0, rtol=1e-6)
    with pytest.raises(V.VectorInputError, match="zero"):
        V.normalise(np.zeros(2), "unit")
    with pytest.raises(V.VectorInputError) as err:
        V.normalise(v, "l1")
    assert err.value.field == "normalise"
    with pytest.raises(V.VectorInputError):
        V.normalise(v, "activation", None)


def test_contrastive_from_activations_records_norms():
    rng = np.random.default_rng(2)
    a, b = _acts(rng, [2, 2]), _acts(rng, [3, 1])
    cv = V.contrastive_from_activations(a, b, site="L2.post_block", normalisation="activation",
                                        prompts_a=["x", "y"], prompts_b=["z", "w"], name="v")
    raw = V.mean_difference(a, b)
    act_norm = np.mean([np.linalg.norm(x[-1]) for x in a + b])
    assert cv.raw_norm == pytest.approx(float(np.linalg.norm(raw)), rel=1e-6)
    assert cv.activation_norm == pytest.approx(float(act_norm), rel=1e-6)
    assert cv.norm == pytest.approx(float(act_norm), rel=1e-5)
    # same direction as the raw difference
    assert float(np.dot(cv.vector, raw)) / (cv.norm * cv.raw_norm) == pytest.approx(1.0, abs=1e-6)
    assert cv.summary()["n_a"] == 2 and cv.summary()["dim"] == 16


def test_prompt_lines_sites_names_and_steer_entries():
    assert V.parse_prompt_lines("  The capital of Tarn is \n\n The language of Rudan is\n") == [
        "The capital of Tarn is", "The language of Rudan is"]
    with pytest.raises(V.VectorInputError) as err:
        V.parse_prompt_lines(" \n ", "prompts_b")
    assert err.value.field == "prompts_b"
    with pytest.raises(SpecError):
        V.steer_entry("L3.mlp_up", name="v")
    with pytest.raises(V.VectorInputError):
        V.check_vector_name("has space")
    assert V.check_vector_name(" ok_name-1 ") == "ok_name-1"
    e = V.steer_entry("L2.post_block", name="v", scale=2)
    assert e == {"sites": ["L2.post_block"], "scale": 2.0, "positions": "all", "phase": "both", "name": "v"}
    with pytest.raises(V.VectorInputError):
        V.steer_entry("L2.post_block", name="v", vector=[1.0])
    assert V.steering_interventions([{**e, "scale": 0.0}]) is None
    assert V.steering_interventions([e, {**e, "scale": 0.0}]) == {"steer": [e]}


def test_contrast_defaults_from_the_bundled_tasks(tasks):
    d = V.contrast_defaults(tasks)
    facts = {f["prompt"]: f for f in tasks["facts"]}
    assert len(d.prompts_a) >= 2 and len(d.prompts_a) == len(d.prompts_b)
    assert all(facts[p]["relation"] == "capital" for p in d.prompts_a)
    assert all(facts[p]["relation"] == "language" for p in d.prompts_b)
    assert facts[d.test_prompt]["relation"] == "language" and d.test_prompt not in d.prompts_b
    assert V.contrast_defaults(None) is V.FALLBACK_DEFAULTS
    assert bundled_tasks() == tasks


# ---- through the real server -----------------------------------------------------------------------
def _engine_site_values(engine, prompt: str, site: str, positions: str) -> np.ndarray:
    layer, hook = Site.parse(site).layer, Site.parse(site).hook
    caps = engine.capture(prompt, [site], positions).captures
    rows = sorted((pos, val) for (lay, hk, pos), val in caps.items() if (lay, hk) == (layer, hook))
    return np.stack([val for _pos, val in rows])


@pytest.mark.parametrize("positions, site", [("last_prompt", "L2.post_block"), ("all_prompt", "L1.post_attn")])
def test_vector_built_through_the_server_equals_engine_captures(engine, server_url, tasks, positions, site):
    from app.client import CausalboardClient

    d = V.contrast_defaults(tasks, n=4)
    direct = V.mean_difference([_engine_site_values(engine, p, site, positions) for p in d.prompts_a],
                               [_engine_site_values(engine, p, site, positions) for p in d.prompts_b], positions)
    assert np.linalg.norm(direct) > 1.0  # the two relations really differ at this site
    name = f"test_contrast_{positions}"
    with CausalboardClient(server_url) as client:
        try:
            cv = V.build_contrastive_vector(client, d.prompts_a, d.prompts_b, site, positions=positions,
                                            name=name, register=True)
            np.testing.assert_allclose(cv.vector, direct, rtol=1e-5, atol=1e-5)
            assert cv.site == site and cv.positions == positions
            # the server holds exactly the vector we built
            listed = {v["name"]: v for v in client.list_vectors()["named"]}
            assert listed[name]["dim"] == engine.info.hidden_size
            assert listed[name]["norm"] == pytest.approx(cv.norm, rel=1e-5)
            np.testing.assert_allclose(np.asarray(client.get_vector(name)["vector"], dtype=np.float32), cv.vector, rtol=1e-6)
        finally:
            client.delete_vector(name)


def test_async_builder_matches_sync_builder(server_url, tasks):
    import asyncio

    from app.client import AsyncCausalboardClient, CausalboardClient

    d = V.contrast_defaults(tasks, n=3)
    with CausalboardClient(server_url) as client:
        sync_cv = V.build_contrastive_vector(client, d.prompts_a, d.prompts_b, "L3.pre_attn", normalisation="unit")

    async def build():
        async with AsyncCausalboardClient(server_url) as aclient:
            return await V.abuild_contrastive_vector(aclient, d.prompts_a, d.prompts_b, "L3.pre_attn", normalisation="unit")

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:  # a fresh loop, whatever the main thread holds
        async_cv = pool.submit(asyncio.run, build()).result()
    assert sync_cv.norm == pytest.approx(1.0, rel=1e-6)
    np.testing.assert_allclose(async_cv.vector, sync_cv.vector, rtol=1e-5, atol=1e-6)


def test_steering_with_the_registered_name_equals_the_inline_vector(engine, server_url, tasks):
    """The view steers by name; that must be the same intervention as sending the vector inline."""
    from app.client import CausalboardClient

    d = V.contrast_defaults(tasks, n=4)
    with CausalboardClient(server_url) as client:
        try:
            cv = V.build_contrastive_vector(client, d.prompts_a, d.prompts_b, "L2.post_block", name="test_by_name", register=True)
            by_name = client.generate(d.test_prompt, max_tokens=4, interventions=V.steering_interventions(
                [V.steer_entry("L2.post_block", name="test_by_name", scale=1.5)]))
            inline = client.generate(d.test_prompt, max_tokens=4, interventions=V.steering_interventions(
                [V.steer_entry("L2.post_block", vector=cv.vector, scale=1.5)]))
            baseline = client.generate(d.test_prompt, max_tokens=4)
        finally:
            client.delete_vector("test_by_name")
    assert by_name["token_ids"] == inline["token_ids"]
    assert by_name["logprobs"] == pytest.approx(inline["logprobs"], abs=1e-5)
    assert by_name["token_ids"] != baseline["token_ids"]  # the capital - language direction moves the answer
