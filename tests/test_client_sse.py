"""The client's SSE handling against a canned server (no engine): reading the stream (httpx-sse),
unknown events, malformed events, errors before the stream, and resuming a broken sweep stream
with `Last-Event-ID`."""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from app.client.http import RESUME_TRIES, AsyncCausalboardClient, CausalboardClient, CausalboardError
from app.api.sse import DONE, sse_event
from app.client.sse import StreamTruncated, iter_events

from .conftest import serve_in_thread

LAYERS, POSITIONS = [0, 1], [0, 1, 2]


def sweep_events(sweep_id: str, *, cancelled: bool = False) -> list[dict]:
    """A complete canned sweep: start, one skip, six cells, progress, an unknown event type,
    noise floor, summary."""
    grid = [[0.1 * (i * 3 + j) for j in range(3)] for i in range(2)]
    evs: list[dict] = [{"type": "start", "sweep_id": sweep_id, "layers": LAYERS, "positions": POSITIONS, "hook": "post_block",
                        "metric": "logprob", "cells_total": 6, "token_strings": ["<s>", " A", " B"]}]
    for i, layer in enumerate(LAYERS):
        for j, pos in enumerate(POSITIONS):
            evs.append({"type": "cell", "hook": "post_block", "layer": layer, "position": pos, "value": grid[i][j]})
            if pos == 1:
                evs.append({"type": "progress", "done": i * 3 + j + 1, "total": 6, "voided": 0, "elapsed_s": 0.1 * (i + 1),
                            "cells_per_s": 20.0})
        if i == 0:
            evs.append({"type": "from_the_future", "payload": [1, 2, 3]})
    evs.append({"type": "noise_floor", "value": 0.002})
    evs.append({"type": "summary", "sweep_id": sweep_id, "layers": LAYERS, "positions": POSITIONS, "hook": "post_block",
                "metric": "logprob", "grid": grid, "argmax": {"layer": 1, "position": 2, "value": grid[1][2]}, "hook_grids": None,
                "clean": -0.1, "corrupt": -3.0, "skipped": [], "noise_floor": 0.002, "cells_total": 6, "cells_done": 6,
                "cancelled": cancelled, "token_strings": ["<s>", " A", " B"]})
    return evs


class Dropped(Exception):
    """Raised inside a streaming body: uvicorn then closes the connection mid-response."""


