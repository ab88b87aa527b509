"""The OpenAPI document covers every route: summary/description, request schema where a body
exists, typed responses and documented error responses. It is built from an app whose engine
was never started (building the app and its schema needs no vLLM); the served schema of the
real server is compared with it."""

from __future__ import annotations

import json
import re
import sys

import pytest
from fastapi.routing import APIRoute

from app.api.app import create_app
from app.api.deps import engine_of
from engine_ext import EngineConfig
from tests.conftest import REPO, model_path

#: routes whose 200 body is a typed model (checked for a `$ref` schema)
TYPED = {
    ("POST", "/v1/steering/set"), ("POST", "/v1/steering/clear"), ("GET", "/v1/steering"), ("GET", "/v1/steering/layers"),
    ("POST", "/v1/steering/vectors"), ("PUT", "/v1/steering/vectors/{name}"), ("GET", "/v1/steering/vectors"),
    ("GET", "/v1/steering/vectors/{name}"), ("DELETE", "/v1/steering/vectors/{name}"),
    ("POST", "/v1/steering/modules/register"), ("POST", "/v1/steering/modules/unregister"), ("GET", "/v1/steering/modules"),
    ("POST", "/v1/capture"), ("GET", "/v1/patch_source"), ("DELETE", "/v1/patch_source/{run_id}"),
    ("POST", "/v1/generate"), ("GET", "/v1/status"), ("POST", "/v1/tokenize"), ("POST", "/v1/state_check"),
}


@pytest.fixture(scope="module")
def app_and_spec():
    app = create_app(config=EngineConfig(model=str(model_path()), device="cpu"))
    spec = app.openapi()
    assert engine_of(app).alive is False  # nothing was started (the lifespan never ran)
    return app, spec


def test_building_the_app_and_its_schema_imports_no_vllm():
    import subprocess

    code = ("import sys; from engine_ext import EngineConfig; from app.api.app import create_app; "
            f"create_app(config=EngineConfig(model={str(model_path())!r}, device='cpu')).openapi(); "
            "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def _operations(app):
    for route in app.routes:
        if isinstance(route, APIRoute) and route.include_in_schema:
            for method in route.methods - {"HEAD", "OPTIONS"}:
                yield route, method


def test_every_route_is_documented(app_and_spec):
    app, spec = app_and_spec
    seen = 0
    for route, method in _operations(app):
        op = spec["paths"].get(route.path_format, {}).get(method.lower())
        assert op is not None, f"{method} {route.path_format} missing from /openapi.json"
        assert op.get("summary") and op.get("description"), f"{method} {route.path_format}: no summary/description"
        assert any(code.startswith("4") for code in op["responses"]), f"{method} {route.path_format}: no 4xx response"
        for code, resp in op["responses"].items():
            if code.startswith(("4", "5")) and code != "422":
                schema = resp.get("content", {}).get("application/json", {}).get("schema", {})
                assert schema.get("$ref", "").endswith("/ErrorResponse"), f"{method} {route.path_format} {code}: not ErrorResponse"
        if route.body_field is not None:
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
            assert body, f"{method} {route.path_format}: body without a schema"
        seen += 1
    assert seen >= 24


def test_typed_request_and_response_models(app_and_spec):
    app, spec = app_and_spec
    for method, path in TYPED:
        op = spec["paths"][path][method.lower()]
        schema = op["responses"]["200"]["content"]["application/json"]["schema"]
        assert "$ref" in schema, f"{method} {path}: untyped 200 response"
    put = spec["paths"]["/v1/steering/vectors/{name}"]["put"]
    assert "application/octet-stream" in put["requestBody"]["content"]
    schemas = spec["components"]["schemas"]
    for model in ("SteeringSetRequest", "VectorRegisterRequest", "ModuleRegisterRequest", "CaptureRequest",
                  "InterventionsSpec", "SteerSpec", "PatchSpec", "ForkPatchEntry", "CompletionRequest", "GenerateRequest",
                  "SpanSpec", "EmbeddingNoiseSpec", "NoiseSpec", "PatchSweepRequest"):
        assert schemas[model].get("additionalProperties") is False, model
    # one span model, and no name pydantic had to qualify with its module (two models, one name)
    assert "SpanPosition" not in schemas and not [name for name in schemas if "__" in name]
    assert "interventions" in schemas["GenerateRequest"]["properties"]
    for field in ("steering_vectors", "patch", "patch_vectors", "logprob_token_ids", "steering_clamps", "interventions"):
        assert field in schemas["CompletionRequest"]["properties"], field
    assert "gates" in schemas["CompletionRequest"]["properties"]["steering"]["description"].lower()
    assert "clamp" in schemas["InterventionsSpec"]["properties"] and "ClampSpec" in schemas
    for field in ("source_store", "checksum", "global_steering", "named_vectors", "sweeps"):
        assert field in schemas["StatusResponse"]["properties"], field
    guarded = [("post", "/v1/steering/set"), ("delete", "/v1/patch_source/{run_id}"), ("post", "/v1/capture"),
               ("post", "/v1/state_check")]
    for method, path in guarded:
        assert "401" in spec["paths"][path][method]["responses"], path


def test_sweep_summary_status_and_events_are_documented(app_and_spec):
    _, spec = app_and_spec
    schemas = spec["components"]["schemas"]
    post = spec["paths"]["/v1/patch_sweep"]["post"]["responses"]["200"]["content"]
    assert post["application/json"]["schema"] == {"$ref": "#/components/schemas/SweepSummary"}
    summary = schemas["SweepSummary"]
    assert summary["additionalProperties"] is False
    for field in ("layers", "positions", "grid", "hook_grids", "argmax", "clean", "corrupt", "skipped", "alignment",
                  "noise_floor", "auto_captured", "captured_source_run", "within_noise", "checksum", "cells_done", "cancelled"):
        assert summary["properties"][field].get("description"), field
        assert field in summary["required"], field  # the server always sends it
    by_id = spec["paths"]["/v1/patch_sweep/{sweep_id}"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert {s["$ref"] for s in by_id["anyOf"]} == {"#/components/schemas/SweepSummary", "#/components/schemas/SweepStatus"}
    for path, method in (("/v1/patch_sweep", "post"), ("/v1/patch_sweep/{sweep_id}/events", "get")):
        content = spec["paths"][path][method]["responses"]["200"]["content"]
        events = content["text/event-stream"]["schema"]
        assert [v["properties"]["type"]["const"] for v in events["oneOf"]] == [
            "start", "warning", "skip", "checksum", "cell", "noise_floor", "progress", "error", "summary"]
        summary_event = events["oneOf"][-1]
        assert set(summary_event["properties"]) == {"type"} | set(summary["properties"])
    assert "application/json" not in spec["paths"]["/v1/patch_sweep/{sweep_id}/events"]["get"]["responses"]["200"].get("content", {})
    # every reference of the document resolves
    refs = set(re.findall(r'"\$ref": "#/components/schemas/([^"]+)"', json.dumps(spec)))
    assert refs <= set(schemas), refs - set(schemas)


def test_served_openapi_matches(http, app_and_spec):
    _, spec = app_and_spec
    served = http.get("/openapi.json").json()
    assert set(served["paths"]) == set(spec["paths"])
    assert served["components"]["schemas"] == spec["components"]["schemas"]
