"""The MLP-branch sites `mlp_in` (the MLP's input, after the post-attention norm) and `mlp_out`
(the MLP's output, before its residual add), on the real engine (CPU, float32), checked against
the transformers oracle and against the residual-stream sites around them.

The generic exactness tests (captures at every hook, steered generation, bit-exact self-patching)
run over every hook in `tests/test_interventions.py`; these are the checks specific to the branch.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine_ext.reference.hf import RefEdit
from engine_ext.sites import BRANCH_HOOKS, HOOKS, RESIDUAL_HOOKS
from engine_ext import GenerationParams
from engine_ext.specs import Capture, Interventions, Patch, Steer
from tests.test_interventions import LOGPROB_ATOL, ONE, _vec, assert_close_capture, fact


def test_vocabulary_has_the_branch_hooks_in_forward_order():
    assert HOOKS == ("pre_attn", "post_attn", "mlp_in", "mlp_out", "post_block")
    assert set(RESIDUAL_HOOKS) | set(BRANCH_HOOKS) == set(HOOKS) and not set(RESIDUAL_HOOKS) & set(BRANCH_HOOKS)


def test_post_block_is_post_attn_plus_mlp_out(engine, tasks):
    prompt = fact(tasks, 2)["prompt"]
    L = engine.info.num_layers
    gen = engine.capture(prompt, [f"L{i}.{h}" for i in range(L) for h in ("post_attn", "mlp_out", "post_block")], "all_prompt")
    for i in range(L):
        for p in range(len(gen.prompt_token_ids)):
            c = gen.captures
            # the fused add-norm adds the branch to the residual in float32: exact
            assert np.array_equal(c[(i, "post_block", p)], c[(i, "post_attn", p)] + c[(i, "mlp_out", p)]), (i, p)


def test_mlp_in_is_what_the_mlp_reads(engine, hf_ref, tasks):
    """The captured mlp_in, fed through the oracle's MLP of that layer, gives the captured mlp_out."""
    import torch

    prompt = fact(tasks, 4)["prompt"]
    layer = engine.info.num_layers // 2
    gen = engine.capture(prompt, [f"L{layer}.mlp_in", f"L{layer}.mlp_out"], "all_prompt")
    n = len(gen.prompt_token_ids)
    x = torch.from_numpy(np.stack([gen.captures[(layer, "mlp_in", p)] for p in range(n)]))
    with torch.no_grad():
        y = hf_ref.layers[layer].mlp(x[None])[0].numpy()
    assert_close_capture(np.stack([gen.captures[(layer, "mlp_out", p)] for p in range(n)]), y, "mlp(mlp_in)")


def test_zero_ablating_mlp_out_removes_the_branch_and_matches_the_oracle(engine, hf_ref, tasks):
    item = fact(tasks, 6)
    prompt, ans = item["prompt"], item["foil_id"]  # the foil: the answer's logprob is saturated
    ids = engine.tokenize(prompt)
    layer = 1
    zero = Patch.make(f"L{layer}.mlp_out", "all_prompt", "zeros")
    spec = Interventions(patch=(zero,))
    cap = Capture.make([f"L{layer}.post_attn", f"L{layer}.mlp_out", f"L{layer}.post_block"], "all_prompt")
    gen = engine.generate(prompt, ONE, Interventions(patch=(zero,), capture=cap))
    for p in range(len(ids)):
        assert not gen.captures[(layer, "mlp_out", p)].any()
        assert np.array_equal(gen.captures[(layer, "post_block", p)], gen.captures[(layer, "post_attn", p)])
    got = engine.score(prompt, [ans], spec)
    ref = hf_ref.score(ids, [ans], edits=[RefEdit.zero((layer, "mlp_out"), range(len(ids)))])
    assert abs(got[ans] - ref[ans]) <= LOGPROB_ATOL
    assert abs(got[ans] - engine.score(prompt, [ans])[ans]) > 10 * LOGPROB_ATOL  # the ablation did something


