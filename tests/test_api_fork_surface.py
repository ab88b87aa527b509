"""The reference fork's HTTP surface on the real engine (issue 16, app side): vLLM's root
`/tokenize` / `/detokenize`, `GET /v1/models`, `POST /v1/chat/completions`, the completion
request forms (token-id prompts, `cache_salt`, `conversation_id`, capture `ranges` and
`capture_results.payload`), the probe/steer vector registry, and the sweep's fork semantics
(one-element `hooks`, `source_module` naming a steering module, `source_inline`, extrapolating
`alpha`, `recovered` without a clean value, the served model's name)."""

from __future__ import annotations

import numpy as np

from app.fork.vectors import pack_vectors
from engine_ext.reference.hf import RefEdit

#: a minimal chat template (the bundled model has none)
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
LOGPROB_ATOL = 2e-3


def ok(r) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def refused(r, status: int, field: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["field"] == field and body["error"].startswith(field), body
    return body


# ---- tokenization and the model list ---------------------------------------------------------------
def test_root_tokenize_detokenize_and_models_in_vllms_shapes(http, engine):
    model = ok(http.get("/v1/models"))
    assert model["object"] == "list" and len(model["data"]) == 1
    card = model["data"][0]
    assert card["id"] == engine.info.model and card["object"] == "model" and card["max_model_len"] == engine.info.max_model_len
    # no host path in any answer (issue 18): `root` is the model's name, not its folder
    assert card["root"] == engine.info.model and engine.info.model_path not in http.get("/v1/models").text
    text = "The capital of Tarn is"
    tok = ok(http.post("/tokenize", json={"model": card["id"], "prompt": text}))
    assert tok == {"count": len(engine.tokenize(text)), "max_model_len": engine.info.max_model_len, "tokens": engine.tokenize(text)}
    bare = ok(http.post("/tokenize", json={"prompt": " Tarn", "add_special_tokens": False, "return_token_strs": True}))
    assert bare["tokens"] == engine.tokenize(" Tarn", add_special_tokens=False)
    assert bare["token_strs"] == engine.tokenizer.convert_ids_to_tokens(bare["tokens"])
    assert ok(http.post("/detokenize", json={"model": card["id"], "tokens": tok["tokens"]})) == {"prompt": text}
    refused(http.post("/tokenize", json={"model": "gpt-9", "prompt": text}), 404, "model")
    refused(http.post("/detokenize", json={"tokens": [1, 10**7]}), 400, "tokens[1]")
    refused(http.post("/tokenize", json={"prompt": text, "messages": []}), 400, "prompt")
    # chat messages need a template: the model has none, so the request must bring one
    msgs = [{"role": "user", "content": "Hello"}]
    refused(http.post("/tokenize", json={"messages": msgs}), 400, "chat_template")
    chat = ok(http.post("/tokenize", json={"messages": msgs, "chat_template": TEMPLATE}))
    rendered = engine.tokenizer.apply_chat_template(msgs, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == engine.tokenize(rendered, add_special_tokens=False)


# ---- chat completions -------------------------------------------------------------------------------
def test_chat_completions_render_then_complete_with_the_extra_fields(http, engine, tasks):
    f = tasks["facts"][3]
    msgs = [{"role": "user", "content": f["prompt"]}]
    refused(http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2}), 400, "chat_template")
    rendered = engine.tokenizer.apply_chat_template(msgs, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True)
    ids = engine.tokenize(rendered, add_special_tokens=False)
    steer = {"post_block": {"2": (np.ones(engine.info.hidden_size, np.float32) * 0.5).tolist()}}
    base = {"max_tokens": 3, "ignore_eos": True, "steering_vectors": steer}
    chat = ok(http.post("/v1/chat/completions", json={"messages": msgs, "chat_template": TEMPLATE, "logprobs": True,
                                                       "top_logprobs": 2, **base}))
    plain = ok(http.post("/v1/completions", json={"prompt": ids, "logprobs": 2, **base}))
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["role"] == "assistant"
    assert chat["choices"][0]["message"]["content"] == plain["choices"][0]["text"]
    content = chat["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in content] == plain["choices"][0]["logprobs"]["token_logprobs"]
    assert all(len(c["top_logprobs"]) == 2 for c in content)
    assert chat["intervention"]["status"] == "ok" and chat["usage"] == plain["usage"]
    # exact scoring: the fork's chat rule wants logprobs: true
    score = {"messages": msgs, "chat_template": TEMPLATE, "max_tokens": 1, "logprob_token_ids": [f["answer_id"]]}
    refused(http.post("/v1/chat/completions", json=score), 400, "logprob_token_ids")
    scored = ok(http.post("/v1/chat/completions", json={**score, "logprobs": True}))
    want = engine.score(ids, [f["answer_id"]])
    assert scored["choices"][0]["scores"] == [{str(f["answer_id"]): want[f["answer_id"]]}]
    # streaming: chat.completion.chunk deltas, the role first
    with http.stream("POST", "/v1/chat/completions", json={"messages": msgs, "chat_template": TEMPLATE, "stream": True, **base}) as r:
        import json as _json

        events = [_json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert {e["object"] for e in events} == {"chat.completion.chunk"}
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == plain["choices"][0]["text"]


# ---- completion request forms ----------------------------------------------------------------------
def test_completion_prompts_as_token_ids_salt_and_conversation_id(http, engine, tasks):
    a, b = tasks["facts"][4]["prompt"], tasks["facts"][5]["prompt"]
    req = {"max_tokens": 3, "ignore_eos": True, "logprobs": 0}
    by_text = ok(http.post("/v1/completions", json={"prompt": a, **req}))
    by_ids = ok(http.post("/v1/completions", json={"prompt": engine.tokenize(a), **req}))
    assert by_ids["choices"] == by_text["choices"]
    both = ok(http.post("/v1/completions", json={"prompt": [engine.tokenize(a), engine.tokenize(b)], **req}))
    second = ok(http.post("/v1/completions", json={"prompt": b, **req}))
    assert [c["index"] for c in both["choices"]] == [0, 1]
    assert both["choices"][0]["text"] == by_text["choices"][0]["text"] and both["choices"][1]["text"] == second["choices"][0]["text"]
    assert both["usage"]["prompt_tokens"] == len(engine.tokenize(a)) + len(engine.tokenize(b))
    texts = ok(http.post("/v1/completions", json={"prompt": [a, b], **req}))
    assert [c["text"] for c in texts["choices"]] == [c["text"] for c in both["choices"]]
    salted = ok(http.post("/v1/completions", json={"prompt": a, "cache_salt": "tenant-7", "conversation_id": "conv-1", **req}))
    assert salted["choices"] == by_text["choices"] and salted["conversation_id"] == "conv-1"
    refused(http.post("/v1/completions", json={"prompt": [], **req}), 400, "prompt")


def test_patch_source_capture_ranges_default_run_and_payload(http, engine, tasks):
    prompt = tasks["facts"][6]["prompt"]
    body = ok(http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "capture": {"patch_source": {
        "hooks": {"post_block": {"layers": [0], "ranges": [[2, 3]]}}, "positions": "all_prompt"}}}))
    res = body["capture_results"]["patch_source"]
    run = res["payload"]["run"]
    try:
        assert res["status"] == "ok" and run == body["id"]  # no run given: the completion's id (the fork's request id)
        assert res["payload"]["sites"] == ["L0.post_block", "L2.post_block", "L3.post_block"]
        stored = next(r for r in ok(http.get("/v1/patch_source"))["runs"] if r["run_id"] == run)
        assert stored["values"] == 3 * len(engine.tokenize(prompt))
    finally:
        assert http.delete(f"/v1/patch_source/{run}").status_code == 200


