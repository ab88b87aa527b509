"""Per-request interventions over HTTP: the native `interventions` field of /v1/generate
(streaming and not) and the reference fork's extras on /v1/completions (steering vectors,
patches, exact scoring, steering modules, patch_source capture), each checked against the same
request through the Python `Engine` or the native form."""

from __future__ import annotations

import numpy as np
import pytest

from app.fork.vectors import pack_vectors
from engine_ext import GenerationParams
from engine_ext.specs import Capture, Interventions, Patch, Steer
from tests.sse import sse_data


def _vec(engine, seed=0, norm=30.0) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(engine.info.hidden_size).astype(np.float32)
    return (v / np.linalg.norm(v) * norm).astype(np.float32)


def _post(http, path, body, status=200):
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    return r.json()


# ---- /v1/generate -----------------------------------------------------------------------------------
def test_generate_steer_equals_the_python_engine(http, engine, tasks):
    prompt = tasks["facts"][8]["prompt"]
    v = _vec(engine, 21)
    steer = {"sites": ["L1.post_attn", "L3.pre_attn"], "vector": v.tolist(), "scale": 1.5, "positions": "all", "phase": "both"}
    plain = _post(http, "/v1/generate", {"prompt": prompt, "max_tokens": 5, "ignore_eos": True, "logprobs": 0})
    assert plain["intervention"] is None and plain["scores"] == []
    body = _post(http, "/v1/generate", {"prompt": prompt, "max_tokens": 5, "ignore_eos": True, "logprobs": 0, "interventions": {"steer": [steer]}})
    want = engine.generate(prompt, GenerationParams(max_tokens=5, ignore_eos=True, logprobs=0),
                           Interventions(steer=(Steer.make(["L1.post_attn", "L3.pre_attn"], v, scale=1.5),)))
    assert body["token_ids"] == want.token_ids
    assert body["logprobs"] == want.logprobs != plain["logprobs"]  # steering had an effect
    iv = body["intervention"]
    assert iv["status"] == "ok" and iv["errors"] == [] and iv["captures"] == []
    assert iv["program_hash"] == want.intervention.program_hash


def test_generate_capture_patch_and_scores(http, engine, tasks):
    pair = tasks["pairs"][0]
    clean, corrupt = pair["clean_prompt"], pair["corrupt_prompt"]
    engine.capture(clean, ["L1.post_block"], "all_prompt", keep_as="api-gen-clean")
    try:
        subj = [{"span": pair["subject_corrupt"]}]
        ivs = {"patch": [{"site": "L1.post_block", "positions": subj, "source": {"run": "api-gen-clean"}}],
               "capture": {"sites": ["L4.post_block"], "positions": "last_prompt"},
               "score_token_ids": [pair["answer_id"], pair["foil_id"]]}
        body = _post(http, "/v1/generate", {"prompt": corrupt, "max_tokens": 1, "interventions": ivs})
        spec = Interventions(patch=(Patch.make("L1.post_block", subj, {"run": "api-gen-clean"}),),
                             capture=Capture.make(["L4.post_block"], "last_prompt"),
                             score_token_ids=(pair["answer_id"], pair["foil_id"]))
        want = engine.generate(corrupt, GenerationParams(max_tokens=1, logprobs=0), spec)
        assert body["intervention"]["status"] == "ok"
        assert body["scores"] == [{str(k): v for k, v in want.scores[0].items()}]
        n = len(engine.tokenize(corrupt))
        (cap,) = body["intervention"]["captures"]
        assert (cap["layer"], cap["hook"], cap["position"]) == (4, "post_block", n - 1)
        np.testing.assert_array_equal(np.asarray(cap["value"], np.float32), want.captures[(4, "post_block", n - 1)])
        # patching the clean subject in moves the answer's logprob towards the clean run's
        unpatched = engine.score(corrupt, [pair["answer_id"]])[pair["answer_id"]]
        assert body["scores"][0][str(pair["answer_id"])] > unpatched
    finally:
        engine.drop_source("api-gen-clean")
    # the run is gone: the same request is voided, never silently unpatched
    body = _post(http, "/v1/generate", {"prompt": corrupt, "max_tokens": 1, "interventions": ivs})
    assert body["intervention"]["status"] == "voided" and "api-gen-clean" in body["intervention"]["errors"][0]