@pytest.mark.parametrize("hook, alpha", [("mlp_out", 1.0), ("mlp_in", 0.5)])
def test_patching_corrupt_with_clean_branch_values_matches_the_oracle(engine, hf_ref, tasks, hook, alpha):
    pair = next(p for p in tasks["pairs"] if p["equal_length"])
    clean_p, corrupt_p, ans = pair["clean_prompt"], pair["corrupt_prompt"], pair["answer_id"]
    layer = engine.info.num_layers // 2
    run = f"clean-{hook}"
    engine.capture(clean_p, [f"L{layer}.{hook}"], "all_prompt", keep_as=run, return_values=False)
    try:
        spec = Interventions(patch=(Patch.make(f"L{layer}.{hook}", "all_prompt", {"run": run}, alpha=alpha),),
                             score_token_ids=(ans,))
        got = engine.generate(corrupt_p, ONE, spec)
        assert got.intervention.status == "ok"
        ref_caps = hf_ref.run(engine.tokenize(clean_p), capture=[(layer, hook)]).captures[(layer, hook)].numpy()
        ids = engine.tokenize(corrupt_p)
        ref = hf_ref.score(ids, [ans], edits=[RefEdit.patch((layer, hook), range(len(ids)), ref_caps, alpha=alpha)])
        assert abs(got.scores[0][ans] - ref[ans]) <= LOGPROB_ATOL
        assert abs(got.scores[0][ans] - engine.score(corrupt_p, [ans])[ans]) > 10 * LOGPROB_ATOL
    finally:
        engine.drop_source(run)


def test_mean_ablation_at_mlp_in_matches_the_oracle(engine, hf_ref, tasks):
    item = fact(tasks, 8)
    prompt, ans = item["prompt"], item["answer_id"]
    ids = engine.tokenize(prompt)
    pos = list(range(*item["subject_span"]))
    engine.capture(prompt, ["L2.mlp_in"], "all_prompt", keep_as="mean-mlp", return_values=False)
    try:
        got = engine.score(prompt, [ans], Interventions(patch=(Patch.make("L2.mlp_in", pos, {"mean_of": "mean-mlp"}),)))
        mean = hf_ref.run(ids, capture=[(2, "mlp_in")]).captures[(2, "mlp_in")].numpy().mean(0)
        ref = hf_ref.score(ids, [ans], edits=[RefEdit.patch((2, "mlp_in"), pos, np.tile(mean, (len(pos), 1)))])
        assert abs(got[ans] - ref[ans]) <= LOGPROB_ATOL
    finally:
        engine.drop_source("mean-mlp")


def test_steering_mlp_out_equals_steering_post_block(engine, tasks):
    """The branch is added to the residual: an added vector at mlp_out reaches the next layer as
    one at post_block does (up to float32 addition order)."""
    prompt = fact(tasks, 10)["prompt"]
    v = _vec(engine, 21, 8.0)
    params = GenerationParams(max_tokens=4, ignore_eos=True, logprobs=0)
    a = engine.generate(prompt, params, Interventions(steer=(Steer.make(["L2.mlp_out"], v, scale=1.5),)))
    b = engine.generate(prompt, params, Interventions(steer=(Steer.make(["L2.post_block"], v, scale=1.5),)))
    plain = engine.generate(prompt, params)
    assert a.token_ids == b.token_ids
    assert np.allclose(a.logprobs, b.logprobs, atol=LOGPROB_ATOL)
    assert not np.allclose(a.logprobs, plain.logprobs, atol=LOGPROB_ATOL)


def test_sweep_over_the_branch_hooks_matches_the_oracle(http, engine, hf_ref, tasks):
    pair = [p for p in tasks["pairs"] if p["equal_length"]][3]
    ans = pair["answer_id"]
    body = {"prompt": pair["corrupt_prompt"], "clean_prompt": pair["clean_prompt"], "answer_token_id": ans,
            "metric": "logprob", "hooks": ["post_block", "mlp_out", "mlp_in"], "layers": [1, 3]}
    r = http.post("/v1/patch_sweep", json=body)
    assert r.status_code == 200, r.text
    res = r.json()
    assert res["hooks"] == ["post_block", "mlp_out", "mlp_in"]  # the request's order (the fork's)
    grids = {g["hook"]: np.array(g["grid"], dtype=float) for g in res["hook_grids"]}
    clean_ids, ids = engine.tokenize(pair["clean_prompt"]), engine.tokenize(pair["corrupt_prompt"])
    n = len(ids)
    for hook in ("mlp_in", "mlp_out"):
        for i, layer in enumerate(res["layers"]):
            for pos in (1, n - 1):
                j = res["positions"].index(pos)
                target = hf_ref.run(clean_ids, capture=[(layer, hook)]).captures[(layer, hook)].numpy()[pos:pos + 1]
                ref = hf_ref.score(ids, [ans], edits=[RefEdit.patch((layer, hook), [pos], target)])
                assert abs(grids[hook][i, j] - ref[ans]) <= LOGPROB_ATOL, (hook, layer, pos)
    assert np.nanmax(np.abs(grids["mlp_out"] - res["corrupt"])) > 10 * LOGPROB_ATOL  # some cell moved
