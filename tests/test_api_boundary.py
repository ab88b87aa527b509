"""The HTTP boundary without a model: the one field-path format of error bodies, and an app
whose engine never started (its lifespan never ran): routes that need the engine answer 503,
while authentication, the body limit, request validation of the sweep body and the OpenAPI page
work as on a running server."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from app.api.app import create_app
from app.api.deps import engine_of
from app.api.errors import field_path
from engine_ext import EngineConfig
from tests.conftest import model_path

KEY = "boundary-key"


@pytest.mark.parametrize("loc, path", [
    (("body", "interventions", "steer", 0, "scale"), "interventions.steer[0].scale"),
    (("body", "layers", 1), "layers[1]"),
    (("body", "patch", 0, "source", "run"), "patch[0].source.run"),
    (("body",), "body"),
    (("query", "limit"), "limit"),
    # pydantic names the union branch an error came from; the path leaves it out
    (("body", "positions", "list[union[int,SpanSpec]]", 1, "SpanSpec", "span"), "positions[1].span"),
    (("body", "interventions", "capture", "sites", "str"), "interventions.capture.sites"),
    (("body", "layers", "LayerRange", "stop"), "layers.stop"),
    (("body", "positions", "literal['all_prompt']"), "positions"),
])
def test_field_path(loc, path):
    assert field_path(loc) == path


@pytest.fixture(scope="module")
def client():
    app = create_app(config=EngineConfig(model=str(model_path()), device="cpu"), api_key=KEY)
    yield TestClient(app)  # not entered: the lifespan (which would start the engine) never runs
    assert engine_of(app).alive is False


def test_routes_that_need_the_engine_answer_503(client):
    for method, path, body in [
        ("GET", "/health", None),
        ("GET", "/v1/status", None),
        ("POST", "/v1/tokenize", {"prompt": "The"}),
        ("POST", "/v1/generate", {"prompt": "The", "max_tokens": 1}),
        ("POST", "/v1/completions", {"prompt": "The", "max_tokens": 1}),
        ("POST", "/v1/capture", {"prompt": "The", "sites": "L1.post_block"}),
        ("GET", "/v1/steering", None),
        ("GET", "/v1/patch_source", None),
    ]:
        r = client.request(method, path, json=body)
        assert r.status_code == 503, (path, r.text)
        err = r.json()
        assert err["field"] == "engine" and ("not running" in err["error"] or "not started" in err["error"]), err


def test_auth_and_the_body_limit_come_before_the_engine(client):
    r = client.post("/v1/steering/set", json={"vectors": {"post_block": {"1": [0.1]}}})
    assert r.status_code == 401 and r.json()["field"] == "authorization"
    r = client.post("/v1/steering/set", json={"vectors": {}}, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 503
    r = client.post("/v1/generate", content=b"x" * (9 * 1024 * 1024), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["field"] == "body"
    assert client.get("/openapi.json").status_code == 200


@pytest.mark.parametrize("patch, field", [
    ({"hooks": ["post_block", 5]}, "hooks[1]"),
    ({"positions": [1, {"span": 5}]}, "positions[1].span"),
    ({"positions": [1, {"span": "x", "nth": 2}]}, "positions[1].nth"),
    ({"layers": {"start": 0}}, "layers.stop"),
    ({"layers": [0, "two"]}, "layers[1]"),
    ({"noise": {"span": "x", "samples": 0}}, "noise.samples"),
])
def test_sweep_body_errors_use_the_same_field_paths(client, patch, field):
    """The sweep plan names `hooks[1]`, `layers[1]`, `layers.stop`, `positions[0].span` for bad
    values; pydantic names bad types in the same format (checked before any engine is needed)."""
    body = {"prompt": "The capital of", "clean_prompt": "The capital of", "answer_token_id": 1, **patch}
    r = client.post("/v1/patch_sweep", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400, r.text
    assert r.json()["field"] == field and r.json()["error"].startswith(f"{field}: "), r.json()