def test_generate_stream_carries_the_intervention_result(http, engine, tasks):
    prompt = tasks["ioi"][2]["prompt"]
    req = {"prompt": prompt, "max_tokens": 3, "ignore_eos": True, "logprobs": 0,
           "interventions": {"steer": [{"sites": "L2.post_block", "vector": _vec(engine, 22).tolist(), "phase": "decode"}],
                             "capture": {"sites": ["L0.post_attn"], "positions": "all_generated"}}}
    with http.stream("POST", "/v1/generate", json={**req, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_data(r.read().decode())
    done = events[-2]
    assert done["type"] == "done" and events[-1] == "[DONE]"
    plain = _post(http, "/v1/generate", req)
    assert done["token_ids"] == plain["token_ids"] and done["logprobs"] == plain["logprobs"]
    assert done["intervention"]["status"] == "ok"
    n = len(plain["prompt_token_ids"])
    assert [c["position"] for c in done["intervention"]["captures"]] == [n, n + 1]
    assert done["intervention"]["captures"] == plain["intervention"]["captures"]


# ---- /v1/completions: fork extras ---------------------------------------------------------------------
def test_completions_steering_vectors_dict_and_packed_match_native(http, engine, tasks):
    prompt = tasks["facts"][9]["prompt"]
    v, w = _vec(engine, 23), _vec(engine, 24, 10.0)
    base = {"prompt": prompt, "max_tokens": 5, "ignore_eos": True, "logprobs": 1}
    native = _post(http, "/v1/completions", {**base, "interventions": {"steer": [
        {"sites": "L2.post_attn", "vector": v.tolist(), "scale": 2.0},
        {"sites": "L4.pre_attn", "vector": w.tolist(), "phase": "decode"}]}})
    as_dict = _post(http, "/v1/completions", {**base, "steering_vectors": {"post_attn": {"2": {"vector": v.tolist(), "scale": 2.0}}},
                                              "decode_steering_vectors": {"pre_attn": {"4": w.tolist()}}})
    as_packed = _post(http, "/v1/completions", {**base, "steering_vectors": {"post_attn": {**pack_vectors(v[None], [2]), "scales": [2.0]}},
                                                "decode_steering_vectors": {"pre_attn": pack_vectors(w[None], [4])}})
    plain = _post(http, "/v1/completions", base)
    for body in (as_dict, as_packed):
        assert body["choices"][0]["text"] == native["choices"][0]["text"]
        assert body["choices"][0]["logprobs"] == native["choices"][0]["logprobs"] != plain["choices"][0]["logprobs"]
        assert body["intervention"]["status"] == "ok"
    assert "intervention" not in plain


def test_completions_fork_patch_and_logprob_token_ids_match_native(http, engine, tasks):
    pair = tasks["pairs"][1]
    clean, corrupt = pair["clean_prompt"], pair["corrupt_prompt"]
    ids = [pair["answer_id"], pair["foil_id"]]
    a, b = pair["subject_span_corrupt"]
    engine.capture(clean, ["L2.post_block"], "all_prompt", keep_as="api-fork-clean")
    try:
        fork = _post(http, "/v1/completions", {
            "prompt": corrupt, "max_tokens": 1, "logprobs": 2, "logprob_token_ids": ids,
            "patch": [{"layer": 2, "hook": "post_block", "dest_position": p, "source_run": "api-fork-clean", "source_position": p}
                      for p in range(a, b)]})
        native = _post(http, "/v1/generate", {"prompt": corrupt, "max_tokens": 1, "interventions": {
            "patch": [{"site": "L2.post_block", "positions": list(range(a, b)), "source": {"run": "api-fork-clean"}}],
            "score_token_ids": ids}})
        want = engine.score(corrupt, ids, Interventions(patch=(Patch.make("L2.post_block", list(range(a, b)), {"run": "api-fork-clean"}),)))
        choice = fork["choices"][0]
        assert choice["scores"] == native["scores"] == [{str(k): v for k, v in want.items()}]
        tops = choice["logprobs"]["top_logprobs"][0]
        assert sorted(tops.values()) == sorted(want.values())
        assert fork["intervention"]["status"] == "ok"
        # source_position defaults to the destination
        fork2 = _post(http, "/v1/completions", {"prompt": corrupt, "max_tokens": 1, "logprob_token_ids": ids, "logprobs": len(ids),
                                                "patch": [{"layer": 2, "hook": "post_block", "dest_position": p,
                                                           "source_run": "api-fork-clean"} for p in range(a, b)]})
        assert fork2["choices"][0]["scores"] == choice["scores"]
    finally:
        engine.drop_source("api-fork-clean")


def test_completions_source_module_and_inline_match_native(http, engine, tasks):
    prompt = tasks["facts"][10]["prompt"]
    n = len(engine.tokenize(prompt))
    ids = [tasks["facts"][10]["answer_id"]]
    v = _vec(engine, 25, 5.0)
    patches = lambda src: [{"layer": 3, "hook": "post_attn", "dest_position": n - 1, **src, "alpha": 0.5}]  # noqa: E731

    def native(source):
        return _post(http, "/v1/generate", {"prompt": prompt, "max_tokens": 1, "interventions": {
            "patch": [{"site": "L3.post_attn", "positions": [n - 1], "source": source, "alpha": 0.5}], "score_token_ids": ids}})["scores"]

    zeros = _post(http, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "logprob_token_ids": ids, "logprobs": len(ids),
                                            "patch": patches({"source_module": "zeros"})})
    assert zeros["choices"][0]["scores"] == native("zeros")
    inline = _post(http, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "logprob_token_ids": ids, "logprobs": len(ids),
                                             "patch_vectors": pack_vectors(np.stack([np.zeros_like(v), v])),
                                             "patch": patches({"source_inline": 1})})
    assert inline["choices"][0]["scores"] == native({"vectors": [v.tolist()]})
    http.post("/v1/steering/vectors", json={"name": "api-src", "vector": v.tolist()})
    http.post("/v1/steering/modules/register", json={"name": "api-mod", "vectors": {"post_attn": {"3": v.tolist()}}})
    try:
        for name in ("api-src", "api-mod"):
            body = _post(http, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "logprob_token_ids": ids, "logprobs": len(ids),
                                                   "patch": patches({"source_module": name})})
            assert body["choices"][0]["scores"] == inline["choices"][0]["scores"], name
    finally:
        http.delete("/v1/steering/vectors/api-src")
        http.post("/v1/steering/modules/unregister", json={"name": "api-mod"})