# ---- the probe/steer registry --------------------------------------------------------------------
def test_probe_and_steer_vector_registry(http, engine):
    h = engine.info.hidden_size
    rows = np.random.default_rng(3).normal(size=(2, h)).astype(np.float32)
    steer = {"post_block": pack_vectors(rows, [1, 2])}
    probe = {"pre_attn": pack_vectors(rows[:1], [0])}
    http.post("/v1/steering/vectors", json={"name": "fork-surface-named", "vector": rows[0].tolist()})
    try:
        r = ok(http.post("/v1/steering/vectors/register", json={"name": "honest", "kind": "steer", "packed": steer}))
        assert r == {"status": "ok", "name": "honest", "kind": "steer", "vectors": {"probe": [], "steer": ["honest"]}}
        ok(http.post("/v1/steering/vectors/register", json={"name": "lie", "kind": "probe", "packed": probe}))
        refused(http.post("/v1/steering/vectors/register", json={"name": "two", "kind": "probe", "packed": steer}), 400, "packed")
        refused(http.post("/v1/steering/vectors/register", json={"name": "x", "kind": "steer",
                                                                  "packed": {"post_block": pack_vectors(rows[:, :-1], [1, 2])}}),
                400, "packed.post_block.shape")
        listed = ok(http.get("/v1/steering/vectors"))
        assert listed["vectors"] == {"probe": ["lie"], "steer": ["honest"]} and listed["count"] == 2
        assert "fork-surface-named" in {v["name"] for v in listed["named"]} and listed["named_count"] == len(listed["named"])
        gone = http.post("/v1/steering/vectors/unregister", json={"name": "lie", "kind": "steer"})
        assert gone.status_code == 404 and gone.json()["vectors"] == {"probe": ["lie"], "steer": ["honest"]}
        ok(http.post("/v1/steering/vectors/unregister", json={"name": "lie", "kind": "probe"}))
    finally:
        http.post("/v1/steering/vectors/unregister", json={"name": "honest", "kind": "steer"})
        http.delete("/v1/steering/vectors/fork-surface-named")
    assert ok(http.get("/v1/steering/vectors"))["vectors"] == {"probe": [], "steer": []}


