"""The Python client (sync and async) against the real server on the shared engine."""

from __future__ import annotations

import asyncio
import math

import httpx
import numpy as np
import pytest

from app.client import AsyncCausalboardClient, CausalboardClient, CausalboardError
from app.sweep.fold import result_from_events
from app.sweep.result import SweepResult
from engine_ext import GenerationParams


@pytest.fixture
def cb(server_url):
    with CausalboardClient(server_url, timeout=300) as client:
        yield client


def test_status_health_tokenize(cb, engine, tasks):
    assert cb.health() is True
    st = cb.status()
    assert st["model"] == "causalboard-tiny" and st["num_layers"] == engine.info.num_layers
    prompt = tasks["facts"][0]["prompt"]
    tok = cb.tokenize(prompt)
    assert tok["tokens"] == engine.tokenize(prompt) and tok["count"] == len(tok["token_strings"])
    assert CausalboardClient("http://127.0.0.1:9").health() is False  # nothing listens there


def test_generate_and_stream_generate_match_the_engine(cb, engine, tasks):
    prompt = tasks["facts"][0]["prompt"]
    direct = engine.generate(prompt, GenerationParams(max_tokens=3, logprobs=0))
    body = cb.generate(prompt, max_tokens=3, logprobs=2)
    assert body["token_ids"] == direct.token_ids and len(body["top_logprobs"]) == len(body["token_ids"])
    events = list(cb.stream_generate(prompt, max_tokens=3))
    assert events[0]["type"] == "start" and events[-1]["type"] == "done"
    assert sum((e["token_ids"] for e in events if e["type"] == "token"), []) == direct.token_ids


def test_bad_request_raises_with_the_field(cb):
    with pytest.raises(CausalboardError) as info:
        cb.generate("The", max_tokens=0)
    assert info.value.status == 400 and info.value.field == "max_tokens"
    with pytest.raises(CausalboardError) as info:
        list(cb.stream_generate("The", max_tokens=2, temprature=0.5))  # a typo is refused before the stream
    assert info.value.status == 400 and info.value.field == "temprature"


def test_async_client_basics(server_url, engine, tasks):
    prompt = tasks["facts"][1]["prompt"]

    async def main():
        async with AsyncCausalboardClient(server_url, timeout=300) as acb:
            st, tok, gen = await asyncio.gather(acb.status(), acb.tokenize(prompt), acb.generate(prompt, max_tokens=2))
            events = [ev async for ev in acb.stream_generate(prompt, max_tokens=2)]
            healthy = await acb.health()
            return st, tok, gen, events, healthy

    st, tok, gen, events, healthy = asyncio.run(main())
    assert healthy and st["status"] == "ok"
    assert tok["tokens"] == engine.tokenize(prompt)
    assert gen["token_ids"] == engine.generate(prompt, GenerationParams(max_tokens=2, logprobs=0)).token_ids
    assert events[-1]["type"] == "done" and events[-1]["token_ids"] == gen["token_ids"]


# ---- sweeps ---------------------------------------------------------------------------------------
def _sweep_fields(tasks) -> dict:
    pair = next(p for p in tasks["pairs"] if p["equal_length"])
    return {"prompt": pair["corrupt_prompt"], "clean_prompt": pair["clean_prompt"], "answer_token_id": pair["answer_id"],
            "foil_token_id": pair["foil_id"], "metric": "recovered", "layers": {"start": 0, "stop": 6, "step": 2},
            "subject": {"span": pair["subject_corrupt"]}}


def _assert_same_grid(a: SweepResult, b: SweepResult) -> None:
    assert (a.layers, a.positions, a.hooks, a.metric) == (b.layers, b.positions, b.hooks, b.metric)
    # cells run in differently composed batches: equal up to the engine's batch noise
    np.testing.assert_allclose(a.to_numpy(), b.to_numpy(), atol=2e-3, rtol=0)