def test_completions_steering_name_uses_the_module(http, engine, tasks):
    prompt = tasks["facts"][11]["prompt"]
    v, w = _vec(engine, 26), _vec(engine, 27, 12.0)
    tiers = {"vectors": {"post_block": {"1": {"vector": v.tolist(), "scale": 0.5}}}, "prefill_vectors": {"post_attn": {"2": w.tolist()}}}
    assert http.post("/v1/steering/modules/register", json={"name": "api-steer-mod", **tiers}).status_code == 200
    try:
        base = {"prompt": prompt, "max_tokens": 4, "ignore_eos": True, "logprobs": 1}
        by_name = _post(http, "/v1/completions", {**base, "steering_name": "api-steer-mod"})
        inline = _post(http, "/v1/completions", {**base, "steering_vectors": tiers["vectors"],
                                                 "prefill_steering_vectors": tiers["prefill_vectors"]})
        assert by_name["choices"][0]["text"] == inline["choices"][0]["text"]
        np.testing.assert_allclose(by_name["choices"][0]["logprobs"]["token_logprobs"],
                                   inline["choices"][0]["logprobs"]["token_logprobs"], rtol=0, atol=1e-5)
    finally:
        http.post("/v1/steering/modules/unregister", json={"name": "api-steer-mod"})


