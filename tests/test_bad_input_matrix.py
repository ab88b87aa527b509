"""The bad-input matrix (issue #18): malformed requests across /v1/generate, /v1/completions,
/v1/patch_sweep, /v1/steering/* and /v1/capture — wrong types, out-of-range layers and positions,
unknown hooks, NaN/Infinity in vectors, 1 MB prompts, 10,000-deep JSON, invalid UTF-8, empty
bodies, huge lists. Each must be a 4xx whose `field` names the offending field and whose message
starts with it; the engine stays up and a known-good request's output is unchanged afterwards.

Add a case here for every new request field.
"""

from __future__ import annotations

import pytest

H = 192  # the bundled model's hidden size (checked below)
LAYERS = 8
PROMPT = "The capital of Tarn is"
GOOD = {"prompt": PROMPT, "max_tokens": 3, "logprobs": 2}
OK_VEC = [0.01] * H
DEEP = b'{"prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
SWEEP = {"prompt": "Garrow is ruled by", "clean_prompt": "Guzar is ruled by", "answer_token": " Hadrian"}
NAN_BODY = b'{"prompt": "x", "interventions": {"steer": [{"sites": "L1.post_block", "vector": [NaN' + b", 0.0" * (H - 1) + b"]}]}}"
INF_BODY = (b'{"name": "inf-vec", "vector": [Infinity' + b", 0.0" * (H - 1) + b"]}")


def J(method: str, path: str, body, status: int, field: str, raw: bool = False):
    return (method, path, body, status, field, raw)


def G(body, field, status=400):
    return J("POST", "/v1/generate", body, status, field)


def C(body, field, status=400):
    return J("POST", "/v1/completions", body, status, field)


def S(body, field, status=400):
    return J("POST", "/v1/patch_sweep", {**SWEEP, **body}, status, field)


def steer(**kw):
    return {"prompt": PROMPT, "max_tokens": 1, "interventions": {"steer": [{"sites": "L1.post_block", "vector": OK_VEC, **kw}]}}


