"""Hybrid state-space models (issue #17): a tiny random Qwen3-Next (3 gated delta-net layers + 1
full-attention layer) built at test time, served by ONE real vLLM engine on CPU (bfloat16) for
this module: every intervention at the residual-stream sites of linear- and full-attention layers
against the transformers oracle (bfloat16), zero-on-realloc of recurrent-state slots, the 1-token
stale-state case, and the sentinel 4-arm check (Engine, HTTP route, CLI)."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from engine_ext import Engine, GenerationParams, SpecError
from engine_ext.reference.hf import HFReference, RefEdit
from engine_ext.sites import HOOKS
from engine_ext.specs import Capture, Interventions, Noise, Patch, Steer

from .conftest import serve_in_thread

pytestmark = pytest.mark.engine  # starts an engine of its own

#: bf16 tolerances (engine bf16 vs transformers bf16; measured worst on this model: rel-L2 of a
#: site's captured rows 0.05, logprob 0.03 — the two compute in different orders, and the
#: gated delta-net kernels differ: chunked vs recurrent)
REL_L2_TOL = 0.08
#: the MLP branch (mlp_in / mlp_out) end to end: small next to the stream, so the stream's bf16
#: drift is a larger relative error there, and a MoE router can pick another expert for a token
BRANCH_REL_L2_TOL = 0.25
LOGPROB_TOL = 0.1
#: a noised prompt's answer logprob (see test_noise_corruption_matches_the_oracle)
NOISY_LOGPROB_TOL = 0.2
PROMPT = "The capital of Tarn is"
SITES = [(layer, hook) for layer in range(4) for hook in HOOKS]  # residual stream and MLP branch
GREEDY = GenerationParams(max_tokens=4, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def hybrid_path(tmp_path_factory):
    from engine_ext.models.tiny_hybrid import build_tiny_hybrid

    return build_tiny_hybrid(tmp_path_factory.mktemp("tiny-hybrid"), seed=0)


@pytest.fixture(scope="module")
def hyb(hybrid_path):
    # its own engine-core process: the session's bundled engine may live in this process
    eng = Engine(model=str(hybrid_path), device="cpu", dtype="bfloat16", enforce_eager=True, multiprocess=True).start()
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def ref(hybrid_path):
    return HFReference(hybrid_path, dtype="bfloat16")


@pytest.fixture(scope="module")
def hyb_url(hyb):
    from app.api.app import create_app

    with serve_in_thread(create_app(hyb)) as url:
        yield url


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-9))


def assert_greedy_close(gen, rgen):
    """Same greedy tokens wherever the oracle's choice is not a bf16 near-tie; logprobs close."""
    for k, (a, b) in enumerate(zip(gen.token_ids, rgen.token_ids)):
        if a != b:
            assert rgen.top2_gaps[k] < 2 * LOGPROB_TOL, (k, gen.token_ids, rgen.token_ids, rgen.top2_gaps)
            return
        assert abs(gen.logprobs[k] - rgen.logprobs[k]) <= LOGPROB_TOL, (k, gen.logprobs, rgen.logprobs)


# ---- serving and interventions -----------------------------------------------------------------

def test_hybrid_is_served_with_every_layer_patched_and_no_prefix_caching(hyb):
    assert hyb.is_hybrid and hyb.info.architecture == "Qwen3NextForCausalLM"
    assert hyb.info.num_layers == 4 and hyb.info.dtype == "bfloat16"
    cache = hyb._loop.call(lambda e: (e.vllm_config.cache_config.enable_prefix_caching,
                                      e.vllm_config.cache_config.mamba_cache_mode)).result()
    assert cache == (False, "none")
    status = hyb.state_hygiene()
    assert status["mode"] == "zero" and status["state_layers"] == 3  # the three gated delta-net layers


def test_prefix_caching_mamba_cache_modes_and_float32_on_cpu_are_refused(hybrid_path):
    for kwargs, needle in (({"enable_prefix_caching": True}, "enable_prefix_caching"),
                           ({"mamba_cache_mode": "align"}, "mamba_cache_mode")):
        with pytest.raises(SpecError, match=needle) as err:
            Engine(model=str(hybrid_path), device="cpu", dtype="bfloat16", engine_kwargs=kwargs).start()
        assert err.value.field == "engine_kwargs"
    # vLLM's CPU gated delta-net kernels have no float32 implementation: refused, not a crash
    with pytest.raises(SpecError, match="bfloat16") as err:
        Engine(model=str(hybrid_path), device="cpu", dtype="float32").start()
    assert err.value.field == "dtype"