def test_completions_patch_source_capture_stores_a_run(http, engine, tasks):
    prompt = tasks["facts"][12]["prompt"]
    body = _post(http, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "capture_wait": True,
                                           "capture": {"patch_source": {"run": "api-ps-run", "hooks": {"post_block": [1, 3], "pre_attn": "all"},
                                                                        "positions": "all_prompt"}}})
    try:
        n_sites = 2 + engine.info.num_layers
        assert body["capture_results"] == {"patch_source": {"status": "ok", "error": None, "payload": {
            "run": "api-ps-run", "sites": body["capture_results"]["patch_source"]["payload"]["sites"],
            "num_prompt_tokens": len(engine.tokenize(prompt))}}}
        assert len(body["capture_results"]["patch_source"]["payload"]["sites"]) == n_sites
        assert body["intervention"]["stored_as"] == "api-ps-run" and body["intervention"]["captures"] == []
        run = next(r for r in http.get("/v1/patch_source").json()["runs"] if r["run_id"] == "api-ps-run")
        n = len(engine.tokenize(prompt))
        assert run["values"] == (2 + engine.info.num_layers) * n
    finally:
        assert http.delete("/v1/patch_source/api-ps-run").status_code == 200


def test_completions_stream_with_scores(http, engine, tasks):
    prompt = tasks["facts"][13]["prompt"]
    ids = [tasks["facts"][13]["answer_id"]]
    req = {"prompt": prompt, "max_tokens": 2, "ignore_eos": True, "logprob_token_ids": ids, "logprobs": len(ids),
           "steering_vectors": {"post_block": {"0": _vec(engine, 28, 3.0).tolist()}}}
    with http.stream("POST", "/v1/completions", json={**req, "stream": True}) as r:
        events = sse_data(r.read().decode())
    assert events[-1] == "[DONE]"
    streamed = [s for e in events[:-1] for s in e["choices"][0]["scores"]]
    plain = _post(http, "/v1/completions", req)
    assert streamed == plain["choices"][0]["scores"] and len(streamed) == 2
    assert events[-2]["intervention"]["status"] == "ok"