def canned_app() -> FastAPI:
    app = FastAPI()
    app.state.replays = []  # (sweep_id, Last-Event-ID header or None) per replay request
    app.state.plan = {}  # sweep_id -> list of replay behaviours still to serve

    def frame(evs: list[dict], start: int = 0) -> list[str]:
        return [sse_event(ev, start + k) for k, ev in enumerate(evs)]

    @app.post("/v1/patch_sweep")
    async def sweep(request: Request):
        body = await request.json()
        mode = body["prompt"]
        if mode == "bad":
            return JSONResponse({"error": "layers: layer 9 is out of range (0..5)", "field": "layers"}, status_code=400)
        if mode == "not-sse":
            return JSONResponse({"hello": "world"})
        if not body.get("stream"):
            return JSONResponse(sweep_events("plain")[-1])
        sweep_id = mode
        evs = sweep_events(sweep_id, cancelled=mode != "normal")
        texts = frame(evs)

        async def normal():
            # hand-framed: a comment, an `event:` line, CRLF endings and JSON split over data lines
            yield ": keep-alive comment\n\n"
            yield texts[0]
            first_cell = json.dumps(evs[1])
            cut = first_cell.index(", ") + 1  # between two JSON members (a newline is JSON whitespace)
            yield "event: message\r\nid: 1\r\ndata: " + first_cell[:cut] + "\r\ndata:" + first_cell[cut:] + "\r\n\r\n"
            for t in texts[2:]:
                yield t
            yield DONE

        async def malformed():
            yield texts[0]
            yield sse_event({"type": "cell", "hook": "post_block", "position": 0, "value": 0.5}, 1)  # no layer
            for t in texts[2:]:
                yield t
            yield DONE

        async def drop_after(n: int, *, slow: bool = False, clean_end: bool = False):
            for t in texts[:n]:
                yield t
            if slow:
                await asyncio.sleep(3)
            if clean_end:
                return
            raise Dropped("connection lost")

        app.state.events = getattr(app.state, "events", {})
        app.state.events[sweep_id] = texts
        plans = {
            "normal": (normal(), []),
            "malformed": (malformed(), []),
            "drop": (drop_after(4), ["rest"]),
            "drop-early": (drop_after(0), ["rest"]),
            "drop-twice": (drop_after(3), ["one-then-drop", "rest"]),
            "drop-forever": (drop_after(2), ["drop"] * (RESUME_TRIES + 2)),
            "truncated": (drop_after(5, clean_end=True), ["rest"]),
            "slow": (drop_after(2, slow=True), ["rest"]),
            "gone": (drop_after(2), ["404"]),
        }
        gen, replay_plan = plans[mode]
        app.state.plan[sweep_id] = list(replay_plan)
        return StreamingResponse(gen, media_type="text/event-stream")

    @app.get("/v1/patch_sweep/{sweep_id}/events")
    async def replay(sweep_id: str, request: Request):
        last = request.headers.get("last-event-id")
        app.state.replays.append((sweep_id, last))
        plan = app.state.plan.get(sweep_id)
        what = plan.pop(0) if plan else "404"
        if what == "404":
            return JSONResponse({"error": f"sweep_id: no sweep {sweep_id!r}", "field": "sweep_id"}, status_code=404)
        texts = app.state.events[sweep_id]
        after = -1 if last is None else int(last)
        # replay from the id after `after`, but re-send the last seen one too (a server may
        # legitimately replay an overlap); the client must drop it
        rest = texts[max(after, 0):]

        async def body():
            if what == "drop":
                raise Dropped("replay lost")
            for k, t in enumerate(rest):
                yield t
                if what == "one-then-drop" and k == 1:
                    raise Dropped("replay lost")
            yield DONE

        return StreamingResponse(body(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def canned():
    """(base URL, app) of the canned server, running in a thread."""
    app = canned_app()
    with serve_in_thread(app, "canned server", log_level="critical") as url:
        yield url, app


def _types(evs: list[dict]) -> list[str]:
    return [e["type"] for e in evs]


# ---- reading the stream (httpx-sse) ----------------------------------------------------------------
def read(text: str) -> list[tuple[dict, str | None]]:
    """(data, own id) of each event of a `text/event-stream` body."""
    response = httpx.Response(200, headers={"content-type": "text/event-stream"}, text=text)
    return [(ev.data, ev.id) for ev in iter_events(response)]


def test_reading_follows_the_event_stream_rules():
    text = (": a comment\n"
            "retry: 1000\n"
            "id: 7\nevent: cell\ndata: {\"a\":\ndata:1}\n\n"  # two data lines (joined by a newline), no space after a colon
            "data: {\"b\": 2}\r\n\r\n"                     # CRLF; no id of its own (the stream's last id is still 7)
            "id: 9\n\n"                                       # id only: no event
            "event: numbers\ndata: [3, 4]\n\n"                 # not an object: wrapped with the event's name
            "id: 10\ndata: {\"c\": 3}\n\n"
            "data: [DONE]\n\n"
            "data: {\"after\": true}\n\n")
    assert read(text) == [({"a": 1}, "7"), ({"b": 2}, None), ({"type": "numbers", "data": [3, 4]}, None), ({"c": 3}, "10")]


def test_a_body_without_done_is_truncated_and_bad_json_is_refused():
    with pytest.raises(StreamTruncated):  # an httpx transport error: a sweep stream resumes after it
        read('id: 0\ndata: {"x": 1}\n\ndata: {"unterminated": ')
    assert issubclass(StreamTruncated, httpx.RemoteProtocolError)
    with pytest.raises(json.JSONDecodeError):  # "second" is not JSON: refused rather than guessed
        read("data: second\n\n")


# ---- streams against the canned server ------------------------------------------------------------
def test_normal_stream_passes_every_event_through(canned):
    url, _ = canned
    with CausalboardClient(url) as cb:
        evs = list(cb.stream_sweep(prompt="normal", answer_token=" A"))
    assert evs == sweep_events("normal")
    assert "from_the_future" in _types(evs) and _types(evs)[-1] == "summary"


def test_patch_sweep_streams_with_callback_and_progress(canned, capsys):
    url, _ = canned
    seen = []
    with CausalboardClient(url) as cb:
        res = cb.patch_sweep(on_event=seen.append, progress=True, prompt="normal", answer_token=" A")
        plain = cb.patch_sweep(prompt="plain", answer_token=" A")
    assert seen == sweep_events("normal")
    expected = np.array(sweep_events("normal")[-1]["grid"])
    np.testing.assert_allclose(res.to_numpy(), expected)
    np.testing.assert_allclose(plain.to_numpy(), expected)
    assert res.noise_floor == 0.002 and res.top(1)[0]["token"] == " B"
    err = capsys.readouterr().err
    assert "6/6" in err and "cell" in err  # the tqdm bar reached the total


def test_a_malformed_event_raises_naming_its_field(canned):
    url, _ = canned
    seen = []
    with CausalboardClient(url) as cb:
        assert len(list(cb.stream_sweep(prompt="malformed", answer_token=" A"))) == len(sweep_events("malformed"))  # raw: passed through
        with pytest.raises(CausalboardError) as info:
            cb.patch_sweep(on_event=seen.append, prompt="malformed", answer_token=" A")
    assert info.value.field == "cell.layer" and "malformed sweep event" in info.value.message
    assert [e["type"] for e in seen] == ["start"]  # the callback never got the malformed event


def test_error_before_the_stream_raises_with_the_field(canned):
    url, _ = canned
    with CausalboardClient(url) as cb:
        with pytest.raises(CausalboardError) as info:
            list(cb.stream_sweep(prompt="bad", answer_token=" A"))
        assert info.value.status == 400 and info.value.field == "layers"
        assert "out of range" in info.value.message and info.value.body["field"] == "layers"
        with pytest.raises(CausalboardError) as info:
            cb.patch_sweep(on_event=print, prompt="not-sse", answer_token=" A")
        assert "expected an event stream" in info.value.message


def test_broken_stream_resumes_with_last_event_id(canned):
    url, app = canned
    with CausalboardClient(url) as cb:
        evs = list(cb.stream_sweep(prompt="drop", answer_token=" A"))
    assert evs == sweep_events("drop", cancelled=True)  # every event exactly once, in order
    assert evs[-1]["cancelled"] is True
    assert ("drop", "3") in app.state.replays  # 4 events (ids 0..3) arrived before the drop


def test_resume_survives_a_second_break(canned):
    url, app = canned
    with CausalboardClient(url) as cb:
        evs = list(cb.stream_sweep(prompt="drop-twice", answer_token=" A"))
    assert evs == sweep_events("drop-twice", cancelled=True)
    assert [h for s, h in app.state.replays if s == "drop-twice"] == ["2", "3"]


def test_truncated_and_timed_out_streams_resume(canned):
    url, app = canned
    with CausalboardClient(url) as cb:
        assert list(cb.stream_sweep(prompt="truncated", answer_token=" A")) == sweep_events("truncated", cancelled=True)
    with CausalboardClient(url, timeout=0.5) as cb:
        assert list(cb.stream_sweep(prompt="slow", answer_token=" A")) == sweep_events("slow", cancelled=True)
    assert ("truncated", "4") in app.state.replays and ("slow", "1") in app.state.replays


def test_no_resume_before_start_and_give_up_after_retries(canned):
    url, app = canned
    with CausalboardClient(url) as cb:
        with pytest.raises(httpx.RemoteProtocolError):
            list(cb.stream_sweep(prompt="drop-early", answer_token=" A"))
        assert not [r for r in app.state.replays if r[0] == "drop-early"]  # no sweep_id: nothing to resume
        got = []
        with pytest.raises(httpx.RemoteProtocolError):
            for ev in cb.stream_sweep(prompt="drop-forever", answer_token=" A"):
                got.append(ev)
        assert got == sweep_events("drop-forever")[:2]
        assert len([r for r in app.state.replays if r[0] == "drop-forever"]) == RESUME_TRIES
        with pytest.raises(CausalboardError) as info:  # the sweep is unknown on replay: a 404, not a hang
            list(cb.stream_sweep(prompt="gone", answer_token=" A"))
        assert info.value.status == 404 and info.value.field == "sweep_id"


def test_async_client_streams_resumes_and_raises(canned):
    url, app = canned

    async def main():
        async with AsyncCausalboardClient(url) as cb:
            normal = [ev async for ev in cb.stream_sweep(prompt="normal", answer_token=" A")]
            resumed = [ev async for ev in cb.stream_sweep(prompt="drop-twice", answer_token=" A")]
            seen = []

            async def on_event(ev):
                seen.append(ev["type"])

            res = await cb.patch_sweep(on_event=on_event, prompt="normal", answer_token=" A")
            with pytest.raises(CausalboardError) as info:
                await cb.patch_sweep(prompt="bad", answer_token=" A")
            return normal, resumed, seen, res, info.value

    app.state.replays.clear()
    normal, resumed, seen, res, err = asyncio.run(main())
    assert normal == sweep_events("normal")
    assert resumed == sweep_events("drop-twice", cancelled=True)
    assert [h for s, h in app.state.replays if s == "drop-twice"] == ["2", "3"]
    assert seen == _types(sweep_events("normal"))
    np.testing.assert_allclose(res.to_numpy(), np.array(sweep_events("normal")[-1]["grid"]))
    assert err.status == 400 and err.field == "layers"