# ---- sweeps ----------------------------------------------------------------------------------------
def sweep(http, **body) -> dict:
    return ok(http.post("/v1/patch_sweep", json=body))


def test_sweep_single_hook_list_module_source_inline_and_alpha(http, engine, hf_ref, tasks):
    f = tasks["facts"][7]
    ids = engine.tokenize(f["prompt"])
    last = len(ids) - 1
    base = {"prompt": f["prompt"], "answer_token_id": f["answer_id"], "positions": [1, last], "model": engine.info.model}
    # hooks with one element: hook_grids is filled (the fork's client then returns a dict per hook)
    one = sweep(http, **base, source_module="zeros", layers=[1], hooks=["post_attn"])
    plain = sweep(http, **base, source_module="zeros", layers=[1], hook="post_attn")
    assert one["hook_grids"] == [{"hook": "post_attn", "grid": one["grid"], "argmax": one["argmax"]}] and plain["hook_grids"] is None
    assert np.allclose(np.array(one["grid"], float), np.array(plain["grid"], float), atol=LOGPROB_ATOL)
    # a steering module: each cell patched with the module's vector at its own (hook, layer)
    rng = np.random.default_rng(11)
    vecs = {(layer, hook): rng.normal(size=engine.info.hidden_size).astype(np.float32) * 3
            for layer in (2, 4) for hook in ("pre_attn", "post_block")}
    tiers: dict = {}
    for (layer, hook), v in vecs.items():
        tiers.setdefault(hook, {})[str(layer)] = v.tolist()
    ok(http.post("/v1/steering/modules/register", json={"name": "fork-sweep-mod", "vectors": tiers}))
    try:
        res = sweep(http, **base, source_module="fork-sweep-mod", layers=[2, 4], hooks=["post_block", "pre_attn"])
        assert res["source"] == {"kind": "module", "name": "fork-sweep-mod"} and res["hook"] == "post_block"
        for g in res["hook_grids"]:
            for i, layer in enumerate((2, 4)):
                for j, pos in enumerate((1, last)):
                    want = hf_ref.score(ids, [f["answer_id"]], edits=[RefEdit.patch((layer, g["hook"]), [pos], vecs[(layer, g["hook"])])])
                    assert abs(g["grid"][i][j] - want[f["answer_id"]]) <= LOGPROB_ATOL, (g["hook"], layer, pos)
        # a swept site the module lacks: refused up front (the fork would run that cell unpatched)
        refused(http.post("/v1/patch_sweep", json={**base, "source_module": "fork-sweep-mod", "layers": [3]}), 400, "source_module")
    finally:
        http.post("/v1/steering/modules/unregister", json={"name": "fork-sweep-mod"})
    # source_inline: a row of patch_vectors, with an extrapolating alpha
    v = vecs[(2, "pre_attn")]
    table = pack_vectors(np.stack([np.zeros_like(v), v]))
    res = sweep(http, **base, source_inline=1, patch_vectors=table, layers=[3], alpha=1.5)
    assert res["source"]["kind"] == "inline" and res["alpha"] == 1.5
    for j, pos in enumerate((1, last)):
        want = hf_ref.score(ids, [f["answer_id"]], edits=[RefEdit.patch((3, "post_block"), [pos], v, alpha=1.5)])
        assert abs(res["grid"][0][j] - want[f["answer_id"]]) <= LOGPROB_ATOL, pos
    neg = sweep(http, **base, source_module="zeros", layers=[3], alpha=-0.5)
    want = hf_ref.score(ids, [f["answer_id"]], edits=[RefEdit.zero((3, "post_block"), [last], alpha=-0.5)])
    assert abs(neg["grid"][0][1] - want[f["answer_id"]]) <= LOGPROB_ATOL
    refused(http.post("/v1/patch_sweep", json={**base, "source_inline": 2, "patch_vectors": table, "layers": [0]}), 400, "source_inline")
    refused(http.post("/v1/patch_sweep", json={**base, "source_inline": 0, "layers": [0]}), 400, "patch_vectors")
    refused(http.post("/v1/patch_sweep", json={**base, "source_inline": 0, "patch_vectors": table, "layers": [0],
                                               "metric": "recovered"}), 400, "clean_baseline")