# ---- bad input ------------------------------------------------------------------------------------------
def _bad(engine) -> list:
    h, n = engine.info.hidden_size, engine.info.num_layers  # n: the first layer that does not exist
    ok = [0.1] * h
    gen, cmp = "/v1/generate", "/v1/completions"
    return [
        (gen, {"interventions": {"steer": [{"sites": f"L{n}.post_block", "vector": ok}]}}, "interventions.steer[0].sites[0]"),
        (gen, {"interventions": {"steer": [{"sites": "L1.post_block", "vector": ok[:-1]}]}}, "interventions.steer[0].vector"),
        (gen, {"interventions": {"steer": [{"sites": "L1.post_block", "name": "nope"}]}}, "interventions.steer[0].name"),
        (gen, {"interventions": {"steer": [{"sites": "L1.post_block"}]}}, "interventions.steer[0].vector"),
        (gen, {"interventions": {"steer": [{"sites": "L1.attn_out", "vector": ok}]}}, "interventions.steer[0].sites[0]"),
        (gen, {"interventions": {"patch": [{"site": "L1.post_block", "positions": [99], "source": "zeros"}]}}, "interventions.patch[0].positions[0]"),
        (gen, {"interventions": {"patch": [{"site": "L1.post_block", "positions": [1], "source": "ones"}]}}, "interventions.patch[0].source"),
        (gen, {"interventions": {"capture": {"sites": ["L1.post_block"], "positions": [{"span": "zzz"}]}}}, "interventions.capture.positions[0].span"),
        (gen, {"interventions": {"score_token_ids": [10_000]}}, "interventions.score_token_ids[0]"),
        (gen, {"interventions": {"score_token_ids": [1]}, "logprobs": 2}, "logprobs"),
        (gen, {"interventions": {"noise": {"positions": [1], "scale": -1}}}, "interventions.noise.scale"),
        (gen, {"interventions": {"bogus": 1}}, "interventions.bogus"),
        (cmp, {"steering_vectors": {"post_mlp": {"1": ok}}}, "steering_vectors.post_mlp"),
        (cmp, {"steering_vectors": {"post_block": {"1": ok[:-1]}}}, "steering_vectors.post_block.1"),
        (cmp, {"prefill_steering_vectors": {"post_block": {str(n): ok}}}, f"prefill_steering_vectors.post_block.{n}"),
        (cmp, {"steering_clamps": {"post_block": {"1": [{"vector": ok, "min": 1.0, "max": 0.0}]}}}, "steering_clamps.post_block.1[0].min"),
        (cmp, {"decode_steering_clamps": {"post_block": {"1": [{"vector": ok[:-1], "value": 0.0}]}}}, "decode_steering_clamps.post_block.1[0].vector"),
        (cmp, {"steering": [{"when": {}, "scope": "next_step", "apply": {}}]}, "steering[0].when.kind"),
        (cmp, {"steering": [{"when": {"kind": "always"}, "scope": "next_step", "apply": {"kind": "clamp"}}]}, "steering[0].apply.kind"),
        (cmp, {"steering_name": "no-such-module"}, "steering_name"),
        (cmp, {"patch": [{"layer": 1, "dest_position": 1, "source_module": "zeros", "mask": {"indices": [h]}}]}, "patch[0].mask.indices[0]"),
        (cmp, {"patch": [{"layer": 1, "hook": "post_mlp", "dest_position": 1, "source_module": "zeros"}]}, "patch[0].hook"),
        (cmp, {"patch": [{"layer": 9, "dest_position": 1, "source_module": "zeros"}]}, "patch[0].layer"),
        (cmp, {"patch": [{"layer": 1, "dest_position": 1}]}, "patch[0]"),
        (cmp, {"patch": [{"layer": 1, "dest_position": 1, "source_run": "r", "source_module": "zeros"}]}, "patch[0]"),
        (cmp, {"patch": [{"layer": 1, "dest_position": 50, "source_module": "zeros"}]}, "patch[0].dest_position"),
        (cmp, {"patch": [{"layer": 1, "dest_position": 1, "source_inline": 0}]}, "patch[0].source_inline"),
        (cmp, {"patch": [{"layer": 1, "dest_position": 1, "source_inline": 3}], "patch_vectors": pack_vectors(np.ones((2, h)))}, "patch[0].source_inline"),
        (cmp, {"patch": [{"layer": 1, "dest_position": 1, "source_module": "no-such"}]}, "patch[0].source_module"),
        (cmp, {"patch_vectors": {"dtype": "int8", "shape": [1, h], "data": ""}}, "patch_vectors.dtype"),
        (cmp, {"logprob_token_ids": [1, 2]}, "logprob_token_ids"),
        (cmp, {"logprob_token_ids": list(range(129)), "logprobs": 1}, "logprob_token_ids"),
        (cmp, {"cache_salt": ""}, "cache_salt"),
        (cmp, {"prompt": [1, 10_000]}, "prompt"),
        (cmp, {"prompt": [[1, 5], [1, 10_000]]}, "prompt[1]"),
        (cmp, {"logprob_token_ids": [1], "logprobs": 1, "interventions": {"score_token_ids": [2]}}, "logprob_token_ids"),
        (cmp, {"capture": {"filesystem": {}}}, "capture.filesystem"),
        (cmp, {"capture": {"patch_source": {"run": "r", "hooks": {"post_block": {"ranges": [[0, n]]}}}}}, "capture.patch_source.hooks.post_block.ranges[0]"),
        (cmp, {"capture": {"patch_source": {"run": "r", "hooks": {"post_block": {"ranges": [[2, 1]]}}}}}, "capture.patch_source.hooks.post_block.ranges[0]"),
        (cmp, {"capture": {"patch_source": {"run": "r", "hooks": {"post_block": [9]}}}}, "capture.patch_source.hooks.post_block[0]"),
        (cmp, {"capture": {"patch_source": {"run": "r", "hooks": {"post_block": "all"}, "positions": [77]}}}, "capture.patch_source.positions[0]"),
        (cmp, {"interventions": {"steer": [{"sites": "L1.post_block", "vector": ok[:3]}]}}, "interventions.steer[0].vector"),
    ]


NOT_SUPPORTED = {"steering_vectors.post_mlp", "steering[0].apply.kind", "patch[0].hook"}