def test_sweep_sync_and_async_streaming_and_not_agree(cb, server_url, tasks, engine):
    fields = _sweep_fields(tasks)
    pair = next(p for p in tasks["pairs"] if p["equal_length"])
    plain = cb.patch_sweep(**fields)
    events: list[dict] = []
    streamed = cb.patch_sweep(on_event=events.append, **fields)

    async def run_async():
        async with AsyncCausalboardClient(server_url, timeout=300) as acb:
            a_plain = await acb.patch_sweep(**fields)
            a_events = [ev async for ev in acb.stream_sweep(**fields)]
            return a_plain, a_events

    a_plain, a_events = asyncio.run(run_async())
    a_streamed = result_from_events(a_events)

    n_tokens = len(engine.tokenize(pair["corrupt_prompt"]))
    assert plain.layers == [0, 2, 4] and plain.positions == list(range(n_tokens)) and plain.metric == "recovered"
    for other in (streamed, a_plain, a_streamed):
        _assert_same_grid(plain, other)
    # the stream: start first, summary last, one cell event per cell, all sweeps distinct
    types = [e["type"] for e in events]
    assert types[0] == "start" and types[-1] == "summary" and "progress" in types
    cells = [e for e in events if e["type"] == "cell"]
    assert len(cells) == len(plain.layers) * len(plain.positions) == events[0]["cells_total"]
    folded = result_from_events(events[:-1])  # the cells, without the summary
    np.testing.assert_array_equal(folded.to_numpy(), streamed.to_numpy())  # events and summary agree exactly
    assert len({plain.meta["sweep_id"], streamed.meta["sweep_id"], a_plain.meta["sweep_id"]}) == 3
    assert not any(r.meta.get("cancelled") for r in (plain, streamed, a_plain, a_streamed))

    # causal tracing finds the subject: at the first layer, patching the subject token recovers
    # more than patching any other position
    grid = plain.to_numpy()
    subject = pair["subject_span_corrupt"][0]
    first = grid[0]
    assert np.nanargmax(first) == plain.positions.index(subject)
    assert first[plain.positions.index(subject)] > 0.5
    assert plain.token_strings[subject].strip() == pair["subject_corrupt"]


def test_sweep_result_top_numpy_and_round_trip(cb, tasks, tmp_path):
    res = cb.patch_sweep(**_sweep_fields(tasks))
    grid = res.to_numpy()
    grid[0, 0] = 123.0  # to_numpy returns a copy
    assert res.to_numpy()[0, 0] != 123.0
    top = res.top(3)
    assert len(top) == 3 and top[0]["value"] == pytest.approx(float(np.nanmax(res.to_numpy())))
    assert [t["value"] for t in top] == sorted((t["value"] for t in top), reverse=True)
    assert top[0]["token"] == res.token_strings[res.positions.index(top[0]["position"])]
    for suffix in (".json", ".npz"):
        back = SweepResult.load(res.save(tmp_path / f"r{suffix}"))
        np.testing.assert_array_equal(back.to_numpy(), res.to_numpy())
        assert (back.layers, back.positions, back.hooks, back.metric) == (res.layers, res.positions, res.hooks, res.metric)
        assert back.meta["token_strings"] == res.meta["token_strings"] and back.noise_floor == res.noise_floor


def _top_field(field: str | None) -> str | None:
    """`layers[1]` / `noise.span` -> `layers` / `noise`."""
    return None if field is None else field.split("[")[0].split(".")[0]


def test_sweep_errors_name_the_field(cb, tasks):
    fields = _sweep_fields(tasks)
    for bad, field in (({"layers": [0, 99]}, "layers"), ({"answer_token": " no such words"}, "answer_token"),
                       ({"hook": "attn_out"}, "hook")):
        body = {k: v for k, v in fields.items() if not (k == "answer_token_id" and "answer_token" in bad)}
        with pytest.raises(CausalboardError) as info:
            cb.patch_sweep(**{**body, **bad})
        assert info.value.status == 400 and _top_field(info.value.field) == field, info.value.body
        with pytest.raises(CausalboardError) as info:
            list(cb.stream_sweep(**{**body, **bad}))
        assert info.value.status == 400 and _top_field(info.value.field) == field