def test_recovered_on_a_stored_run_without_a_clean_value_is_the_raw_grid(http, engine, tasks):
    pair = [p for p in tasks["pairs"] if p["equal_length"]][2]
    engine.capture(pair["clean_prompt"], ["L1.post_block", "L3.post_block"], "all_prompt", keep_as="fork-raw-recovered")
    try:
        body = {"prompt": pair["corrupt_prompt"], "source_run": "fork-raw-recovered", "answer_token_id": pair["answer_id"],
                "layers": [1, 3], "positions": [0, 1]}
        raw = sweep(http, **body, metric="recovered")
        logprob = sweep(http, **body, metric="logprob")
        # the fork returns the raw grid; causalboard labels it with its real unit and says why
        assert raw["metric_requested"] == "recovered" and raw["metric"] == "logprob" and raw["clean"] is None
        assert any("clean baseline" in n for n in raw["notes"])
        floor = max(raw["noise_floor"] or 0, logprob["noise_floor"] or 0)
        assert np.nanmax(np.abs(np.array(raw["grid"], float) - np.array(logprob["grid"], float))) <= floor + 1e-5
    finally:
        engine.drop_source("fork-raw-recovered")


# ---- the filesystem capture consumer ---------------------------------------------------------------
def test_filesystem_capture_consumer_writes_the_forks_layouts(engine, tasks, tmp_path, http):
    """A second app on the shared engine, started with a capture directory (the session server has
    none: there the consumer is a 400 naming it)."""
    import json

    from fastapi.testclient import TestClient

    from app.api.app import create_app

    prompt = tasks["facts"][8]["prompt"]
    n = len(engine.tokenize(prompt))
    spec = {"request_id": "req/1", "tag": "study", "hooks": {"post_block": [1, 3], "pre_attn": {"ranges": [[0, 0]]}},
            "positions": "all_prompt"}
    refused(http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "capture": {"filesystem": spec}}),
            400, "capture.filesystem")
    want = engine.capture(prompt, ["L1.post_block", "L3.post_block", "L0.pre_attn"], "all_prompt").captures
    with TestClient(create_app(engine, capture_dir=str(tmp_path))) as client:
        for layout in ("per_file", "packed"):
            body = ok(client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1,
                                                           "capture": {"filesystem": {**spec, "layout": layout, "tag": layout}}}))
            res = body["capture_results"]["filesystem"]
            assert res["status"] == "ok" and res["error"] is None
            folder = tmp_path / layout / "req_1"  # the fork's slug: '/' -> '_'
            assert sorted(res["payload"]["paths"]) == sorted(str(p) for p in folder.iterdir())
            if layout == "per_file":
                for layer, hook in ((1, "post_block"), (3, "post_block"), (0, "pre_attn")):
                    side = json.loads((folder / f"{layer}_{hook}.json").read_text())
                    assert side["shape"] == [n, engine.info.hidden_size] and side["dtype"] == "float32"
                    rows = np.frombuffer((folder / f"{layer}_{hook}.bin").read_bytes(), "<f4").reshape(side["shape"])
                    np.testing.assert_array_equal(rows, np.stack([want[(layer, hook, p)] for p in range(n)]))
            else:
                index = json.loads((folder / "packed.json").read_text())
                assert index["layout"] == "packed" and len(index["entries"]) == 3
        # with patch_source in the same request: one capture, both consumers answered
        both = ok(client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "capture": {
            "filesystem": {**spec, "tag": "both"}, "patch_source": {"run": "fs-both", "hooks": {"post_block": [2]}}}}))
        assert {k: v["status"] for k, v in both["capture_results"].items()} == {"filesystem": "ok", "patch_source": "ok"}
        assert client.delete("/v1/patch_source/fs-both").status_code == 200
        refused(client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "capture": {
            "filesystem": {**spec, "request_id": "../x"}}}), 400, "capture.filesystem.request_id")
        refused(client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "capture": {
            "filesystem": {**spec, "layout": "striped"}}}), 400, "capture.filesystem.layout")
        refused(client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "capture": {
            "filesystem": {**spec, "positions": "last_prompt"}, "patch_source": {"hooks": {"post_block": [2]}}}}),
                400, "capture.filesystem.positions")


