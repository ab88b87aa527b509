"""Dynamic steering over HTTP (real server on the shared CPU engine): probes registered, listed,
fitted and deleted; a generation with a per-request policy returns its per-token trace; global
policies; GET /v1/steering/dynamic and /v1/status report the workers' state and determinism; bad
input is a 400 naming the field and the engine keeps serving."""

from __future__ import annotations

import math

import numpy as np
import pytest

H = 192
PROMPT = "The capital of Thaethas is"


def _vec(seed: int, scale: float = 1.0) -> list[float]:
    return (np.random.default_rng(seed).standard_normal(H) * scale).astype(np.float32).tolist()


@pytest.fixture
def probe(http):
    r = http.post("/v1/steering/probes", json={"name": "api-dir", "site": "L3.post_block", "direction": _vec(0)})
    assert r.status_code == 200, r.text
    yield r.json()
    http.put("/v1/steering/dynamic/policies", json={"policies": []})
    http.delete("/v1/steering/probes/api-dir")


def test_probe_registry_round_trip(http, probe):
    assert probe["name"] == "api-dir" and probe["kind"] == "direction" and probe["size"] == 1 and probe["hidden_size"] == H
    names = [p["name"] for p in http.get("/v1/steering/probes").json()["probes"]]
    assert "api-dir" in names
    bank = {"name": "api-bank", "site": "L1.post_attn", "kind": "bank", "weights": [_vec(1), _vec(2)], "bias": [0.5, -0.5],
            "labels": ["a", "b"]}
    r = http.post("/v1/steering/probes", json=bank)
    assert r.status_code == 200 and r.json()["size"] == 2
    assert http.delete("/v1/steering/probes/api-bank").json() == {"name": "api-bank", "deleted": True}
    r = http.delete("/v1/steering/probes/api-bank")
    assert r.status_code == 404 and r.json()["field"] == "name"


def test_generation_with_a_policy_returns_the_trace_and_status_counts_it(http, probe):
    before = http.get("/v1/steering/dynamic").json()
    pol = {"probe": "api-dir", "sites": ["L2.post_attn"], "vector": _vec(5, 4.0), "on": -1e30, "scale": 1.0}
    r = http.post("/v1/generate", json={"prompt": PROMPT, "max_tokens": 6, "ignore_eos": True, "dynamic": {"policies": [pol]}})
    assert r.status_code == 200, r.text
    dyn = r.json()["intervention"]["dynamic"]
    trace = dyn["trace"][0]
    n = len(r.json()["prompt_token_ids"])
    assert [e["position"] for e in trace] == list(range(n - 1, n + 5))
    assert [e["engaged"] for e in trace] == [False] + [True] * 5
    assert all(math.isfinite(e["score"]) and e["threshold"] == -1e30 for e in trace)
    assert dyn["actions"] == 5
    after = http.get("/v1/steering/dynamic").json()
    assert after["determinism"]["consistent"] is True
    assert after["determinism"]["action_count"] >= before["determinism"]["action_count"] + 5
    w = after["workers"][0]
    assert "api-dir" in w["probes"] and len(w["action_checksum"]) == 16
    status = http.get("/v1/status").json()
    assert status["dynamic"]["determinism"]["consistent"] is True
    assert any(p["name"] == "api-dir" for p in status["dynamic"]["probes"])


def test_global_policies_over_http(http, probe):
    pol = {"probe": "api-dir", "sites": ["L2.post_attn"], "vector": _vec(5, 4.0), "on": -1e30}
    r = http.put("/v1/steering/dynamic/policies", json={"policies": [pol]})
    assert r.status_code == 200 and len(r.json()["policies"]) == 1
    assert http.get("/v1/steering/dynamic/policies").json()["policies"][0]["probe"] == "api-dir"
    g = http.post("/v1/generate", json={"prompt": PROMPT, "max_tokens": 3}).json()
    assert [e["engaged"] for e in g["intervention"]["dynamic"]["trace"][0]] == [False, True, True]
    r = http.delete("/v1/steering/probes/api-dir")
    assert r.status_code == 400 and r.json()["field"] == "name"  # in use by a global policy
    assert http.put("/v1/steering/dynamic/policies", json={"policies": []}).json() == {"policies": []}


def test_fit_probe_over_http(http, tasks):
    facts = tasks["facts"]
    body = {"name": "api-fit", "site": "L4.post_block", "method": "mean_diff", "keep": False,
            "positive": [f["prompt"] for f in facts if f["relation"] == "capital"][:3],
            "negative": [f["prompt"] for f in facts if f["relation"] == "river"][:3]}
    r = http.post("/v1/steering/probes/fit", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert min(out["positive_scores"]) > out["threshold"] > max(out["negative_scores"])
    assert "api-fit" not in [p["name"] for p in http.get("/v1/steering/probes").json()["probes"]]


@pytest.mark.parametrize("body, field", [
    ({"name": "bad", "site": "L3.post_block", "direction": [1.0] * 10}, "direction"),
    ({"name": "bad", "site": "L3.nowhere", "direction": [1.0] * H}, "site"),
    ({"name": "bad", "site": "L30.post_block", "direction": [1.0] * H}, "site"),
    ({"name": "bad", "site": "L3.post_block", "kind": "linear", "weights": [1.0] * H, "bias": "x"}, "bias"),
    ({"name": "bad", "site": "L3.post_block", "kind": "bank", "weights": [[1.0] * H, [1.0] * H], "bias": [1.0]}, "bias"),
    ({"name": "bad", "site": "L3.post_block", "direction": [1.0] * H, "extra": 1}, "extra"),
])
def test_bad_probes_are_400_naming_the_field(http, body, field):
    r = http.post("/v1/steering/probes", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["field"] == field, r.json()


def test_non_finite_probe_weights_are_refused(http):
    raw = '{"name": "bad", "site": "L3.post_block", "direction": [NaN' + ", 1.0" * (H - 1) + "]}"
    r = http.post("/v1/steering/probes", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["field"] == "direction", r.text


@pytest.mark.parametrize("pol, field", [
    ({"on": 1.0, "off": 2.0}, "dynamic.policies[0].off"),
    ({"probe": "missing", "on": 1.0}, "dynamic.policies[0].probe"),
    ({"on": 1.0, "sites": ["L99.post_attn"]}, "dynamic.policies[0].sites[0]"),
    ({"on": 1.0, "vector": [1.0] * 3}, "dynamic.policies[0].vector"),
    ({"mode": "proportional", "target": 1.0, "gain": 0.1, "min_scale": 1.0, "max_scale": 0.0}, "dynamic.policies[0].max_scale"),
    ({"on": 1.0, "min_hold": -1}, "dynamic.policies[0].min_hold"),
])
def test_bad_policies_are_400_naming_the_field_and_the_engine_keeps_serving(http, probe, pol, field):
    base = {"probe": "api-dir", "sites": ["L2.post_attn"], "vector": _vec(5)}
    r = http.post("/v1/generate", json={"prompt": PROMPT, "max_tokens": 2, "dynamic": {"policies": [{**base, **pol}]}})
    assert r.status_code == 400, r.text
    assert r.json()["field"] == field, r.json()
    assert http.post("/v1/generate", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200