def test_captures_at_every_site_of_every_layer_match_the_oracle(hyb, ref):
    ids = hyb.tokenize(PROMPT)
    gen = hyb.capture(PROMPT, [f"L{layer}.{hook}" for layer, hook in SITES], "all_prompt")
    run = ref.run(ids, capture=SITES)
    assert set(gen.captures) == {(layer, hook, p) for layer, hook in SITES for p in range(len(ids))}
    errors = {}
    for layer, hook in SITES:
        mine = np.stack([gen.captures[(layer, hook, p)] for p in range(len(ids))])
        errors[f"L{layer}.{hook}"] = rel_l2(mine, run.captures[(layer, hook)].numpy())
    print("rel-L2 vs oracle:", {k: round(v, 4) for k, v in errors.items()})
    for name, err in errors.items():
        branch = name.split(".")[1] in ("mlp_in", "mlp_out")
        assert err <= (BRANCH_REL_L2_TOL if branch else REL_L2_TOL), (name, err)
    # each MoE block on its own: transformers' block applied to the engine's mlp_in reproduces the
    # engine's mlp_out (the end-to-end branch error above is drift accumulated upstream)
    import torch

    for layer in range(4):
        x = torch.tensor(np.stack([gen.captures[(layer, "mlp_in", p)] for p in range(len(ids))]), dtype=torch.bfloat16)
        with torch.no_grad():
            want = ref.layers[layer].mlp(x[None])[0].float().numpy()
        mine = np.stack([gen.captures[(layer, "mlp_out", p)] for p in range(len(ids))])
        err = rel_l2(mine, want)
        print(f"L{layer} MoE block alone: rel-L2 {err:.4f}")
        assert err <= REL_L2_TOL, (layer, err)
    # greedy decoding equals the oracle's
    assert_greedy_close(hyb.generate(ids, GREEDY), ref.generate(ids, 4, stop_at_eos=False))


def test_steering_linear_and_full_attention_layers_matches_the_oracle(hyb, ref):
    ids = hyb.tokenize(PROMPT)
    v = np.random.default_rng(0).standard_normal(128).astype(np.float32) * 1.5
    # a gated delta-net layer, the full-attention layer and a MoE block's output
    sites = ["L1.post_attn", "L3.pre_attn", "L2.mlp_out"]
    steered = hyb.generate(ids, GREEDY, Interventions(steer=(Steer.make(sites, v),)))
    plain = hyb.generate(ids, GREEDY)
    r = ref.generate(ids, 4, edits=[RefEdit.steer(s, v, positions=range(len(ids)), gen=True) for s in sites], stop_at_eos=False)
    assert steered.logprobs != plain.logprobs
    assert_greedy_close(steered, r)


def test_a_patch_changes_the_recurrent_state_from_that_position_on(hyb, ref):
    """Patching L0.post_block at position p feeds the gated delta-net layers 1-2 a different
    stream at p: their state, hence the stream at every later position, changes; earlier
    positions are untouched (bit-exact), and the result equals the oracle's patched run."""
    ids, src = hyb.tokenize(PROMPT), hyb.tokenize("Garrow is ruled by")
    p = 2
    assert len(src) > p and src[p] != ids[p] and src[:p] != ids[:p]
    hyb.capture(src, ["L0.post_block"], "all_prompt", keep_as="hyb-src", return_values=False)
    patch = (Patch.make("L0.post_block", [p], {"run": "hyb-src", "positions": [p]}),)
    plain = hyb.capture(ids, ["L2.post_block"], "all_prompt")
    patched_cap = hyb.generate(ids, GenerationParams(max_tokens=1, logprobs=0),
                               Interventions(patch=patch, capture=Capture.make(["L2.post_block"], "all_prompt")))
    assert patched_cap.intervention.status == "ok", patched_cap.intervention.errors
    for q in range(len(ids)):
        a, b = plain.captures[(2, "post_block", q)], patched_cap.captures[(2, "post_block", q)]
        if q < p:
            assert np.array_equal(a, b), q
        else:
            assert not np.allclose(a, b, atol=1e-3), q  # q > p: carried by the recurrent state
    target = ref.run(src, capture=[(0, "post_block")]).captures[(0, "post_block")].numpy()[p:p + 1]
    r = ref.run(ids, edits=[RefEdit.patch((0, "post_block"), [p], target)], capture=[(2, "post_block")])
    mine = np.stack([patched_cap.captures[(2, "post_block", q)] for q in range(p, len(ids))])
    assert rel_l2(mine, r.captures[(2, "post_block")].numpy()[p:]) <= REL_L2_TOL
    assert abs(patched_cap.logprobs[0] - float(r.logprobs()[patched_cap.token_ids[0]])) <= LOGPROB_TOL
    assert hyb.drop_source("hyb-src")


