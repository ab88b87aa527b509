"""Dimension masks on patches and steering: the wire forms and their errors (pure), and on the
real engine (CPU, float32) against the transformers oracle and against the unmasked values —
dimensions outside a mask keep their value bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from engine_ext import GenerationParams, SpecError
from engine_ext.program import ModelDims, PromptInfo, compile_program, decode_mask
from engine_ext.reference.hf import RefEdit
from engine_ext.sites import HOOKS
from engine_ext.specs import Capture, Interventions, Patch, Steer, mask_from_json
from tests.test_interventions import LOGPROB_ATOL, ONE, _vec, fact

DIMS = ModelDims(num_layers=4, hidden_size=8, vocab_size=100, embedding_std=1.0)


# ---- wire forms --------------------------------------------------------------------------------
def test_mask_forms_parse_to_the_same_weights():
    want = np.array([0, 1, 0, 1, 0, 0, 0, 0], np.float32)
    for form in ({"indices": [3, 1]}, [1, 3, 3], [False, True, False, True] + [False] * 4,
                 {"weights": want.tolist()}):
        assert np.array_equal(mask_from_json(form).values(8), want), form
    assert mask_from_json({"indices": [3, 1, 3]}).to_json() == {"indices": [1, 3]}
    soft = mask_from_json({"weights": [0.25] * 8})
    assert np.array_equal(mask_from_json(soft.to_json()).values(8), soft.values(8))  # base64 round trip
    assert mask_from_json(None) is None


@pytest.mark.parametrize("form, field", [
    ({"indices": []}, "mask.indices"),
    ({"indices": [1, -2]}, "mask.indices[1]"),
    ({"indices": [True]}, "mask.indices[0]"),
    ({"indices": [1], "weights": [1.0]}, "mask"),
    ({"inline": 0}, "mask.inline"),
    ({"weights": [0.5, 1.5]}, "mask.weights"),
    ({"weights": [0.5, float("nan")]}, "mask.weights"),
    ([False, False], "mask"),
    ("all", "mask"),
])
def test_bad_masks_name_the_field(form, field):
    with pytest.raises(SpecError) as err:
        mask_from_json(form)
    assert err.value.field == field


def test_masks_are_checked_against_the_model_and_travel_compactly():
    prompt = PromptInfo(list(range(5)))

    def compile_(spec):
        return compile_program(spec, prompt, DIMS, key="k", named_vector_dims=lambda n: None)

    prog = compile_(Interventions(patch=(Patch.make("L1.mlp_out", [2], "zeros", mask={"indices": [7, 0]}),),
                                  steer=(Steer.make(["L2.pre_attn"], [1.0] * 8, mask=[True] * 4 + [False] * 4),)))
    assert prog["patch"][0]["mask"] == {"idx": [0, 7], "n": 8}
    assert np.array_equal(decode_mask(prog["patch"][0]["mask"]), [1, 0, 0, 0, 0, 0, 0, 1])
    assert np.array_equal(decode_mask(prog["steer"][0]["mask"]), [1, 1, 1, 1, 0, 0, 0, 0])
    unmasked = compile_(Interventions(patch=(Patch.make("L1.mlp_out", [2], "zeros"),)))
    assert "mask" not in unmasked["patch"][0] and unmasked["hash"] != prog["hash"]
    for spec, field in ((Interventions(patch=(Patch.make("L1.post_block", [2], "zeros", mask=[0, 8]),)), "patch[0].mask.indices[1]"),
                        (Interventions(steer=(Steer.make(["L1.pre_attn"], [1.0] * 8, mask={"weights": [1.0] * 7}),)), "steer[0].mask.weights")):
        with pytest.raises(SpecError) as err:
            compile_(spec)
        assert err.value.field == field


# ---- on the engine -------------------------------------------------------------------------------
def _dims(engine, seed, k):
    return sorted(np.random.default_rng(seed).choice(engine.info.hidden_size, k, replace=False).tolist())


@pytest.mark.parametrize("hook", ["post_block", "mlp_in"])
def test_masked_patch_takes_only_the_masked_dimensions(engine, hf_ref, tasks, hook):
    pair = [p for p in tasks["pairs"] if p["equal_length"]][4]
    clean_p, corrupt_p, ans = pair["clean_prompt"], pair["corrupt_prompt"], pair["answer_id"]
    layer, H = 2, engine.info.hidden_size
    dims = _dims(engine, 1, H // 4)
    m = np.zeros(H, bool)
    m[dims] = True
    run = f"mask-src-{hook}"
    engine.capture(clean_p, [f"L{layer}.{hook}"], "all_prompt", keep_as=run, return_values=False)
    try:
        clean = engine.capture(clean_p, [f"L{layer}.{hook}"], "all_prompt").captures
        plain = engine.capture(corrupt_p, [f"L{layer}.{hook}"], "all_prompt").captures
        patch = Patch.make(f"L{layer}.{hook}", "all_prompt", {"run": run}, mask={"indices": dims})
        got = engine.generate(corrupt_p, ONE, Interventions(patch=(patch,), capture=Capture.make([f"L{layer}.{hook}"], "all_prompt"),
                                                            score_token_ids=(ans,)))
        assert got.intervention.status == "ok"
        n = len(got.prompt_token_ids)
        for p in range(n):
            v = got.captures[(layer, hook, p)]
            assert np.array_equal(v[m], clean[(layer, hook, p)][m]), p  # the source, exactly
            assert np.array_equal(v[~m], plain[(layer, hook, p)][~m]), p  # untouched, exactly
        ids = engine.tokenize(corrupt_p)
        src = hf_ref.run(engine.tokenize(clean_p), capture=[(layer, hook)]).captures[(layer, hook)].numpy()
        ref = hf_ref.score(ids, [ans], edits=[RefEdit.patch((layer, hook), range(n), src, mask=m)])
        assert abs(got.scores[0][ans] - ref[ans]) <= LOGPROB_ATOL
        full = engine.score(corrupt_p, [ans], Interventions(patch=(Patch.make(f"L{layer}.{hook}", "all_prompt", {"run": run}),)))
        assert got.scores[0][ans] != full[ans]  # the mask matters
    finally:
        engine.drop_source(run)


def test_masked_zero_ablation_of_mlp_out_clamps_those_dimensions(engine, hf_ref, tasks):
    item = fact(tasks, 12)
    prompt, foil = item["prompt"], item["foil_id"]
    dims = _dims(engine, 2, 5)
    spec = Interventions(patch=(Patch.make("L1.mlp_out", "all_prompt", "zeros", mask={"indices": dims}),))
    cap = Capture.make(["L1.mlp_out"], "all_prompt")
    got = engine.generate(prompt, ONE, Interventions(patch=spec.patch, capture=cap))
    plain = engine.capture(prompt, ["L1.mlp_out"], "all_prompt").captures
    keep = np.ones(engine.info.hidden_size, bool)
    keep[dims] = False
    for key, v in got.captures.items():
        assert not v[dims].any() and np.array_equal(v[keep], plain[key][keep])
    ids = engine.tokenize(prompt)
    ref = hf_ref.score(ids, [foil], edits=[RefEdit.zero((1, "mlp_out"), range(len(ids)), mask=~keep)])
    assert abs(engine.score(prompt, [foil], spec)[foil] - ref[foil]) <= LOGPROB_ATOL


@pytest.mark.parametrize("site", ["L1.post_attn", "L2.mlp_in"])
def test_masked_steering_matches_the_oracle_and_leaves_other_dimensions(engine, hf_ref, tasks, site):
    prompt = fact(tasks, 14)["prompt"]
    H = engine.info.hidden_size
    v = _vec(engine, 30, 12.0)
    dims = _dims(engine, 3, H // 2)
    m = np.zeros(H, bool)
    m[dims] = True
    layer, hook = int(site[1]), site.split(".")[1]
    params = GenerationParams(max_tokens=4, ignore_eos=True, logprobs=0)
    steer = Steer.make([site], v, scale=1.5, mask={"indices": dims})
    gen = engine.generate(prompt, params, Interventions(steer=(steer,)))
    ids = engine.tokenize(prompt)
    ref = hf_ref.generate(ids, 4, edits=[RefEdit.steer((layer, hook), v, scale=1.5, positions=range(len(ids)), gen=True, mask=m)],
                          stop_at_eos=False)
    assert gen.token_ids == ref.token_ids and np.allclose(gen.logprobs, ref.logprobs, atol=LOGPROB_ATOL)
    # at the steered site itself, only the masked dimensions moved
    steered = engine.generate(prompt, ONE, Interventions(steer=(steer,), capture=Capture.make([site], "all_prompt"))).captures
    plain = engine.capture(prompt, [site], "all_prompt").captures
    for key, x in steered.items():
        assert np.array_equal(x[~m], plain[key][~m]) and not np.array_equal(x[m], plain[key][m])
    unmasked = engine.generate(prompt, params, Interventions(steer=(Steer.make([site], v, scale=1.5),)))
    assert unmasked.logprobs != gen.logprobs


def test_soft_mask_lerp_matches_the_oracle(engine, hf_ref, tasks):
    item = fact(tasks, 16)
    prompt, foil = item["prompt"], item["foil_id"]
    H = engine.info.hidden_size
    w = np.random.default_rng(4).uniform(0, 1, H).astype(np.float32)
    t = _vec(engine, 31, 10.0)
    ids = engine.tokenize(prompt)
    pos = list(range(*item["subject_span"]))
    spec = Interventions(patch=(Patch.make("L2.post_attn", pos, {"vectors": [t]}, alpha=0.7, mask={"weights": w.tolist()}),))
    got = engine.score(prompt, [foil], spec)
    ref = hf_ref.score(ids, [foil], edits=[RefEdit.patch((2, "post_attn"), pos, t, alpha=0.7, mask=w)])
    assert abs(got[foil] - ref[foil]) <= LOGPROB_ATOL


def test_masked_global_steering_and_many_masks_release_their_rows(engine, tasks):
    prompt = fact(tasks, 17)["prompt"]
    v = _vec(engine, 32, 12.0)
    dims = _dims(engine, 5, 7)
    site = "L1.post_block"
    masked = Steer.make([site], v, mask={"indices": dims})
    local = engine.generate(prompt, ONE, Interventions(steer=(masked,), capture=Capture.make([site], "all_prompt")))
    try:
        engine.set_global_steer([masked])
        glob = engine.capture(prompt, [site], "all_prompt")
    finally:
        engine.clear_global_steer()
    for key, x in local.captures.items():
        assert np.array_equal(x, glob.captures[key])
    # more distinct masks over time than there are per-dimension rows: rows come back with the slots
    sites = [f"L{i}.{h}" for i in range(engine.info.num_layers) for h in HOOKS]
    assert len(sites) + 300 // len(sites) < engine.info.hidden_size
    for k in range(300 // len(sites) + 1):  # mask {j, len(sites) + k}: all distinct
        spec = Interventions(patch=tuple(Patch.make(s, [1], "zeros", alpha=0.5, mask={"indices": [j, len(sites) + k]})
                                         for j, s in enumerate(sites)))
        assert engine.generate(prompt, ONE, spec).intervention.status == "ok"


def test_sweep_with_a_mask_matches_the_oracle_and_bad_masks_name_the_field(http, engine, hf_ref, tasks):
    pair = [p for p in tasks["pairs"] if p["equal_length"]][5]
    ans, H = pair["answer_id"], engine.info.hidden_size
    dims = _dims(engine, 6, H // 3)
    m = np.zeros(H, bool)
    m[dims] = True
    body = {"prompt": pair["corrupt_prompt"], "clean_prompt": pair["clean_prompt"], "answer_token_id": ans,
            "metric": "logprob", "hooks": ["mlp_out", "post_block"], "layers": [2, 5], "mask": {"indices": dims}}
    r = http.post("/v1/patch_sweep", json=body)
    assert r.status_code == 200, r.text
    res = r.json()
    grids = {g["hook"]: np.array(g["grid"], dtype=float) for g in res["hook_grids"]}
    clean_ids, ids = engine.tokenize(pair["clean_prompt"]), engine.tokenize(pair["corrupt_prompt"])
    for hook in ("mlp_out", "post_block"):
        for i, layer in enumerate(res["layers"]):
            pos = len(ids) - 1
            target = hf_ref.run(clean_ids, capture=[(layer, hook)]).captures[(layer, hook)].numpy()[pos:pos + 1]
            ref = hf_ref.score(ids, [ans], edits=[RefEdit.patch((layer, hook), [pos], target, mask=m)])
            assert abs(grids[hook][i, res["positions"].index(pos)] - ref[ans]) <= LOGPROB_ATOL, (hook, layer)
    assert res["mask"] == {"indices": dims}  # the provenance of the numbers
    unmasked = http.post("/v1/patch_sweep", json={**body, "mask": None}).json()
    assert unmasked["hook_grids"][1]["grid"] != res["hook_grids"][1]["grid"] and "mask" not in unmasked
    for bad, field in (({"indices": [H]}, "mask.indices[0]"), ({"inline": 0}, "mask.inline"), ([], "mask")):
        r = http.post("/v1/patch_sweep", json={**body, "mask": bad})
        assert r.status_code == 400 and r.json()["field"] == field, r.text


def test_masks_over_http_equal_the_python_engine(http, engine, tasks):
    item = fact(tasks, 18)
    prompt, ids_ = item["prompt"], [item["answer_id"], item["foil_id"]]
    v = _vec(engine, 33, 12.0)
    ivs = {"patch": [{"site": "L3.mlp_out", "positions": "all_prompt", "source": "zeros", "mask": {"indices": [0, 5, 9]}}],
           "steer": [{"sites": ["L2.mlp_in"], "vector": v.tolist(), "mask": [True, False] * (engine.info.hidden_size // 2)}],
           "score_token_ids": ids_}
    r = http.post("/v1/generate", json={"prompt": prompt, "max_tokens": 1, "interventions": ivs})
    assert r.status_code == 200, r.text
    spec = Interventions(patch=(Patch.make("L3.mlp_out", "all_prompt", "zeros", mask={"indices": [0, 5, 9]}),),
                         steer=(Steer.make(["L2.mlp_in"], v, mask=[True, False] * (engine.info.hidden_size // 2)),),
                         score_token_ids=tuple(ids_))
    want = engine.generate(prompt, GenerationParams(max_tokens=1, logprobs=0), spec)
    assert r.json()["scores"] == [{str(k): x for k, x in want.scores[0].items()}]
    bad = {**ivs, "patch": [{**ivs["patch"][0], "mask": {"indices": [engine.info.hidden_size]}}]}
    r = http.post("/v1/generate", json={"prompt": prompt, "max_tokens": 1, "interventions": bad})
    assert r.status_code == 400 and r.json()["field"] == "interventions.patch[0].mask.indices[0]", r.text


def test_fork_completions_patch_masks_indices_and_inline(http, engine, tasks):
    from app.fork.vectors import pack_vectors

    item = fact(tasks, 19)
    prompt, ids_ = item["prompt"], [item["answer_id"], item["foil_id"]]
    H, last = engine.info.hidden_size, len(engine.tokenize(item["prompt"])) - 1
    w = np.random.default_rng(7).uniform(0, 1, H).astype(np.float32)
    t = _vec(engine, 34, 10.0)
    table = pack_vectors(np.stack([t, w]))
    body = {"prompt": prompt, "max_tokens": 1, "logprob_token_ids": ids_, "logprobs": len(ids_), "patch_vectors": table,
            "patch": [{"layer": 3, "hook": "mlp_in", "dest_position": last, "source_inline": 0, "mask": {"inline": 1}},
                      {"layer": 1, "hook": "post_block", "dest_position": last, "source_module": "zeros",
                       "mask": {"indices": [2, 7]}}]}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    want = engine.score(prompt, ids_, Interventions(patch=(
        Patch.make("L3.mlp_in", [last], {"vectors": [t]}, mask={"weights": w.tolist()}),
        Patch.make("L1.post_block", [last], "zeros", mask={"indices": [2, 7]}))))
    assert r.json()["choices"][0]["scores"] == [{str(k): v for k, v in want.items()}]
    for bad, field in (({"inline": 5}, "patch[0].mask.inline"), ({"inline": 0}, "patch[0].mask.inline")):
        r = http.post("/v1/completions", json={**body, "patch": [{**body["patch"][0], "mask": bad}]})
        assert r.status_code == 400 and r.json()["field"] == field, r.text


# ---- the op itself ---------------------------------------------------------------------------------
def test_op_paths_agree_on_per_dimension_a_and_rows_are_shared_and_released():
    """The CPU path and the branch-free torch path (CUDA tensors with unusual strides; run here on
    CPU tensors) compute the same masked edit; slots with the same (mask, alpha) share one row."""
    import torch

    from engine_ext.worker import intervention_op as op
    from engine_ext.worker.intervention_op import SiteBuffers, SlotMode
    from engine_ext.worker.slots import SlotTable, SlotValue

    H, rows = 16, 4
    b = SiteBuffers(num_sites=2, max_rows=rows, max_slots=4, max_capture_rows=4, hidden=H,
                    device=torch.device("cpu"), dtype=torch.float32, max_dim_rows=2)
    slots = SlotTable(b)
    m = np.zeros(H, np.float32)
    m[[1, 5, 6]] = 1.0
    a_vec = (1.0 - 0.75 * m.astype(np.float64)).astype(np.float32)
    t = np.arange(H, dtype=np.float32)
    masked = SlotValue(SlotMode.AFFINE, a=0.25, c=(0.75 * m).astype(np.float32) * t, a_vec=a_vec, a_key=("a", 0.75, "m"))
    s0 = slots.acquire("masked-1", lambda: masked)
    s1 = slots.acquire("masked-2", lambda: SlotValue(SlotMode.AFFINE, a=0.25, c=None, a_vec=a_vec, a_key=("a", 0.75, "m")))
    s2 = slots.acquire("plain", lambda: SlotValue(SlotMode.AFFINE, a=0.5, c=np.ones(H, np.float32)))
    assert slots._dim_of_slot[s0] == slots._dim_of_slot[s1] >= 0 and slots._dim_of_slot[s2] == -1
    slots.flush()
    b.row_slot[:rows, 1] = torch.tensor([s0, -1, s1, s2], dtype=torch.int32)
    b.active[1] = True
    x = torch.randn(rows, H)
    r = torch.randn(rows, H)
    outs = []
    for apply in (op._apply_torch, op._apply_torch_cuda):
        xx, rr = x.clone(), r.clone()
        apply(b, xx, rr, 1)
        outs.append((xx + rr).numpy())
    assert np.array_equal(outs[0], outs[1])
    s = (x + r).numpy()
    keep = m == 0
    assert np.array_equal(outs[0][0][keep], s[0][keep]) and np.array_equal(outs[0][0][~keep], (0.25 * s[0] + 0.75 * t)[~keep])
    assert np.array_equal(outs[0][1], s[1])  # no slot: untouched
    assert np.array_equal(outs[0][2][keep], s[2][keep]) and np.array_equal(outs[0][2][~keep], (0.25 * s[2])[~keep])
    assert np.allclose(outs[0][3], 0.5 * s[3] + 1.0)
    slots.release([s0, s1, s2])
    assert len(slots._dims.free) == 2 and not slots._dims.by_key


def test_dynamic_steering_on_top_of_a_masked_patch_keeps_the_mask(engine, hf_ref, tasks):
    """A dynamic action composes onto the slot of a masked patch at the same site and position:
    the composed value keeps the patch's per-dimension a (checked against the oracle)."""
    from engine_ext.dynamic.specs import DynamicRequest, Policy, Probe

    prompt = fact(tasks, 21)["prompt"]
    ids = engine.tokenize(prompt)
    n, H = len(ids), engine.info.hidden_size
    rng = np.random.default_rng(40)
    probe = Probe.make("mask-dyn-probe", "L3.post_block", direction=rng.standard_normal(H).astype(np.float32))
    engine.register_probe(probe)
    try:
        v = rng.standard_normal(H).astype(np.float32) * 3.0
        t = rng.standard_normal(H).astype(np.float32) * 3.0
        dims = _dims(engine, 8, H // 2)
        m = np.zeros(H, bool)
        m[dims] = True
        pol = Policy.make(probe=probe.name, sites=["L2.post_attn"], vector=v, on=-1e30)  # engaged at every step
        patch = Patch.make("L2.post_attn", [n + 1, n + 2], {"vectors": [t]}, alpha=0.8, mask={"indices": dims})
        params = GenerationParams(max_tokens=5, ignore_eos=True, logprobs=0)
        g = engine.generate(prompt, params, Interventions(patch=(patch,)), dynamic=DynamicRequest.make([pol]))
        assert g.intervention.status == "ok", g.intervention.errors
        trace = g.intervention.dynamic["trace"][0]
        steps = [(e["position"], e["scale"]) for e in trace if e["engaged"] and e["scale"]]
        assert {n + 1, n + 2} <= {p for p, _ in steps}
        edits = [RefEdit.patch((2, "post_attn"), [n + 1, n + 2], t, alpha=0.8, mask=m)]
        edits += [RefEdit.steer((2, "post_attn"), v, scale=sc, positions=[p]) for p, sc in steps]
        ref = hf_ref.generate(ids, 5, edits=edits, stop_at_eos=False)
        assert g.token_ids == ref.token_ids and np.allclose(g.logprobs, ref.logprobs, atol=LOGPROB_ATOL)
    finally:
        engine.set_dynamic_policies([])
        engine.delete_probe(probe.name)
