"""The API key: mutating endpoints need `Authorization: Bearer <key>` when the server has one;
read-only endpoints stay open. Apps with a key are built on the shared engine
(`TestClient(create_app(engine, api_key=...))`); each test undoes what it changed."""

from __future__ import annotations

import numpy as np
import pytest
from fastapi import Depends, FastAPI
from fastapi.testclient import TestClient

from app.api.auth import API_KEY_ENV, require_api_key
from app.api.app import create_app
from app.api.deps import ApiSettings, get_settings
from app.api.errors import install_error_handlers

KEY = "s3cret-key"
GOOD = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture
def client(engine):
    with TestClient(create_app(engine, api_key=KEY)) as c:
        yield c
    engine.clear_global_steer()


def _mutations(engine, prompt: str) -> list[tuple[str, str, dict | None]]:
    """(method, path, json) of every mutating request, in an order that leaves nothing behind
    when all succeed."""
    v = [0.01] * engine.info.hidden_size
    return [
        ("POST", "/v1/steering/vectors", {"name": "auth-v", "vector": v}),
        ("PUT", "/v1/steering/vectors/auth-v2", None),
        ("POST", "/v1/steering/set", {"vectors": {"post_block": {"1": v}}}),
        ("POST", "/v1/steering/clear", None),
        ("DELETE", "/v1/steering/vectors/auth-v", None),
        ("DELETE", "/v1/steering/vectors/auth-v2", None),
        ("POST", "/v1/steering/modules/register", {"name": "auth-m", "vectors": {"post_block": {"1": v}}}),
        ("POST", "/v1/steering/modules/unregister", {"name": "auth-m"}),
        ("POST", "/v1/capture", {"prompt": prompt, "sites": ["L1.post_block"], "keep_as": "auth-run"}),
        ("DELETE", "/v1/patch_source/auth-run", None),
        ("POST", "/v1/generate", {"prompt": prompt, "max_tokens": 1,
                                  "interventions": {"capture": {"sites": ["L1.post_block"], "keep_as": "auth-run2"}}}),
        ("DELETE", "/v1/patch_source/auth-run2", None),
        ("POST", "/v1/completions", {"prompt": prompt, "max_tokens": 1,
                                     "capture": {"patch_source": {"run": "auth-run3", "hooks": {"post_block": [1]}}}}),
        ("DELETE", "/v1/patch_source/auth-run3", None),
    ]


def _send(c, engine, method, path, body, headers):
    if method == "PUT":
        import io

        buf = io.BytesIO()
        np.save(buf, np.full(engine.info.hidden_size, 0.02, np.float32))
        return c.put(path, content=buf.getvalue(), headers={**headers, "content-type": "application/octet-stream"})
    return c.request(method, path, json=body, headers=headers)


def test_mutations_need_the_key(client, engine, tasks):
    prompt = tasks["facts"][0]["prompt"]
    for method, path, body in _mutations(engine, prompt):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}):
            r = _send(client, engine, method, path, body, headers)
            assert r.status_code == 401, (method, path, headers, r.text)
            assert r.json()["field"] == "authorization" and r.json()["error"].startswith("authorization: ")
            assert r.headers["www-authenticate"] == "Bearer"
        r = _send(client, engine, method, path, body, GOOD)
        assert r.status_code == 200, (method, path, r.text)
    # every mutation above was undone by a later one
    assert engine.global_steer == [] and not {"auth-v", "auth-v2"} & set(engine.list_vectors())
    assert not any(n.startswith("module/auth-m") for n in engine.list_vectors())
    assert not any(engine.has_source(r) for r in ("auth-run", "auth-run2", "auth-run3"))


def test_refused_mutations_change_nothing(client, engine, tasks):
    before = client.get("/v1/steering").json()
    client.post("/v1/steering/set", json={"vectors": {"post_block": {"1": [0.5] * engine.info.hidden_size}}})
    client.post("/v1/steering/vectors", json={"name": "auth-nope", "vector": [0.5] * engine.info.hidden_size})
    client.post("/v1/capture", json={"prompt": tasks["facts"][0]["prompt"], "sites": ["L1.post_block"], "keep_as": "auth-nope"})
    assert client.get("/v1/steering").json() == before
    assert "auth-nope" not in engine.list_vectors() and not engine.has_source("auth-nope")


def test_reads_stay_open(client, engine, tasks):
    prompt = tasks["facts"][0]["prompt"]
    engine.register_vector("auth-read", np.ones(engine.info.hidden_size, np.float32))
    try:
        for path in ("/health", "/v1/status", "/v1/steering", "/v1/steering/layers", "/v1/steering/vectors",
                     "/v1/steering/vectors/auth-read", "/v1/steering/modules", "/v1/patch_source", "/openapi.json"):
            assert client.get(path).status_code == 200, path
        assert client.get("/v1/status").json()["api_key_required"] is True
        for path, body in [
            ("/v1/tokenize", {"prompt": prompt}),
            ("/v1/generate", {"prompt": prompt, "max_tokens": 1}),
            ("/v1/generate", {"prompt": prompt, "max_tokens": 1, "interventions": {"capture": {"sites": ["L1.post_block"]}}}),
            ("/v1/completions", {"prompt": prompt, "max_tokens": 1, "steering_vectors": {"post_block": {"1": [0.1] * engine.info.hidden_size}}}),
            ("/v1/capture", {"prompt": prompt, "sites": ["L1.post_block"]}),
        ]:
            assert client.post(path, json=body).status_code == 200, path
    finally:
        engine.delete_vector("auth-read")


def test_patch_sweep_requires_the_key(client):
    # the dependency runs before the body is validated: no key -> 401, the key -> the body's 400
    assert client.post("/v1/patch_sweep", json={}).status_code == 401
    r = client.post("/v1/patch_sweep", json={}, headers=GOOD)
    assert r.status_code == 400, r.text


def test_key_from_the_environment_and_explicit_override(engine, monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    with TestClient(create_app(engine)) as c:
        assert c.post("/v1/steering/clear").status_code == 401
        assert c.post("/v1/steering/clear", headers={"Authorization": "Bearer from-env"}).status_code == 200
    with TestClient(create_app(engine, api_key="")) as c:  # an explicit empty key: no key
        assert c.post("/v1/steering/clear").status_code == 200
        assert c.get("/v1/status").json()["api_key_required"] is False
    monkeypatch.delenv(API_KEY_ENV)
    with TestClient(create_app(engine)) as c:
        assert c.post("/v1/steering/clear").status_code == 200


def test_require_api_key_is_a_plain_dependency():
    # any app: the key comes from the settings dependency, the 401 from the error handlers
    app = FastAPI()
    install_error_handlers(app)
    app.dependency_overrides[get_settings] = lambda: ApiSettings(api_key="k")

    @app.post("/mutate", dependencies=[Depends(require_api_key)])
    async def mutate() -> dict:
        return {"ok": True}

    with TestClient(app) as c:
        assert c.post("/mutate").json() == {"error": "authorization: this endpoint changes server state and needs "
                                                     "'Authorization: Bearer <api key>'", "field": "authorization"}
        assert c.post("/mutate", headers={"Authorization": "bearer k"}).json() == {"ok": True}