CASES = {
    # ---- /v1/generate: types, ranges, sizes
    "gen-prompt-missing": G({"max_tokens": 1}, "prompt"),
    "gen-prompt-int": G({"prompt": 5}, "prompt"),
    "gen-prompt-empty": G({"prompt": ""}, "prompt"),
    "gen-prompt-1mb": G({"prompt": "a" * 1_000_000}, "prompt"),
    "gen-prompt-too-many-tokens": G({"prompt": "Tarn " * 400}, "prompt"),
    "gen-max-tokens-zero": G({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    "gen-max-tokens-str": G({"prompt": PROMPT, "max_tokens": "many"}, "max_tokens"),
    "gen-max-tokens-beyond-context": G({"prompt": PROMPT, "max_tokens": 10_000}, "max_tokens"),
    "gen-temperature-negative": G({"prompt": PROMPT, "temperature": -1}, "temperature"),
    "gen-top-p-zero": G({"prompt": PROMPT, "top_p": 0}, "top_p"),
    "gen-top-k-negative": G({"prompt": PROMPT, "top_k": -3}, "top_k"),
    "gen-logprobs-huge": G({"prompt": PROMPT, "logprobs": 1000}, "logprobs"),
    "gen-stop-int": G({"prompt": PROMPT, "stop": 5}, "stop"),
    "gen-stream-str": G({"prompt": PROMPT, "stream": "yes please"}, "stream"),
    "gen-unknown-field": G({"prompt": PROMPT, "temprature": 0.5}, "temprature"),
    "gen-interventions-list": G({"prompt": PROMPT, "interventions": []}, "interventions"),
    "gen-stream-bad-layer": G({**steer(), "stream": True, "interventions": {"steer": [{"sites": "L99.post_block", "vector": OK_VEC}]}},
                              "interventions.steer[0].sites"),
    # ---- /v1/generate: interventions
    "steer-layer-out-of-range": G({**steer(), "interventions": {"steer": [{"sites": "L99.post_block", "vector": OK_VEC}]}},
                                  "interventions.steer[0].sites"),
    "steer-layer-negative": G({**steer(), "interventions": {"steer": [{"sites": [{"layer": -1, "hook": "post_block"}], "vector": OK_VEC}]}},
                              "interventions.steer[0].sites[0].layer"),
    "steer-unknown-hook": G({**steer(), "interventions": {"steer": [{"sites": "L1.not_a_hook", "vector": OK_VEC}]}},
                            "interventions.steer[0].sites"),
    "steer-unknown-hook-object": G({**steer(), "interventions": {"steer": [{"sites": [{"layer": 1, "hook": "resid"}], "vector": OK_VEC}]}},
                                   "interventions.steer[0].sites[0].hook"),
    "steer-wrong-dimension": G(steer(vector=[0.1] * (H + 1)), "interventions.steer[0].vector"),
    "steer-vector-strings": G(steer(vector=["a"] * H), "interventions.steer[0].vector[0]"),
    "steer-nan-vector": J("POST", "/v1/generate", NAN_BODY, 400, "interventions.steer[0].vector", raw=True),
    "steer-scale-str": G(steer(scale="big"), "interventions.steer[0].scale"),
    "steer-position-out-of-range": G(steer(positions=[500]), "interventions.steer[0].positions"),
    "steer-span-not-found": G(steer(positions={"span": "Atlantis"}), "interventions.steer[0].positions"),
    "steer-phase-unknown": G(steer(phase="sometimes"), "interventions.steer[0].phase"),
    "steer-vector-and-name": G(steer(name="x"), "interventions.steer[0]"),
    "steer-unknown-name": G({**steer(), "interventions": {"steer": [{"sites": "L1.post_block", "name": "no-such-vector"}]}},
                            "interventions.steer[0].name"),
    "steer-huge-list": G({"prompt": PROMPT, "interventions": {"steer": [{"sites": "L1.post_block", "vector": OK_VEC}] * 5000}},
                         "interventions"),  # the request-wide site-position limit
    "patch-position-out-of-range": G({"prompt": PROMPT, "interventions": {"patch": [{"site": "L1.post_block", "positions": [77],
                                                                                      "source": "zeros"}]}},
                                     "interventions.patch[0].positions"),
    "patch-alpha-str": G({"prompt": PROMPT, "interventions": {"patch": [{"site": "L1.post_block", "source": "zeros", "alpha": "half"}]}},
                         "interventions.patch[0].alpha"),
    "patch-bad-source": G({"prompt": PROMPT, "interventions": {"patch": [{"site": "L1.post_block", "source": "ones"}]}},
                          "interventions.patch[0].source"),
    "capture-bad-keep-as": G({"prompt": PROMPT, "interventions": {"capture": {"sites": "L1.post_block", "keep_as": "../x"}}},
                             "interventions.capture.keep_as"),
    "noise-negative-scale": G({"prompt": PROMPT, "interventions": {"noise": {"positions": [1], "scale": -1}}},
                              "interventions.noise.scale"),
    "score-id-out-of-vocab": G({"prompt": PROMPT, "interventions": {"score_token_ids": [10**9]}}, "interventions.score_token_ids"),
    # ---- whole bodies
    "body-empty": J("POST", "/v1/generate", b"", 400, "body", raw=True),
    "body-empty-object": J("POST", "/v1/generate", b"{}", 400, "prompt", raw=True),
    "body-not-json": J("POST", "/v1/generate", b"prompt=hello", 400, "body", raw=True),
    "body-json-array": J("POST", "/v1/generate", b"[1, 2]", 400, "body", raw=True),
    "body-invalid-utf8": J("POST", "/v1/generate", b'{"prompt": "caf\xe9 \xff"}', 400, "body", raw=True),
    "body-10000-deep": J("POST", "/v1/generate", DEEP, 400, "body", raw=True),
    "body-over-limit": J("POST", "/v1/generate", b'{"prompt": "' + b"a" * (9 * 1024 * 1024) + b'"}', 413, "body", raw=True),
    # ---- /v1/completions (OpenAI + the reference fork's fields)
    "cmpl-wrong-model": C({"prompt": PROMPT, "model": "gpt-17"}, "model", 404),
    "cmpl-n-two": C({"prompt": PROMPT, "n": 2}, "n"),
    "cmpl-echo": C({"prompt": PROMPT, "echo": True}, "echo"),
    "cmpl-prompt-object": C({"prompt": {"text": "a"}}, "prompt"),  # text, ids or lists of them (vLLM's forms)
    "cmpl-clamps-bad-hook": C({"prompt": PROMPT, "steering_clamps": {"x": 1}}, "steering_clamps.x"),
    "cmpl-clamps-min-above-max": C({"prompt": PROMPT, "steering_clamps": {"post_block": {"1": [{"vector": OK_VEC, "min": 1, "max": 0}]}}},
                                   "steering_clamps.post_block.1[0].min"),
    "cmpl-steering-layer-out-of-range": C({"prompt": PROMPT, "steering_vectors": {"post_block": {"99": OK_VEC}}},
                                          "steering_vectors.post_block.99"),
    "cmpl-steering-bad-hook": C({"prompt": PROMPT, "steering_vectors": {"mlp": {"1": OK_VEC}}}, "steering_vectors.mlp"),
    "cmpl-patch-position": C({"prompt": PROMPT, "patch": [{"layer": 1, "dest_position": 999, "source_module": "zeros"}]},
                             "patch[0].dest_position"),
    "cmpl-logprob-ids-vocab": C({"prompt": PROMPT, "logprob_token_ids": [-4]}, "logprob_token_ids"),
    "cmpl-unknown-steering-name": C({"prompt": PROMPT, "steering_name": "no-such-module"}, "steering_name"),
    "cmpl-gate-clamp": C({"prompt": PROMPT, "steering": [{"when": {"kind": "always"}, "scope": "next_step",
                                                          "apply": {"kind": "clamp"}}]}, "steering[0].apply.kind"),
    "cmpl-gate-unknown-steer": C({"prompt": PROMPT, "steering": [{"when": {"kind": "always"}, "scope": "next_step", "apply": {
        "kind": "add", "steer": {"kind": "name", "name": "no-such-steer"}}}]}, "steering[0].apply.steer.name"),
    # ---- /v1/patch_sweep
    "sweep-layers-out-of-range": S({"layers": [0, 99]}, "layers"),
    "sweep-layers-str": S({"layers": "all"}, "layers"),
    "sweep-positions-out-of-range": S({"positions": [0, 500]}, "positions"),
    "sweep-unknown-hook": S({"hooks": ["post_mlp"]}, "hooks"),
    "sweep-answer-two-tokens": S({"answer_token": " Hadrian the Great"}, "answer_token"),
    "sweep-alpha-not-a-number": S({"alpha": "big"}, "alpha"),  # any finite value is valid (the fork's extrapolation)
    "sweep-metric-unknown": S({"metric": "accuracy"}, "metric"),
    "sweep-unknown-source-run": J("POST", "/v1/patch_sweep", {"prompt": SWEEP["prompt"], "source_run": "no-such-run",
                                                              "answer_token": " Hadrian"}, 404, "source_run"),
    "sweep-concurrency-zero": S({"max_concurrency": 0}, "max_concurrency"),
    "sweep-huge-layer-list": S({"layers": list(range(100_000))}, "layers"),
    # ---- /v1/steering/*
    "vec-name-traversal": J("POST", "/v1/steering/vectors", {"name": "../../etc/passwd", "vector": OK_VEC}, 400, "name"),
    "fork-registry-name-traversal": J("POST", "/v1/steering/vectors/register",
                                      {"name": "../x", "kind": "steer", "packed": {"post_block": {"1": OK_VEC}}}, 400, "name"),
    "vec-name-slash": J("POST", "/v1/steering/vectors", {"name": "a/b", "vector": OK_VEC}, 400, "name"),
    "vec-name-space": J("POST", "/v1/steering/vectors", {"name": "my vector", "vector": OK_VEC}, 400, "name"),
    "vec-name-too-long": J("POST", "/v1/steering/vectors", {"name": "v" * 129, "vector": OK_VEC}, 400, "name"),
    "vec-infinity": J("POST", "/v1/steering/vectors", INF_BODY, 400, "vector", raw=True),
    "vec-wrong-dimension": J("POST", "/v1/steering/vectors", {"name": "short", "vector": [0.1] * 3}, 400, "vector"),
    "vec-upload-bad-name": J("PUT", "/v1/steering/vectors/bad%20name", b"\x93NUMPY", 400, "name", raw=True),
    "vec-upload-not-a-file": J("PUT", "/v1/steering/vectors/okname", b"hello", 415, "body", raw=True),
    "set-layer-out-of-range": J("POST", "/v1/steering/set", {"vectors": {"post_block": {"42": OK_VEC}}}, 400,
                                "vectors.post_block.42"),
    "set-steer-unknown-name": J("POST", "/v1/steering/set", {"steer": [{"sites": "L1.post_block", "name": "nope"}]}, 400,
                                "steer[0].name"),
    "set-target-draft": J("POST", "/v1/steering/set", {"target": "draft", "vectors": {"post_block": {"1": OK_VEC}}}, 400, "target"),
    "module-bad-name": J("POST", "/v1/steering/modules/register", {"name": "a/b", "vectors": {"post_block": {"1": OK_VEC}}}, 400, "name"),
    "module-kind-sae": J("POST", "/v1/steering/modules/register", {"name": "m", "kind": "sae_delta", "vectors": {"post_block": {"1": OK_VEC}}},
                         400, "kind"),
    # ---- dynamic steering (/v1/steering/probes*, /v1/steering/dynamic/policies, the `dynamic` field)
    "probe-name-slash": J("POST", "/v1/steering/probes", {"name": "a/b", "site": "L1.post_block", "direction": OK_VEC}, 400, "name"),
    "probe-site-out-of-range": J("POST", "/v1/steering/probes", {"name": "p-bad", "site": "L99.post_block", "direction": OK_VEC},
                                 400, "site"),
    "probe-wrong-dimension": J("POST", "/v1/steering/probes", {"name": "p-bad", "site": "L1.post_block", "direction": [0.1] * 3},
                               400, "direction"),
    "probe-fit-no-positive": J("POST", "/v1/steering/probes/fit", {"name": "f-bad", "site": "L1.post_block", "positive": [],
                                                                   "negative": [PROMPT]}, 400, "positive"),
    "policies-unknown-probe": J("PUT", "/v1/steering/dynamic/policies", {"policies": [{"probe": "no-such-probe", "sites": ["L1.post_block"],
                                                                                        "vector": OK_VEC, "on": 0.0}]},
                                400, "policies[0].probe"),
    "gen-dynamic-unknown-probe": G({"prompt": PROMPT, "dynamic": {"policies": [{"probe": "no-such-probe", "sites": ["L1.post_block"],
                                                                                "vector": OK_VEC, "on": 0.0}]}},
                                   "dynamic.policies[0].probe"),
    "gen-dynamic-too-many-policies": G({"prompt": PROMPT, "dynamic": {"policies": [{"probe": "p", "sites": ["L1.post_block"],
                                                                                    "vector": OK_VEC}] * 9}},
                                       "dynamic.policies"),
    # ---- /v1/capture
    "capture-layer-out-of-range": J("POST", "/v1/capture", {"prompt": PROMPT, "sites": "L8.post_block"}, 400, "sites"),
    "capture-unknown-hook": J("POST", "/v1/capture", {"prompt": PROMPT, "sites": "L1.attn_out"}, 400, "sites"),
    "capture-position-out-of-range": J("POST", "/v1/capture", {"prompt": PROMPT, "sites": "L1.post_block", "positions": [64]}, 400,
                                       "positions"),
    "capture-format-unknown": J("POST", "/v1/capture", {"prompt": PROMPT, "sites": "L1.post_block", "format": "pickle"}, 400, "format"),
    "capture-keep-as-slash": J("POST", "/v1/capture", {"prompt": PROMPT, "sites": "L1.post_block", "keep_as": "a/b"}, 400, "keep_as"),
    "capture-huge-position-list": J("POST", "/v1/capture", {"prompt": PROMPT, "sites": "L1.post_block",
                                                            "positions": list(range(100_000))}, 400, "positions"),
}


def _send(http, method: str, path: str, body, raw: bool):
    if raw:
        ctype = "application/octet-stream" if method == "PUT" else "application/json"
        return http.request(method, path, content=body, headers={"content-type": ctype})
    return http.request(method, path, json=body)


@pytest.fixture(scope="module")
def known_good(server_url, engine):
    """The known-good request's output before the matrix; after it, the same output again."""
    import httpx

    assert engine.info.hidden_size == H and engine.info.num_layers == LAYERS
    with httpx.Client(base_url=server_url, timeout=120) as http:
        before = http.post("/v1/generate", json=GOOD).json()
        vectors_before = set(engine.list_vectors())
        yield before
        _check_unchanged(http, engine, before, vectors_before)


def _check_unchanged(http, engine, before: dict, vectors_before: set) -> None:
    after = http.post("/v1/generate", json=GOOD)
    assert after.status_code == 200
    body = after.json()
    assert (body["token_ids"], body["logprobs"], body["top_logprobs"]) == (before["token_ids"], before["logprobs"], before["top_logprobs"])
    assert engine.alive and http.get("/health").status_code == 200
    assert set(engine.list_vectors()) == vectors_before  # nothing was registered by a refused request
    assert engine.global_steer == []
    assert engine.in_flight == 0


def test_matrix_has_60_cases():
    assert len(CASES) >= 60
    assert {c[1].split("/")[2] for c in CASES.values()} >= {"generate", "completions", "patch_sweep", "steering", "capture"}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_bad_input_gets_a_4xx_naming_the_field(http, known_good, case):
    method, path, body, status, field, raw = CASES[case]
    r = _send(http, method, path, body, raw)
    assert r.status_code == status, (case, r.status_code, r.text[:500])
    got = r.json()
    assert got["field"] is not None and got["field"].startswith(field), (case, got)
    assert got["error"].startswith(got["field"]), (case, got)


# ---- the two API fixes of issue #18 -----------------------------------------------------------------
def test_status_shows_the_model_name_and_no_host_path(http, engine):
    status = http.get("/v1/status")
    assert status.status_code == 200
    body = status.json()
    assert body["model"] == engine.info.model and "model_path" not in body
    assert str(engine.model_path) not in status.text and str(engine.model_path.parent) not in status.text
    tasks = http.get("/v1/model/tasks")  # what the dashboard and notebooks read instead of a path
    assert tasks.status_code == 200 and tasks.json()["pairs"] and str(engine.model_path) not in tasks.text


def test_vector_names_use_the_keep_as_character_set(http, engine):
    r = http.post("/v1/steering/vectors", json={"name": "../../etc/passwd", "vector": OK_VEC})
    assert r.status_code == 400 and r.json()["field"] == "name"
    assert "letters, digits, '_', '-', '.', ':'" in r.json()["error"]  # says what is allowed
    assert "../../etc/passwd" not in engine.list_vectors()
    name = "ok_name-1.2:x"  # every allowed kind of character reads back through the path
    try:
        assert http.post("/v1/steering/vectors", json={"name": name, "vector": OK_VEC}).status_code == 200
        got = http.get(f"/v1/steering/vectors/{name}")
        assert got.status_code == 200 and got.json()["name"] == name
    finally:
        http.delete(f"/v1/steering/vectors/{name}")