def test_bad_interventions_name_the_field_and_leave_the_engine_untouched(http, engine, tasks):
    prompt = tasks["facts"][0]["prompt"]
    before = _post(http, "/v1/generate", {"prompt": prompt, "max_tokens": 3, "ignore_eos": True, "logprobs": 0})
    for path, extra, field in _bad(engine):
        r = http.post(path, json={"prompt": prompt, "max_tokens": 1, **extra})
        assert r.status_code == 400, (path, field, r.text)
        err = r.json()
        assert err["field"] == field, (field, err)
        assert err["error"].startswith(field), err
        if field in NOT_SUPPORTED:
            assert "not supported" in err["error"], err
        with http.stream("POST", path, json={"prompt": prompt, "max_tokens": 1, "stream": True, **extra}) as s:
            assert s.status_code == 400 and s.headers["content-type"].startswith("application/json")
    after = _post(http, "/v1/generate", {"prompt": prompt, "max_tokens": 3, "ignore_eos": True, "logprobs": 0})
    assert after["token_ids"] == before["token_ids"] and after["logprobs"] == before["logprobs"]
    st = http.get("/v1/status").json()
    assert st["in_flight_requests"] == 0 and st["global_steering"] == []
    assert "r" not in {run["run_id"] for run in st["source_store"]["runs"]}  # refused captures stored nothing


def test_structural_and_semantic_errors_name_a_list_field_the_same_way(http, engine, tasks):
    """pydantic (a wrong type) and the spec constructors / the engine (a wrong value) report the
    same field path, with list indices in brackets."""
    prompt = tasks["facts"][0]["prompt"]
    ok = ", ".join(["0.1"] * engine.info.hidden_size)

    def refused(path: str, raw: str) -> dict:
        r = http.post(path, content=raw.encode(), headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        return r.json()

    steer = '{"prompt": "%s", "max_tokens": 1, "interventions": {"steer": [{"sites": "L1.post_block", "vector": [%s], "scale": %s}]}}'
    as_string = refused("/v1/generate", steer % (prompt, ok, '"big"'))  # pydantic: not a number
    as_nan = refused("/v1/generate", steer % (prompt, ok, "NaN"))  # Steer.make: not finite
    assert as_string["field"] == as_nan["field"] == "interventions.steer[0].scale", (as_string, as_nan)
    assert as_string["errors"][0]["type"] == "float_parsing" and "finite" in as_nan["error"]
    assert as_string["error"].startswith("interventions.steer[0].scale: ") and as_nan["error"].startswith("interventions.steer[0].scale: ")
    # the same for the fork's patch list on /v1/completions: a string layer (pydantic), a layer the model lacks (route)
    patch = '{"prompt": "%s", "max_tokens": 1, "patch": [{"layer": %s, "dest_position": 1, "source_module": "zeros"}]}'
    assert refused("/v1/completions", patch % (prompt, '"one"'))["field"] == "patch[0].layer"
    assert refused("/v1/completions", patch % (prompt, engine.info.num_layers))["field"] == "patch[0].layer"
    # and for a nested list: a site object with an unknown hook (pydantic) and site text with one (Steer.make)
    sites = '{"prompt": "%s", "max_tokens": 1, "interventions": {"capture": {"sites": ["L1.post_block", %s]}}}'
    assert refused("/v1/generate", sites % (prompt, '{"layer": 1, "hook": "resid"}'))["field"] == "interventions.capture.sites[1].hook"
    assert refused("/v1/generate", sites % (prompt, '"L1.resid"'))["field"] == "interventions.capture.sites[1]"


@pytest.mark.parametrize("fields", [{"logprobs": 2}, {"logprobs": 0}, {"logprobs": 5}])
def test_logprob_token_ids_accepts_the_fork_rule(http, tasks, fields):
    """The fork's HTTP rule: `logprobs` must be set (any value; the ids replace the top-k)."""
    item = tasks["facts"][14]
    ids = [item["answer_id"], item["foil_id"]]
    body = _post(http, "/v1/completions", {"prompt": item["prompt"], "max_tokens": 1, "logprob_token_ids": ids, **fields})
    scores = body["choices"][0]["scores"][0]
    assert set(scores) == {str(i) for i in ids} and scores[str(item["answer_id"])] > scores[str(item["foil_id"])]
