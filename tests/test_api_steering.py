"""Global steering, named vectors and steering modules over HTTP (real uvicorn server on the
shared engine). Every test that sets global steering clears it again: the engine is shared."""

from __future__ import annotations

import io
import json
import struct

import numpy as np
import pytest

from app.fork.vectors import pack_vectors
from engine_ext import GenerationParams
from engine_ext.specs import Interventions, Steer
from engine_ext.sites import HOOKS


def _vec(engine, seed=0, norm=30.0) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(engine.info.hidden_size).astype(np.float32)
    return (v / np.linalg.norm(v) * norm).astype(np.float32)


def _generate(http, prompt, **extra):
    r = http.post("/v1/generate", json={"prompt": prompt, "max_tokens": 6, "ignore_eos": True, "logprobs": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture
def clean_steering(http, engine):
    """Guarantee no global steering before and after the test."""
    engine.clear_global_steer()
    yield
    engine.clear_global_steer()
    assert engine.global_steer == []


def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


def _safetensors_bf16(name: str, arr: np.ndarray) -> bytes:
    """A .safetensors file holding one BF16 tensor (numpy has no bfloat16: built by hand)."""
    bits = (np.asarray(arr, np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
    header = json.dumps({name: {"dtype": "BF16", "shape": [len(arr)], "data_offsets": [0, len(bits)]}}).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + bits


# ---- global steering ----------------------------------------------------------------------------
def test_set_changes_generation_like_per_request_steering_and_clear_restores_baseline(http, engine, tasks, clean_steering):
    prompt = tasks["facts"][2]["prompt"]
    baseline = _generate(http, prompt)
    v = _vec(engine, 1)
    r = http.post("/v1/steering/set", json={"vectors": {"post_block": {"2": {"vector": v.tolist(), "scale": 2.0}}}})
    assert r.status_code == 200, r.text
    assert r.json() == {"status": "ok", "hook_points": ["post_block"], "layers_updated": [2], "sites": ["L2.post_block"]}
    steered = _generate(http, prompt)
    assert (steered["token_ids"], steered["logprobs"]) != (baseline["token_ids"], baseline["logprobs"])
    assert _generate(http, prompt)["token_ids"] == steered["token_ids"]  # greedy: deterministic
    # the same steering per request (no global steering) gives the same tokens and logprobs
    engine.clear_global_steer()
    direct = engine.generate(prompt, GenerationParams(max_tokens=6, ignore_eos=True, logprobs=0),
                             Interventions(steer=(Steer.make(["L2.post_block"], v, scale=2.0),)))
    assert direct.token_ids == steered["token_ids"]
    np.testing.assert_allclose(direct.logprobs, steered["logprobs"], rtol=0, atol=1e-5)
    http.post("/v1/steering/set", json={"vectors": {"post_block": {"2": {"vector": v.tolist(), "scale": 2.0}}}})
    assert http.post("/v1/steering/clear").json() == {"status": "ok"}
    after = _generate(http, prompt)
    assert after["token_ids"] == baseline["token_ids"]
    assert after["logprobs"] == baseline["logprobs"]  # bit-identical once cleared
    assert http.get("/v1/steering").json() == {"active_layers": {}, "steer": [], "clamp": []}


def test_merge_replace_and_active_layers(http, engine, clean_steering):
    a, b, c = _vec(engine, 2, 3.0), _vec(engine, 3, 4.0), _vec(engine, 4, 5.0)
    assert http.post("/v1/steering/set", json={"vectors": {"post_attn": {"1": a.tolist()}}}).status_code == 200
    r = http.post("/v1/steering/set", json={"prefill_vectors": {"pre_attn": {"3": {"vector": b.tolist(), "scale": 0.5}}}})
    assert r.json()["sites"] == ["L1.post_attn", "L3.pre_attn"]
    st = http.get("/v1/steering").json()
    assert st["active_layers"]["1"]["post_attn"]["norm"] == pytest.approx(3.0, rel=1e-5)
    # the fork's shape: a zero norm is left out, norms are rounded to 6 decimals
    assert st["active_layers"]["3"]["pre_attn"] == {"prefill_norm": pytest.approx(2.0, rel=1e-5)}
    assert all(round(v, 6) == v for hooks in st["active_layers"].values() for n in hooks.values() for v in n.values())
    assert [(e["sites"], e["phase"]) for e in st["steer"]] == [(["L1.post_attn"], "both"), (["L3.pre_attn"], "prefill")]
    # same site and phase: replaced, not added
    http.post("/v1/steering/set", json={"vectors": {"post_attn": {"1": c.tolist()}}})
    st = http.get("/v1/steering").json()
    assert st["active_layers"]["1"]["post_attn"]["norm"] == pytest.approx(5.0, rel=1e-5)
    assert len(st["steer"]) == 2
    # the native entries POST back unchanged
    entries = [{k: v for k, v in e.items() if k != "norm"} for e in st["steer"]]
    http.post("/v1/steering/clear")
    assert http.post("/v1/steering/set", json={"steer": entries, "replace": True}).status_code == 200
    assert http.get("/v1/steering").json() == st
    # replace: only the new entry remains
    http.post("/v1/steering/set", json={"decode_vectors": {"post_block": {"0": a.tolist()}}, "replace": True})
    st = http.get("/v1/steering").json()
    assert list(st["active_layers"]) == ["0"] and st["active_layers"]["0"]["post_block"]["decode_norm"] == pytest.approx(3.0, rel=1e-5)
    assert engine.global_steer[0].phase == "decode"


def test_packed_form_equals_dict_form(http, engine, tasks, clean_steering):
    prompt = tasks["facts"][4]["prompt"]
    rows = np.stack([_vec(engine, 5, 10.0), _vec(engine, 6, 10.0)])
    http.post("/v1/steering/set", json={"vectors": {"post_attn": {"1": {"vector": rows[0].tolist(), "scale": 1.5},
                                                                  "4": {"vector": rows[1].tolist(), "scale": -1.0}}}})
    dict_form = (http.get("/v1/steering").json(), _generate(http, prompt))
    packed = {**pack_vectors(rows, [1, 4]), "scales": [1.5, -1.0]}
    r = http.post("/v1/steering/set", json={"vectors": {"post_attn": packed}, "replace": True})
    assert r.status_code == 200, r.text
    assert (http.get("/v1/steering").json(), _generate(http, prompt)) == dict_form
    # float16 rows decode too (to the float16-rounded values)
    r = http.post("/v1/steering/set", json={"vectors": {"post_attn": pack_vectors(rows[:1], [1], "float16")}, "replace": True})
    assert r.status_code == 200, r.text
    got = np.asarray(http.get("/v1/steering").json()["steer"][0]["vector"], np.float32)
    np.testing.assert_array_equal(got, rows[0].astype(np.float16).astype(np.float32))


def test_native_steer_with_named_vector(http, engine, tasks, clean_steering):
    prompt = tasks["facts"][6]["prompt"]
    v = _vec(engine, 7, 25.0)
    assert http.post("/v1/steering/vectors", json={"name": "api-glob", "vector": v.tolist()}).status_code == 200
    try:
        r = http.post("/v1/steering/set", json={"steer": [{"sites": ["L1.post_block", "L2.post_block"], "name": "api-glob",
                                                           "scale": 0.5, "positions": "all_generated"}]})
        assert r.status_code == 200, r.text
        assert r.json()["sites"] == ["L1.post_block", "L2.post_block"]
        entry = http.get("/v1/steering").json()["steer"][0]
        assert entry["name"] == "api-glob" and entry["vector"] is None and entry["norm"] == pytest.approx(12.5, rel=1e-5)
        got = _generate(http, prompt)
        engine.clear_global_steer()
        want = engine.generate(prompt, GenerationParams(max_tokens=6, ignore_eos=True, logprobs=0), Interventions(
            steer=(Steer.make(["L1.post_block", "L2.post_block"], v, scale=0.5, positions="all_generated"),)))
        assert got["token_ids"] == want.token_ids
    finally:
        engine.clear_global_steer()
        http.delete("/v1/steering/vectors/api-glob")


def test_layers_lists_every_layer_and_hook(http, engine):
    body = http.get("/v1/steering/layers").json()
    assert list(body["layers"]) == [str(i) for i in range(engine.info.num_layers)]
    assert all(v == {"hook_points": sorted(HOOKS)} for v in body["layers"].values())


# ---- named vectors ------------------------------------------------------------------------------
def test_named_vector_json_npy_and_safetensors_round_trip(http, engine):
    from safetensors.numpy import save

    h = engine.info.hidden_size
    v32 = _vec(engine, 8, 2.0)
    v64 = np.random.default_rng(9).standard_normal(h)  # float64 on disk, float32 on the engine
    uploads = {
        "rt-json": ("POST", v32),
        "rt-npy": ("PUT", _npy(v64)),
        "rt-npy-row": ("PUT", _npy(v32[None, :])),
        "rt-st": ("PUT", save({"vector": v32, "other": np.zeros(3, np.float32)})),
        "rt-st-one": ("PUT", save({"weights": v64.astype(np.float16)})),
        "rt-bf16": ("PUT", _safetensors_bf16("w", v32)),
    }
    want = {
        "rt-json": v32, "rt-npy": v64.astype(np.float32), "rt-npy-row": v32, "rt-st": v32,
        "rt-st-one": v64.astype(np.float16).astype(np.float32),
        "rt-bf16": ((v32.view(np.uint32) >> 16) << 16).view(np.float32),
    }
    try:
        for name, (method, payload) in uploads.items():
            if method == "POST":
                r = http.post("/v1/steering/vectors", json={"name": name, "vector": payload.tolist()})
            else:
                r = http.put(f"/v1/steering/vectors/{name}", content=payload, headers={"content-type": "application/octet-stream"})
            assert r.status_code == 200, (name, r.text)
            assert r.json() == {"name": name, "dim": h, "norm": pytest.approx(float(np.linalg.norm(want[name])), rel=1e-5)}
        listed = {v["name"]: v for v in http.get("/v1/steering/vectors").json()["named"]}
        for name, vec in want.items():
            assert listed[name]["dim"] == h
            got = http.get(f"/v1/steering/vectors/{name}").json()
            np.testing.assert_array_equal(np.asarray(got["vector"], np.float32), vec, err_msg=name)
            np.testing.assert_array_equal(engine.named_vector(name), vec)
        # a registered name steers exactly like the same values inline
        prompt = "The capital of Tarn is"
        by_name = _generate(http, prompt, interventions={"steer": [{"sites": "L2.post_attn", "name": "rt-npy", "scale": 8.0}]})
        inline = _generate(http, prompt, interventions={"steer": [{"sites": "L2.post_attn", "vector": want["rt-npy"].tolist(), "scale": 8.0}]})
        assert by_name["token_ids"] == inline["token_ids"] and by_name["logprobs"] == inline["logprobs"]
    finally:
        for name in uploads:
            http.delete(f"/v1/steering/vectors/{name}")
    for name in uploads:
        assert http.delete(f"/v1/steering/vectors/{name}").status_code == 404
        assert name not in engine.list_vectors()


def test_delete_of_a_vector_the_global_steering_uses_is_a_conflict(http, engine, clean_steering):
    http.post("/v1/steering/vectors", json={"name": "api-used", "vector": _vec(engine, 10).tolist()})
    http.post("/v1/steering/set", json={"steer": [{"sites": "L0.post_block", "name": "api-used"}]})
    r = http.delete("/v1/steering/vectors/api-used")
    assert r.status_code == 409 and r.json()["field"] == "name"
    http.post("/v1/steering/clear")
    assert http.delete("/v1/steering/vectors/api-used").json() == {"name": "api-used", "deleted": True}


def test_too_many_named_vectors_is_refused(http, engine):
    limit = engine.config.limits.max_named_vectors
    assert http.get("/v1/steering/vectors").json()["max_count"] == limit
    v = _vec(engine, 11, 1.0).tolist()
    names = [f"api-many-{i}" for i in range(limit - len(engine.list_vectors()))]
    try:
        for name in names:
            assert http.post("/v1/steering/vectors", json={"name": name, "vector": v}).status_code == 200
        r = http.post("/v1/steering/vectors", json={"name": "api-one-too-many", "vector": v})
        assert r.status_code == 400 and r.json()["field"] == "name" and str(limit) in r.json()["error"]
        # replacing an existing name is still allowed at the limit
        assert http.post("/v1/steering/vectors", json={"name": names[0], "vector": v}).status_code == 200
    finally:
        for name in names:
            http.delete(f"/v1/steering/vectors/{name}")
    assert not any(n.startswith("api-many-") for n in engine.list_vectors())


# ---- modules ------------------------------------------------------------------------------------
def test_modules_register_list_unregister(http, engine):
    a, b = _vec(engine, 12, 2.0), _vec(engine, 13, 3.0)
    body = {"name": "mod-a", "vectors": {"post_block": {"1": {"vector": a.tolist(), "scale": 2.0}}},
            "decode_vectors": {"pre_attn": pack_vectors(b[None, :], [2])}}
    r = http.post("/v1/steering/modules/register", json=body)
    assert r.status_code == 200, r.text
    assert r.json() == {"status": "ok", "name": "mod-a", "modules": ["mod-a"]}
    listed = http.get("/v1/steering/modules").json()
    assert listed["modules"] == ["mod-a"] and listed["count"] == 1
    assert {(e["site"], e["phase"]) for e in listed["details"]["mod-a"]} == {("L1.post_block", "both"), ("L2.pre_attn", "decode")}
    norms = {e["site"]: e["norm"] for e in listed["details"]["mod-a"]}
    assert norms["L1.post_block"] == pytest.approx(4.0, rel=1e-5) and norms["L2.pre_attn"] == pytest.approx(3.0, rel=1e-5)
    np.testing.assert_allclose(engine.named_vector("module/mod-a/both/L1.post_block"), a * 2.0, rtol=1e-6)
    # re-registering replaces the module's vectors
    http.post("/v1/steering/modules/register", json={"name": "mod-a", "vectors": {"post_attn": {"0": a.tolist()}}})
    assert [e["site"] for e in http.get("/v1/steering/modules").json()["details"]["mod-a"]] == ["L0.post_attn"]
    assert not any(n.startswith("module/mod-a/decode") for n in engine.list_vectors())
    r = http.post("/v1/steering/modules/unregister", json={"name": "mod-a"})
    assert r.json() == {"status": "ok", "name": "mod-a", "modules": []}
    r = http.post("/v1/steering/modules/unregister", json={"name": "mod-a"})
    assert r.status_code == 404 and r.json()["field"] == "name"
    assert not any(n.startswith("module/") for n in engine.list_vectors())


# ---- bad input ------------------------------------------------------------------------------------
def _bad_cases(h: int, n_layers: int) -> list:
    ok = [0.1] * h
    return [
        ("POST", "/v1/steering/set", {"vectors": {"post_block": {"2": [0.1] * (h - 1)}}}, 400, "vectors.post_block.2"),
        ("POST", "/v1/steering/set", {"vectors": {"post_block": {"2": {"vector": ok, "scale": 1, "gain": 2}}}}, 400, "vectors.post_block.2.gain"),
        ("POST", "/v1/steering/set", {"vectors": {"resid_post": {"2": ok}}}, 400, "vectors.resid_post"),
        ("POST", "/v1/steering/set", {"vectors": {"post_mlp": {"2": ok}}}, 400, "vectors.post_mlp"),
        ("POST", "/v1/steering/set", {"decode_vectors": {"pre_attn": {"99": ok}}}, 400, "decode_vectors.pre_attn.99"),
        ("POST", "/v1/steering/set", {"vectors": {"pre_attn": {"x": ok}}}, 400, "vectors.pre_attn.x"),
        ("POST", "/v1/steering/set", {"clamps": {"post_block": {"2": [{"vector": ok, "min": 1.0, "max": 0.0}]}}}, 400, "clamps.post_block.2[0].min"),
        ("POST", "/v1/steering/set", {"prefill_clamps": {"post_block": {"2": [{"vector": [0.0] * h, "value": 0.0}]}}}, 400, "prefill_clamps.post_block.2[0].vector"),
        ("POST", "/v1/steering/set", {"vectors": {"pre_attn": {"1": ok}}, "target": "draft"}, 400, "target"),
        ("POST", "/v1/steering/set", {}, 400, "vectors"),
        ("POST", "/v1/steering/set", {"vectors": {}, "verbose": True}, 400, "verbose"),
        ("POST", "/v1/steering/set", {"steer": [{"sites": "L1.post_block", "name": "no-such-vector"}]}, 400, "steer[0].name"),
        ("POST", "/v1/steering/set", {"steer": [{"sites": "L1.post_block", "vector": ok, "positions": {"span": "x"}}]}, 400, "steer[0].positions"),
        ("POST", "/v1/steering/set", {"steer": [{"sites": f"L{n_layers}.post_block", "vector": ok}]}, 400, "steer[0].sites[0]"),
        ("POST", "/v1/steering/set", {"steer": [{"sites": "L1.post_block", "vector": [1.0, 2.0]}]}, 400, "steer[0].vector"),
        ("POST", "/v1/steering/set", {"vectors": {"post_block": {**pack_vectors(np.ones((1, h)), [1]), "data": "!!"}}}, 400, "vectors.post_block.data"),
        ("POST", "/v1/steering/set", {"vectors": {"post_block": pack_vectors(np.ones((1, h - 2)), [1])}}, 400, "vectors.post_block.shape"),
        ("POST", "/v1/steering/set", {"vectors": {"post_block": pack_vectors(np.ones((2, h)), [1])}}, 400, "vectors.post_block.layer_indices"),
        ("POST", "/v1/steering/set", {"vectors": {"post_block": pack_vectors(np.ones((1, h)), [n_layers])}}, 400, "vectors.post_block.layer_indices[0]"),
        ("POST", "/v1/steering/vectors", {"name": "bad", "vector": [0.1] * (h + 1)}, 400, "vector"),
        ("POST", "/v1/steering/vectors", {"name": "module/x", "vector": ok}, 400, "name"),
        ("POST", "/v1/steering/vectors", {"name": "", "vector": ok}, 400, "name"),
        ("POST", "/v1/steering/vectors", {"name": "bad"}, 400, "vector"),
        ("GET", "/v1/steering/vectors/no-such-vector", None, 404, "name"),
        ("DELETE", "/v1/steering/vectors/no-such-vector", None, 404, "name"),
        ("POST", "/v1/steering/modules/register", {"name": "m", "kind": "sae_delta"}, 400, "kind"),
        ("POST", "/v1/steering/modules/register", {"name": "m"}, 400, "vectors"),
        ("POST", "/v1/steering/modules/register", {"name": "a/b", "vectors": {"post_block": {"1": ok}}}, 400, "name"),
        ("POST", "/v1/steering/modules/register", {"name": "m", "vectors": {"post_block": {"1": ok}},
                                                    "clamps": {"post_block": {"1": [{"vector": ok}]}}}, 400, "clamps.post_block.1[0].min"),
        ("POST", "/v1/steering/modules/register", {"name": "m", "decode_clamps": {"post_block": {"1": [{"vector": ok, "value": 0}] * 5}}},
         400, "decode_clamps.post_block.1"),
        ("POST", "/v1/steering/modules/unregister", {"name": "no-such-module"}, 404, "name"),
    ]


RAW_BAD = [
    # (body bytes, content-type, status, field) for PUT /v1/steering/vectors/{name}, and raw JSON with NaN/inf
    ("garbage", 415, "body"),
    ("npy-wrong-dim", 400, "body"),
    ("npy-ints", 400, "body"),
    ("npy-2d", 400, "body"),
    ("st-two-tensors", 400, "body"),
    ("too-large", 413, "body"),
    ("npy-nan", 400, "body"),
]


def _raw_body(kind: str, h: int) -> bytes:
    from safetensors.numpy import save

    return {
        "garbage": b"this is not a vector file",
        "npy-wrong-dim": _npy(np.ones(h + 3, np.float32)),
        "npy-ints": _npy(np.ones(h, np.int64)),
        "npy-2d": _npy(np.ones((2, h), np.float32)),
        "st-two-tensors": save({"a": np.ones(h, np.float32), "b": np.ones(h, np.float32)}),
        "too-large": _npy(np.ones(300_000, np.float64)),
        "npy-nan": _npy(np.full(h, np.nan, np.float32)),
    }[kind]


def test_bad_inputs_name_the_field_and_leave_the_engine_untouched(http, engine, tasks, clean_steering):
    prompt = tasks["facts"][0]["prompt"]
    before = _generate(http, prompt)
    h = engine.info.hidden_size
    for method, path, body, status, field in _bad_cases(h, engine.info.num_layers):
        r = http.request(method, path, json=body)
        assert r.status_code == status, (path, body if body is None or len(json.dumps(body)) < 300 else field, r.text)
        err = r.json()
        assert err["field"] == field, (field, err)
        assert err["error"].startswith(field), err
    for kind, status, field in RAW_BAD:
        r = http.put("/v1/steering/vectors/raw-bad", content=_raw_body(kind, h), headers={"content-type": "application/octet-stream"})
        assert r.status_code == status, (kind, r.text)
        assert r.json()["field"] == field
    # JSON with NaN / Infinity literals (Python's json accepts them)
    nan_vec = "[" + ", ".join(["NaN"] + ["0.5"] * (h - 1)) + "]"
    for raw, field in [
        ('{"vectors": {"post_block": {"1": %s}}}' % nan_vec, "vectors.post_block.1"),
        ('{"vectors": {"post_block": {"1": {"vector": %s}}}}' % nan_vec.replace("NaN", "Infinity"), "vectors.post_block.1.vector"),
        ('{"name": "nan-vec", "vector": %s}' % nan_vec, "vector"),
    ]:
        path = "/v1/steering/vectors" if raw.startswith('{"name"') else "/v1/steering/set"
        r = http.post(path, content=raw.encode(), headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["field"] == field, r.text
        assert "NaN" in r.json()["error"]
    for method, path, body, status, field in _bad_cases(h, engine.info.num_layers):  # unsupported fork features say so
        if field in ("vectors.post_mlp", "clamps", "target", "kind"):
            assert "not supported" in http.request(method, path, json=body).json()["error"]
    # nothing was changed and the engine still serves, identically
    assert http.get("/v1/steering").json() == {"active_layers": {}, "steer": [], "clamp": []}
    assert "raw-bad" not in engine.list_vectors() and "nan-vec" not in engine.list_vectors()
    assert not any(n.startswith("module/") for n in engine.list_vectors())
    after = _generate(http, prompt)
    assert after["token_ids"] == before["token_ids"] and after["logprobs"] == before["logprobs"]
    assert http.get("/v1/status").json()["in_flight_requests"] == 0


# ---- /v1/status ---------------------------------------------------------------------------------------
def test_status_reports_store_checksum_steering_and_vectors(http, engine, tasks, clean_steering):
    prompt = tasks["facts"][5]["prompt"]
    st0 = http.get("/v1/status").json()
    assert st0["source_store"] == http.get("/v1/patch_source").json()
    check = st0["checksum"]
    assert check["consistent"] is True and check["ranks"] == len(check["workers"]) == 1
    worker = check["workers"][0]
    assert (worker["tp_rank"], worker["pp_rank"]) == (0, 0) and len(worker["action_checksum"]) == 16
    assert st0["named_vectors"] == len(engine.list_vectors()) and st0["global_steering"] == []
    assert st0["api_key_required"] is False
    http.post("/v1/steering/vectors", json={"name": "api-status", "vector": _vec(engine, 14, 1.0).tolist()})
    try:
        http.post("/v1/steering/set", json={"steer": [{"sites": ["L4.post_attn", "L0.pre_attn"], "name": "api-status"}]})
        _generate(http, prompt, interventions={"steer": [{"sites": "L1.post_block", "vector": _vec(engine, 15, 1.0).tolist()}]})
        st = http.get("/v1/status").json()
        assert st["global_steering"] == ["L0.pre_attn", "L4.post_attn"]
        assert st["named_vectors"] == st0["named_vectors"] + 1
        assert st["checksum"]["action_count"] > check["action_count"]
        assert st["checksum"]["workers"][0]["action_checksum"] != worker["action_checksum"]
        assert st["sweeps"] is None or isinstance(st["sweeps"], dict)
    finally:
        engine.clear_global_steer()
        http.delete("/v1/steering/vectors/api-status")


def test_status_reports_the_sweep_service(engine, tasks):
    from fastapi.testclient import TestClient

    from app.api.app import create_app

    pair = next(p for p in tasks["pairs"] if p["equal_length"])
    app = create_app(engine)
    with TestClient(app) as c:
        assert c.get("/v1/status").json()["sweeps"] == {"active": 0, "sweeps": [], "recent": 0}
        r = c.post("/v1/patch_sweep", json={"prompt": pair["corrupt_prompt"], "clean_prompt": pair["clean_prompt"],
                                            "answer_token_id": pair["answer_id"], "layers": [0]})
        assert r.status_code == 200
        assert c.get("/v1/status").json()["sweeps"] == {"active": 0, "sweeps": [], "recent": 1}