# ---- dimension masks ---------------------------------------------------------------------------
def test_masked_patches_and_sweeps_in_the_forks_forms(http, engine, hf_ref, tasks):
    f = tasks["facts"][9]
    ids = engine.tokenize(f["prompt"])
    last = len(ids) - 1
    h = engine.info.hidden_size
    dims = [0, 5, 17]
    m = np.zeros(h, np.float32)
    m[dims] = 1.0
    res = sweep(http, prompt=f["prompt"], answer_token_id=f["answer_id"], source_module="zeros", layers=[1, 3],
                positions=[last], mask={"indices": dims})
    for i, layer in enumerate((1, 3)):
        want = hf_ref.score(ids, [f["answer_id"]], edits=[RefEdit.zero((layer, "post_block"), [last], mask=m)])
        assert abs(res["grid"][i][0] - want[f["answer_id"]]) <= LOGPROB_ATOL, layer
    # a graded inline mask row with an inline source, on /v1/completions
    rng = np.random.default_rng(5)
    v, w = rng.normal(size=h).astype(np.float32) * 4, rng.uniform(size=h).astype(np.float32)
    body = ok(http.post("/v1/completions", json={
        "prompt": f["prompt"], "max_tokens": 1, "logprobs": 1, "logprob_token_ids": [f["answer_id"]],
        "patch_vectors": pack_vectors(np.stack([v, w])),
        "patch": [{"layer": 2, "hook": "post_attn", "dest_position": last, "source_inline": 0, "mask": {"inline": 1}}]}))
    want = hf_ref.score(ids, [f["answer_id"]], edits=[RefEdit.patch((2, "post_attn"), [last], v, mask=w)])
    assert abs(body["choices"][0]["scores"][0][str(f["answer_id"])] - want[f["answer_id"]]) <= LOGPROB_ATOL
    refused(http.post("/v1/patch_sweep", json={"prompt": f["prompt"], "answer_token_id": f["answer_id"], "source_module": "zeros",
                                               "layers": [1], "mask": {"indices": [h]}}), 400, "mask.indices[0]")


# ---- conversation_id reaches the global dynamic-steering policies ------------------------------
def test_conversation_id_groups_requests_for_global_latching_policies(http, engine, tasks):
    h = engine.info.hidden_size
    prompt = tasks["facts"][10]["prompt"]
    ok(http.post("/v1/steering/probes", json={"name": "fork-conv-probe", "site": "L2.post_block", "direction": [1.0] * h}))
    # engages at the first decision of every request and latches for the conversation
    ok(http.put("/v1/steering/dynamic/policies", json={"policies": [{
        "probe": "fork-conv-probe", "sites": ["L3.post_block"], "vector": [0.01] * h, "on": -1e30, "latch": "conversation"}]}))

    def latched() -> int:
        return sum(w["latched_conversations"] for w in ok(http.get("/v1/steering/dynamic"))["workers"])

    try:
        before = latched()
        ok(http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}))
        assert latched() == before  # no conversation: nothing to remember
        body = ok(http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "conversation_id": "fork-conv-1"}))
        assert body["conversation_id"] == "fork-conv-1" and latched() == before + 1
        refused(http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "conversation_id": "bad id!"}),
                400, "conversation_id")
    finally:
        http.put("/v1/steering/dynamic/policies", json={"policies": []})
        http.delete("/v1/steering/probes/fork-conv-probe")