def test_sweep_replay_and_summary_by_id(cb, tasks):
    events = list(cb.stream_sweep(**_sweep_fields(tasks)))
    sweep_id = events[0]["sweep_id"]
    replay = list(cb.sweep_events(sweep_id))
    assert replay == events
    tail = list(cb.sweep_events(sweep_id, last_event_id=3))
    assert tail == events[4:]
    summary = cb.get_sweep(sweep_id)
    np.testing.assert_array_equal(summary.to_numpy(), SweepResult.from_summary(events[-1]).to_numpy())
    with pytest.raises(CausalboardError) as info:
        cb.get_sweep("no-such-sweep")
    assert info.value.status == 404 and info.value.field == "sweep_id"
    assert not math.isnan(summary.to_numpy()[0, 0])


# ---- capture, sources, vectors, steering --------------------------------------------------------
def test_capture_returns_engine_arrays_and_keep_as_drop_source(cb, engine, tasks):
    prompt = tasks["facts"][2]["prompt"]
    sites = ["L1.post_attn", "L4.post_block"]
    cap = cb.capture(prompt, sites, "all_prompt", keep_as="client-test-run")
    ids = engine.tokenize(prompt)
    assert sorted(cap) == sorted(sites)
    assert cap.positions == list(range(len(ids))) and cap.prompt_token_ids == ids
    assert cap.token_strings == engine.token_strings(ids) and cap.stored_as == "client-test-run"
    direct = engine.capture(prompt, sites, "all_prompt")
    for site in sites:
        layer, hook = int(site[1]), site.split(".")[1]
        assert cap[site].dtype == np.float32 and cap[site].shape == (len(ids), engine.info.hidden_size)
        np.testing.assert_array_equal(cap[site], np.stack([direct.captures[(layer, hook, p)] for p in range(len(ids))]))
    last = cb.capture(prompt, ["L4.post_block"])  # default: the last prompt position
    assert last.positions == [len(ids) - 1] and last.stored_as is None
    np.testing.assert_array_equal(last["L4.post_block"][0], cap["L4.post_block"][-1])
    assert engine.has_source("client-test-run")
    assert cb.drop_source("client-test-run") is True
    assert cb.drop_source("client-test-run") is False
    with pytest.raises(CausalboardError) as info:
        cb.capture(prompt, ["L99.post_block"])
    assert info.value.status == 400 and info.value.field is not None and info.value.field.startswith("sites")


def test_vectors_and_steering_round_trip(cb, engine, tasks):
    prompt = tasks["facts"][0]["prompt"]
    hidden = engine.info.hidden_size
    vec = np.random.default_rng(7).standard_normal(hidden).astype(np.float32)
    name = "client-tests.direction"
    steer = [{"sites": ["L2.post_block"], "name": name, "scale": 6.0}]
    try:
        info = cb.register_vector(name, vec)
        assert info["dim"] == hidden and info["norm"] == pytest.approx(float(np.linalg.norm(vec)), rel=1e-5)
        assert name in [v["name"] for v in cb.list_vectors()["named"]]
        np.testing.assert_array_equal(np.asarray(cb.get_vector(name)["vector"], np.float32), vec)

        import io as _io
        buf = _io.BytesIO()
        np.save(buf, -vec)
        assert cb.upload_vector(name + "-npy", buf.getvalue())["dim"] == hidden
        np.testing.assert_array_equal(np.asarray(cb.get_vector(name + "-npy")["vector"], np.float32), -vec)

        base = cb.generate(prompt, max_tokens=3, logprobs=1)
        per_request = cb.generate(prompt, max_tokens=3, logprobs=1, interventions={"steer": steer})
        assert per_request["intervention"]["status"] == "ok"
        assert per_request["logprobs"] != pytest.approx(base["logprobs"], abs=1e-4)  # steering changed something
        cb.set_global_steer(steer)
        assert cb.global_steer()["steer"][0]["name"] == name
        with pytest.raises(CausalboardError) as busy:  # in use by the global steering
            cb.delete_vector(name)
        assert busy.value.status == 409 and busy.value.field == "name"
        steered = cb.generate(prompt, max_tokens=3, logprobs=1)
        assert steered["token_ids"] == per_request["token_ids"]
        assert steered["logprobs"] == pytest.approx(per_request["logprobs"], abs=1e-4)
    finally:
        cb.clear_global_steer()  # the engine is shared by the whole session
    assert cb.global_steer()["steer"] == []
    after = cb.generate(prompt, max_tokens=3, logprobs=1)
    assert after["token_ids"] == base["token_ids"] and after["logprobs"] == pytest.approx(base["logprobs"], abs=1e-5)
    assert cb.delete_vector(name) is True and cb.delete_vector(name + "-npy") is True
    assert cb.delete_vector(name) is False