def test_noise_corruption_matches_the_oracle(hyb, ref):
    ids = hyb.tokenize(PROMPT)
    pos = [1, 2, 3]
    answer = ref.greedy(ids, 1).token_ids[0]
    noise = Noise.make(pos, scale=3.0, seed=1)
    edit = ref.noise_edit(pos, scale=3.0, seed=1, std=hyb.info.embedding_std)
    # the corruption itself: the stream entering layer 0 (embeddings + noise) equals the oracle's
    # up to bf16 rounding (same vectors at the same positions)
    gen = hyb.generate(ids, GenerationParams(max_tokens=1),
                       Interventions(noise=noise, capture=Capture.make(["L0.pre_attn"], "all_prompt")))
    mine = np.stack([gen.captures[(0, "pre_attn", p)] for p in range(len(ids))])
    want = ref.run(ids, edits=[edit], capture=[(0, "pre_attn")]).captures[(0, "pre_attn")].numpy()
    assert rel_l2(mine, want) <= 0.01, rel_l2(mine, want)
    # its effect on the answer: bf16 drift through the MoE layers is larger off-distribution
    # (measured on this model, 12 noise draws: 9 within 0.03 of the oracle, 3 at 0.10-0.12, where
    # a noised token's router near-tie goes another way), hence the branch tolerance here
    noisy = hyb.score(ids, [answer], Interventions(noise=noise))
    r = ref.score(ids, [answer], edits=[edit])
    assert abs(noisy[answer] - r[answer]) <= NOISY_LOGPROB_TOL
    assert abs(noisy[answer] - hyb.score(ids, [answer])[answer]) > LOGPROB_TOL  # the noise did something


def test_sweep_grid_matches_the_oracle(hyb, ref, hyb_url):
    import httpx

    clean, corrupt = "The capital of Tarn is", "The capital of Zorn is"
    cids, ids = hyb.tokenize(clean), hyb.tokenize(corrupt)
    assert len(cids) == len(ids)
    answer = ref.greedy(cids, 1).token_ids[0]
    with httpx.Client(base_url=hyb_url, timeout=600) as http:
        r = http.post("/v1/patch_sweep", json={"prompt": corrupt, "clean_prompt": clean, "answer_token_id": answer,
                                               "metric": "logprob", "hook": "post_block"})
    assert r.status_code == 200, r.text
    res = r.json()
    grid = np.array(res["grid"], dtype=float)
    assert grid.shape == (4, len(ids))
    worst = 0.0
    clean_run = ref.run(cids, capture=[(layer, "post_block") for layer in range(4)])
    for layer in range(4):
        for pos in range(len(ids)):
            target = clean_run.captures[(layer, "post_block")].numpy()[pos:pos + 1]
            want = ref.score(ids, [answer], edits=[RefEdit.patch((layer, "post_block"), [pos], target)])[answer]
            worst = max(worst, abs(grid[layer, pos] - want))
    assert worst <= LOGPROB_TOL, worst
    # restoring the last layer's output at the last position restores the clean logprob
    assert abs(grid[-1, -1] - res["clean"]) < 1e-4


# ---- recurrent-state hygiene ---------------------------------------------------------------------

def _others(hyb):
    for p in ("Garrow is ruled by", "a b c d e f g", "The capital of Port Grisk is"):
        hyb.generate(p, GenerationParams(max_tokens=3, ignore_eos=True))


def test_one_token_prompt_reads_stale_state_without_the_guard_and_not_with_it(hyb, ref):
    bos = hyb.tokenize(PROMPT)[:1]
    fresh = ref.generate(bos, 4, stop_at_eos=False)
    before = hyb.state_hygiene()
    _others(hyb)
    guarded = hyb.generate(bos, GREEDY)
    after = hyb.state_hygiene()
    # the marker: one slot per Mamba KV-cache group (here one per gated delta-net layer) per new request
    assert after["state_groups"] == 3
    assert after["slots_zeroed"] - before["slots_zeroed"] == 4 * after["state_groups"]
    assert_greedy_close(guarded, fresh)
    hyb._rpc("cb_state_hygiene", {"mode": "off"})  # stock vLLM: no guard
    try:
        stale = []
        for p in ("Garrow is ruled by", "a b c d e f g", "The capital of Port Grisk is"):
            hyb.generate(p, GenerationParams(max_tokens=3, ignore_eos=True))
            stale.append(hyb.generate(bos, GREEDY).logprobs)
    finally:
        hyb._rpc("cb_state_hygiene", {"mode": "zero"})
    # each previous owner leaves a different state, which the 1-token request continues from
    assert all(s != guarded.logprobs for s in stale)
    assert len({tuple(s) for s in stale}) == 3
    _others(hyb)
    assert hyb.generate(bos, GREEDY).logprobs == guarded.logprobs  # the guard is back: bit-exact again


