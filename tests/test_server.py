"""The HTTP API on a real uvicorn server over the shared engine."""

from __future__ import annotations

import pytest

from tests.sse import sse_data


def test_health_and_status(http, engine):
    assert http.get("/health").json() == {"status": "ok"}
    st = http.get("/v1/status").json()
    assert st["status"] == "ok"
    assert st["model"] == "causalboard-tiny"
    assert st["num_layers"] == engine.info.num_layers
    assert st["hooks"] == ["pre_attn", "post_attn", "mlp_in", "mlp_out", "post_block"]
    assert st["versions"]["vllm"].startswith("0.25.1")
    assert st["device"] == "cpu"


def test_generate_matches_engine(http, engine, tasks):
    prompt = tasks["facts"][0]["prompt"]
    body = http.post("/v1/generate", json={"prompt": prompt, "max_tokens": 4, "logprobs": 2}).json()
    direct = engine.generate(prompt, __import__("engine_ext").GenerationParams(max_tokens=4, logprobs=0))
    assert body["token_ids"] == direct.token_ids
    assert body["prompt_token_ids"] == engine.tokenize(prompt)
    n = len(body["token_ids"])
    assert 1 <= n <= 4 and len(body["logprobs"]) == n and len(body["top_logprobs"]) == n
    assert all(len(t) == 2 for t in body["top_logprobs"])


def test_generate_stream_sse(http, tasks):
    prompt = tasks["ioi"][0]["prompt"]
    with http.stream("POST", "/v1/generate", json={"prompt": prompt, "max_tokens": 3, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_data(r.read().decode())
    assert events[0]["type"] == "start"
    assert [e["type"] for e in events[1:-2]] == ["token"] * (len(events) - 3)
    done = events[-2]
    assert done["type"] == "done" and events[-1] == "[DONE]"
    assert sum((e["token_ids"] for e in events[1:-2]), []) == done["token_ids"]
    plain = http.post("/v1/generate", json={"prompt": prompt, "max_tokens": 3}).json()
    assert plain["token_ids"] == done["token_ids"]
    assert plain["logprobs"] == [] and done["logprobs"] == []  # not requested: not computed
    with_lp = http.post("/v1/generate", json={"prompt": prompt, "max_tokens": 3, "logprobs": 0}).json()
    assert with_lp["token_ids"] == plain["token_ids"] and len(with_lp["logprobs"]) == len(plain["token_ids"])
    assert with_lp["top_logprobs"] == []


def test_openai_completions(http, tasks):
    item = tasks["facts"][0]
    body = http.post("/v1/completions", json={"model": "causalboard-tiny", "prompt": item["prompt"], "max_tokens": 1, "logprobs": 1}).json()
    assert body["object"] == "text_completion"
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["token_logprobs"]) == 1
    assert body["usage"]["completion_tokens"] == 1
    with http.stream("POST", "/v1/completions", json={"prompt": item["prompt"], "max_tokens": 2, "stream": True}) as r:
        events = sse_data(r.read().decode())
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"


def test_tokenize(http, engine, tasks):
    prompt = tasks["facts"][0]["prompt"]
    body = http.post("/v1/tokenize", json={"prompt": prompt}).json()
    assert body["tokens"] == engine.tokenize(prompt)
    assert body["count"] == len(body["token_strings"]) == len(body["tokens"])


BAD_REQUESTS = [
    ("/v1/generate", {"prompt": "", "max_tokens": 2}, "prompt"),
    ("/v1/generate", {"prompt": "   ", "max_tokens": 2}, "prompt"),
    ("/v1/generate", {"prompt": "The", "max_tokens": 0}, "max_tokens"),
    ("/v1/generate", {"prompt": "The", "max_tokens": -5}, "max_tokens"),
    ("/v1/generate", {"prompt": "The", "max_tokens": 2, "temprature": 0.5}, "temprature"),
    ("/v1/generate", {"max_tokens": 2}, "prompt"),
    ("/v1/generate", {"prompt": "The", "logprobs": 50}, "logprobs"),
    ("/v1/generate", {"prompt": "The", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "The", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "The", "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": "The", "n": 2}, "n"),
    ("/v1/tokenize", {"text": "The"}, "text"),
]


@pytest.mark.parametrize("path, body, field", BAD_REQUESTS)
def test_bad_requests_name_the_field(http, path, body, field):
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()
    assert field in [e["field"] for e in err.get("errors", [])] or err["field"] == field
    assert field in err["error"] or any(field == e["field"] for e in err["errors"])


def test_prompt_longer_than_context(http, engine):
    n = engine.info.max_model_len
    word = engine.token_strings([engine.tokenize("The capital")[-1]])[0].strip()
    long_prompt = " ".join([word] * (n + 5))
    r = http.post("/v1/generate", json={"prompt": long_prompt, "max_tokens": 1})
    assert r.status_code == 400
    assert r.json()["field"] == "prompt" and "context" in r.json()["error"]
    fits = " ".join([word] * (n - 4))
    r = http.post("/v1/generate", json={"prompt": fits, "max_tokens": 50})
    assert r.status_code == 400 and r.json()["field"] == "max_tokens"
    r = http.post("/v1/generate", json={"prompt": long_prompt, "max_tokens": 1, "stream": True})
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")


def test_malformed_json_and_wrong_model(http):
    r = http.post("/v1/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["field"] == "body"
    r = http.post("/v1/completions", json={"model": "gpt-4", "prompt": "The"})
    assert r.status_code == 404 and r.json()["field"] == "model"


def test_oversized_body_is_refused(http):
    r = http.post("/v1/generate", content=b"x" * (9 * 1024 * 1024), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["field"] == "body"


def test_engine_keeps_serving_after_bad_requests(http, tasks):
    for path, body, _ in BAD_REQUESTS:
        http.post(path, json=body)
    r = http.post("/v1/generate", json={"prompt": tasks["facts"][0]["prompt"], "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["token_ids"]) == 1
    assert http.get("/health").status_code == 200
    assert http.get("/v1/status").json()["in_flight_requests"] == 0


def test_openapi_documents_every_route(http):
    spec = http.get("/openapi.json").json()
    for path in ("/health", "/v1/status", "/v1/generate", "/v1/completions", "/v1/tokenize"):
        assert path in spec["paths"]
    gen = spec["components"]["schemas"]["GenerateRequest"]
    assert gen["additionalProperties"] is False
    assert "description" in gen["properties"]["max_tokens"]