def test_global_clamps_round_trip_sync_and_async(cb, server_url, engine, tasks):
    """`set_global_steer(clamp=...)`: a server-wide directional clamp changes generation, is
    listed by `global_steer()` in the form that posts back, and `clear_global_steer` removes it;
    a bad clamp raises with the field."""
    prompt = tasks["facts"][0]["prompt"]
    last = engine.info.num_layers - 1
    direction = np.random.default_rng(11).standard_normal(engine.info.hidden_size).astype(np.float32)
    clamp = [{"sites": [f"L{last}.post_block"], "vector": direction.tolist(), "value": 0.0}]
    base = cb.generate(prompt, max_tokens=3, logprobs=1)
    try:
        cb.set_global_steer(clamp=clamp)
        listed = cb.global_steer()
        assert listed["steer"] == [] and len(listed["clamp"]) == 1
        assert listed["clamp"][0]["min"] == 0.0 and listed["clamp"][0]["max"] == 0.0
        clamped = cb.generate(prompt, max_tokens=3, logprobs=1)
        per_request = cb.generate(prompt, max_tokens=3, logprobs=1, interventions={"clamp": clamp})
        assert clamped["logprobs"] != pytest.approx(base["logprobs"], abs=1e-4)  # the clamp did something
        cb.clear_global_steer()
        alone = cb.generate(prompt, max_tokens=3, logprobs=1, interventions={"clamp": clamp})
        assert alone["logprobs"] == pytest.approx(clamped["logprobs"], abs=1e-4)  # global == per-request
        assert per_request["intervention"]["status"] == "ok"

        async def main():
            async with AsyncCausalboardClient(server_url) as acb:
                await acb.set_global_steer(clamp=clamp)
                assert len((await acb.global_steer())["clamp"]) == 1
                await acb.clear_global_steer()
                return (await acb.global_steer())["clamp"]

        assert asyncio.run(main()) == []
        with pytest.raises(CausalboardError) as bad:
            cb.set_global_steer(clamp=[{"sites": [f"L{last}.post_block"], "vector": direction.tolist()}])
        assert bad.value.status == 400 and bad.value.field.startswith("clamp"), bad.value
    finally:
        cb.clear_global_steer()  # the engine is shared by the whole session
    assert cb.generate(prompt, max_tokens=3, logprobs=1)["logprobs"] == pytest.approx(base["logprobs"], abs=1e-5)


