"""POST /v1/capture (JSON, npz, safetensors) and the stored source runs (GET/DELETE
/v1/patch_source) over HTTP, against `Engine.capture` on the shared engine."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from app.api.routes import capture as capture_routes

SITES = ["L0.pre_attn", "L2.post_attn", "L5.post_block"]


def test_capture_json_equals_engine_capture(http, engine, tasks):
    prompt = tasks["facts"][3]["prompt"]
    r = http.post("/v1/capture", json={"prompt": prompt, "sites": SITES, "positions": "all_prompt"})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = engine.tokenize(prompt)
    assert body["prompt_token_ids"] == ids
    assert body["token_strings"] == engine.token_strings(ids)
    assert body["positions"] == list(range(len(ids)))
    assert body["sites"] == SITES and body["stored_as"] is None
    direct = engine.capture(prompt, SITES, "all_prompt")
    for site in SITES:
        layer, hook = int(site[1]), site.split(".")[1]
        got = np.asarray(body["captures"][site], np.float32)
        assert got.shape == (len(ids), engine.info.hidden_size)
        want = np.stack([direct.captures[(layer, hook, p)] for p in range(len(ids))])
        np.testing.assert_array_equal(got, want, err_msg=site)  # float32 survives JSON exactly


def test_capture_default_is_the_last_prompt_position_and_spans_resolve(http, engine, tasks):
    item = tasks["facts"][1]
    body = http.post("/v1/capture", json={"prompt": item["prompt"], "sites": "L3.post_block"}).json()
    n = len(engine.tokenize(item["prompt"]))
    assert body["positions"] == [n - 1] and len(body["captures"]["L3.post_block"]) == 1
    span = http.post("/v1/capture", json={"prompt": item["prompt"], "sites": [{"layer": 1, "hook": "pre_attn"}],
                                          "positions": [{"span": item["subject"]}, -1]}).json()
    a, b = item["subject_span"]
    assert span["positions"] == [*range(a, b), n - 1]
    assert list(span["captures"]) == ["L1.pre_attn"]


@pytest.mark.parametrize("fmt", ["npz", "safetensors"])
def test_binary_formats_decode_to_the_json_arrays(http, engine, tasks, fmt):
    prompt = tasks["ioi"][1]["prompt"]
    req = {"prompt": prompt, "sites": SITES, "positions": [0, 2, -1]}
    as_json = http.post("/v1/capture", json=req).json()
    r = http.post("/v1/capture", json={**req, "format": fmt})
    assert r.status_code == 200, r.text
    if fmt == "npz":
        assert r.headers["content-type"] == "application/x-npz"
        arrays = dict(np.load(io.BytesIO(r.content), allow_pickle=False))
    else:
        from safetensors.numpy import load

        arrays = load(r.content)
    assert sorted(arrays) == sorted([*SITES, "positions", "prompt_token_ids"])
    for site in SITES:
        assert arrays[site].dtype == np.float32
        np.testing.assert_array_equal(arrays[site], np.asarray(as_json["captures"][site], np.float32))
    assert arrays["positions"].tolist() == as_json["positions"]
    assert arrays["prompt_token_ids"].tolist() == as_json["prompt_token_ids"]
    h = r.headers
    assert h["x-causalboard-sites"] == ",".join(SITES)
    assert h["x-causalboard-positions"] == ",".join(map(str, as_json["positions"]))
    assert json.loads(h["x-causalboard-token-strings"]) == as_json["token_strings"]
    assert h["x-causalboard-stored-as"] == ""


def test_keep_as_then_drop_source(http, engine, tasks):
    prompt = tasks["pairs"][0]["clean_prompt"]
    r = http.post("/v1/capture", json={"prompt": prompt, "sites": ["L1.post_block", "L2.post_block"], "positions": "all_prompt",
                                       "keep_as": "api-cap-run", "return_values": False})
    assert r.status_code == 200, r.text
    assert r.json()["stored_as"] == "api-cap-run" and r.json()["captures"] == {}
    usage = http.get("/v1/patch_source").json()
    assert usage["budget_bytes"] == 2 * 1024 * 1024 and usage["used_bytes"] > 0
    run = next(x for x in usage["runs"] if x["run_id"] == "api-cap-run")
    assert run["values"] == 2 * len(engine.tokenize(prompt)) and run["leases"] == 0 and run["bytes"] > 0
    assert engine.has_source("api-cap-run")
    r = http.delete("/v1/patch_source/api-cap-run")
    assert r.status_code == 200 and r.json() == {"dropped": True, "run_id": "api-cap-run"}
    r = http.delete("/v1/patch_source/api-cap-run")
    assert r.status_code == 404 and r.json()["field"] == "run_id" and "api-cap-run" in r.json()["error"]
    assert not engine.has_source("api-cap-run")
    assert all(x["run_id"] != "api-cap-run" for x in http.get("/v1/patch_source").json()["runs"])


def test_drop_of_a_leased_run_still_drops_it(http, engine, tasks):
    engine.capture(tasks["facts"][0]["prompt"], ["L0.post_block"], "all_prompt", keep_as="api-leased")
    assert engine.lease_source("api-leased")
    assert next(x for x in http.get("/v1/patch_source").json()["runs"] if x["run_id"] == "api-leased")["leases"] == 1
    assert http.delete("/v1/patch_source/api-leased").json()["dropped"] is True
    assert not engine.has_source("api-leased")


def test_large_json_capture_points_at_format(http, tasks, monkeypatch):
    monkeypatch.setattr(capture_routes, "MAX_JSON_FLOATS", 1000)  # the server runs in this process
    req = {"prompt": tasks["facts"][0]["prompt"], "sites": SITES, "positions": "all_prompt"}
    r = http.post("/v1/capture", json=req)
    assert r.status_code == 413 and r.json()["field"] == "format" and "npz" in r.json()["error"]
    assert http.post("/v1/capture", json={**req, "format": "npz"}).status_code == 200
    assert http.post("/v1/capture", json={**req, "return_values": False}).status_code == 200


BAD = [
    ({"sites": ["L9.post_block"]}, "sites[0]"),
    ({"sites": ["L1.resid"]}, "sites[0]"),
    ({"sites": ["layer1"]}, "sites[0]"),
    ({"sites": []}, "sites"),
    ({"sites": "L1.post_block", "positions": [40]}, "positions[0]"),
    ({"sites": "L1.post_block", "positions": [{"span": "Atlantis"}]}, "positions[0].span"),
    ({"sites": "L1.post_block", "positions": "everything"}, "positions"),
    ({"sites": "L1.post_block", "positions": "all_generated"}, "positions"),
    ({"sites": "L1.post_block", "format": "hdf5"}, "format"),
    ({"sites": "L1.post_block", "keep_as": "no spaces allowed"}, "keep_as"),
    ({"sites": "L1.post_block", "prompt": ""}, "prompt"),
    ({"sites": "L1.post_block", "return": True}, "return"),
]


def test_bad_capture_requests_name_the_field(http, tasks):
    prompt = tasks["facts"][0]["prompt"]
    for body, field in BAD:
        r = http.post("/v1/capture", json={"prompt": prompt, **body})
        assert r.status_code == 400, (body, r.text)
        assert r.json()["field"] == field, (body, r.json())
        assert r.json()["error"].startswith(field)
    # the engine keeps serving
    r = http.post("/v1/capture", json={"prompt": prompt, "sites": "L1.post_block"})
    assert r.status_code == 200 and len(r.json()["captures"]["L1.post_block"][0]) > 0
    st = http.get("/v1/status").json()
    assert st["in_flight_requests"] == 0
    assert st["kv_isolation"] == "blocks"  # one rank: the scheduler salts single blocks