def test_state_check_report(hyb):
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(report=hyb.state_check(max_tokens=4)))
    worker.start()
    deadline = time.time() + 60
    while hyb._exclusive_owner is None and worker.is_alive():
        assert time.time() < deadline
        time.sleep(0.01)
    # while the check holds the engine, other callers' requests are refused, not corrupted
    with pytest.raises(SpecError, match="state check is running") as err:
        hyb.generate([1], GREEDY)
    assert err.value.field == "engine"
    worker.join()
    report = result["report"]
    print(json.dumps({k: v for k, v in report.items() if k != "baseline"}, indent=1))
    arms = {a["arm"]: a for a in report["arms"]}
    assert list(arms) == ["zeroed+mask", "zeroed+mask_off", "sentinel+mask", "sentinel+mask_off"]
    assert all(a["as_expected"] for a in arms.values()), arms
    for name in ("zeroed+mask", "zeroed+mask_off"):
        assert not arms[name]["changed"] and arms[name]["guard_fired"] and arms[name]["slots_filled"] == 0
        assert all(p["max_logprob_diff"] == 0.0 for p in arms[name]["probes"])
    for name in ("sentinel+mask", "sentinel+mask_off"):
        assert arms[name]["changed"] and not arms[name]["guard_fired"] and arms[name]["slots_filled"] > 0
    # the mask alone misses exactly the 1-token probe; with the mask off every probe reads the sentinel
    assert [p["changed"] for p in arms["sentinel+mask"]["probes"]] == [True, False, False]
    assert all(p["changed"] for p in arms["sentinel+mask_off"]["probes"])
    assert report["mask_misses"] == [report["probes"][0]] and len(report["probes"][0]) == 1
    assert report["hygienic"] is True
    # the check restored the served mode
    status = hyb.state_hygiene()
    assert status["mode"] == "zero" and status["mask_off"] is False


def test_state_check_route_and_cli(hyb_url, capsys):
    import httpx

    from app.cli.main import main

    with httpx.Client(base_url=hyb_url, timeout=60) as http:
        bad = http.post("/v1/state_check", json={"probes": [[]]})
        assert bad.status_code == 400 and "probes" in bad.json()["field"]
        bad = http.post("/v1/state_check", json={"max_tokens": 0})
        assert bad.status_code == 400 and bad.json()["field"] == "max_tokens"
    code = main(["state-check", "--url", hyb_url, "--probe", "1", "--probe", "1,235,295", "--max-tokens", "2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["hygienic"] is True and out["probes"] == [[1], [1, 235, 295]]
    assert [a["changed"] for a in out["arms"]] == [False, False, True, True]
    assert main(["state-check", "--url", hyb_url, "--probe", "x"]) == 2


def test_state_check_is_refused_on_a_dense_model(engine):
    # the session's bundled (Llama) engine keeps no recurrent state
    assert engine.is_hybrid is False
    with pytest.raises(SpecError, match="hybrid models only") as err:
        engine.state_check()
    assert err.value.field == "model"
    assert engine.state_hygiene()["state_groups"] == 0  # the guard is inert there


def test_fresh_blocks_cover_new_and_resumed_requests_only():
    """Which slots the guard zeroes, from a scheduler step's plain data: every Mamba group's blocks
    of new requests and of requests resumed after preemption (recomputed from position 0), never
    the blocks a running request continues with."""
    from types import SimpleNamespace

    from engine_ext.worker.state_hygiene import fresh_state_blocks

    step = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(block_ids=([10, 11], [20], [30])),
                            SimpleNamespace(block_ids=([12], [21], [31]))],
        scheduled_cached_reqs=SimpleNamespace(req_ids=["run", "resumed"], resumed_req_ids={"resumed"},
                                              new_block_ids=[([13], [22], [32]), ([14], [23], [33])]))
    # group 0 is full attention here; groups 1 and 2 hold recurrent state
    assert fresh_state_blocks(step, {1: [], 2: []}) == {1: [20, 21, 23], 2: [30, 31, 33]}
    quiet = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(
        req_ids=["run"], resumed_req_ids=set(), new_block_ids=[None]))
    assert fresh_state_blocks(quiet, {1: [], 2: []}) == {}