def test_async_capture_and_vectors(server_url, engine, tasks):
    prompt = tasks["facts"][1]["prompt"]

    async def main():
        async with AsyncCausalboardClient(server_url, timeout=300) as acb:
            cap = await acb.capture(prompt, ["L0.pre_attn"], "all_prompt")
            await acb.register_vector("client-tests.async", np.ones(engine.info.hidden_size))
            listed = await acb.list_vectors()
            deleted = await acb.delete_vector("client-tests.async"), await acb.delete_vector("client-tests.async")
            return cap, listed, deleted

    cap, listed, deleted = asyncio.run(main())
    direct = engine.capture(prompt, ["L0.pre_attn"], "all_prompt")
    np.testing.assert_array_equal(cap["L0.pre_attn"], np.stack([direct.captures[(0, "pre_attn", p)] for p in cap.positions]))
    assert "client-tests.async" in [v["name"] for v in listed["named"]]
    assert deleted == (True, False)


class _BreakingTransport(httpx.HTTPTransport):
    """Real HTTP, except that the body of the first `POST /v1/patch_sweep` fails with a ReadError
    right after the first chunk that carries a `cell` event (as a dropped connection would)."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[tuple[str, str, str | None]] = []
        self.broken = False

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.requests.append((request.method, request.url.path, request.headers.get("last-event-id")))
        response = super().handle_request(request)
        if request.method == "POST" and request.url.path == "/v1/patch_sweep" and not self.broken:
            self.broken = True
            response.stream = _BreakAfterFirstCell(response.stream)
        return response


class _BreakAfterFirstCell(httpx.SyncByteStream):
    def __init__(self, inner) -> None:
        self.inner = inner

    def __iter__(self):
        for chunk in self.inner:
            yield chunk
            if b'"type":"cell"' in chunk:
                raise httpx.ReadError("simulated connection drop")
        raise AssertionError("the sweep stream ended without a cell event")

    def close(self) -> None:
        self.inner.close()


def test_broken_sweep_stream_resumes_on_the_real_server(server_url, tasks):
    transport = _BreakingTransport()
    fields = {**_sweep_fields(tasks), "layers": [0, 1, 2, 3, 4, 5], "max_concurrency": 2}
    with CausalboardClient(server_url, timeout=300, transport=transport) as client:
        events = list(client.stream_sweep(**fields))
    replays = [r for r in transport.requests if r[1].endswith("/events")]
    assert len(replays) == 1 and replays[0][2] is not None and int(replays[0][2]) >= 1  # resumed after an id
    types = [e["type"] for e in events]
    assert types.count("start") == 1 and types[0] == "start" and types[-1] == "summary" and types.count("summary") == 1
    cells = [(e["hook"], e["layer"], e["position"]) for e in events if e["type"] == "cell"]
    assert cells and len(cells) == len(set(cells))  # nothing delivered twice
    summary = events[-1]
    assert summary["cells_done"] == len(cells)
    # the server cancels a sweep whose POST stream dropped (unless it had already finished)
    assert summary["cancelled"] or summary["cells_done"] == summary["cells_total"]
    folded = result_from_events(events[:-1])
    np.testing.assert_array_equal(folded.to_numpy(), SweepResult.from_summary(summary).to_numpy())


def test_api_key_is_sent_as_bearer_token(engine):
    from app.api.app import create_app

    app = create_app(engine, api_key="client-secret")  # a second app on the shared engine, in process

    async def main():
        out = {}
        async with AsyncCausalboardClient("http://cb.test", transport=httpx.ASGITransport(app=app)) as anon:
            out["read"] = (await anon.status())["model"]  # reads stay open
            try:
                await anon.register_vector("client-tests.key", np.ones(engine.info.hidden_size))
            except CausalboardError as exc:
                out["refused"] = exc
        async with AsyncCausalboardClient("http://cb.test", api_key="client-secret",
                                          transport=httpx.ASGITransport(app=app)) as keyed:
            out["registered"] = await keyed.register_vector("client-tests.key", np.ones(engine.info.hidden_size))
            out["deleted"] = await keyed.delete_vector("client-tests.key")
        return out

    out = asyncio.run(main())
    assert out["read"] == "causalboard-tiny"
    assert out["refused"].status == 401 and out["refused"].field == "authorization"
    assert out["registered"]["name"] == "client-tests.key" and out["deleted"] is True
