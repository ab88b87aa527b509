"""Python client for the causalboard HTTP API: `CausalboardClient` (sync) and
`AsyncCausalboardClient` (asyncio), both on httpx, with the same methods.

    from app.client import CausalboardClient
    with CausalboardClient("http://127.0.0.1:8000") as cb:
        res = cb.patch_sweep(prompt="Garrow is ruled by", clean_prompt="Guzar is ruled by",
                             answer_token=" Hadrian", metric="recovered", progress=True)
        print(res.top(3))

Contracts:

* Every non-2xx answer raises `CausalboardError(status, field, message, body)`; `field` is the
  server's dotted request field (None when the error is not about one field). Transport failures
  (server unreachable, a stream that cannot be resumed) raise httpx's own `TransportError`s.
* Streams (`stream_generate`, `stream_sweep`, `sweep_events`) yield the API's JSON events as
  dicts, in server order, `[DONE]` removed, unknown event types passed through (read with
  httpx-sse: `app/client/sse.py`). Errors sent before the first event are plain JSON and raise
  `CausalboardError`.
* `patch_sweep` folds a streamed sweep's events with the sweep's one event reader
  (`app.sweep.fold.SweepFold`); a malformed event raises `CausalboardError` naming its field.
* A sweep stream that breaks after its `start` event (connection reset, truncated body, read
  timeout) is resumed from `GET /v1/patch_sweep/{sweep_id}/events` with `Last-Event-ID` set to the
  last id received; every event is delivered exactly once. It gives up (re-raising the transport
  error) after `RESUME_TRIES` consecutive reconnects that bring no new event. The server cancels a
  sweep whose POST stream dropped, so a resumed sweep may end with `cancelled: true`.
* Request bodies may hold numpy arrays and numpy scalars (sent as JSON lists / numbers).
"""

from __future__ import annotations

import asyncio
import inspect
import io
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import numpy as np
from httpx_sse import aconnect_sse, connect_sse

from app.client.progress import SweepProgress
from app.client.sse import StreamEvent, aiter_events, iter_events
from app.sweep.fold import SweepFold
from app.sweep.result import SweepResult
from app.sweep.schema import SweepEventError

DEFAULT_URL = "http://127.0.0.1:8000"
#: consecutive reconnects without a new event before a broken sweep stream is given up
RESUME_TRIES = 3
#: wait before the k-th consecutive reconnect (k = 0, 1, 2): k x this
RESUME_BACKOFF_S = 0.5
#: a stream that ends in one of these (after its `start` event) is resumed
STREAM_BREAKS = (httpx.RemoteProtocolError, httpx.ReadError, httpx.ReadTimeout)
#: ... and a reconnect that fails with one of these is retried (the server may be restarting)
_RETRYABLE = STREAM_BREAKS + (httpx.ConnectError,)
#: npz members of a `/v1/capture` answer that are metadata, not captured sites
CAPTURE_META_KEYS = ("positions", "prompt_token_ids", "token_ids")


class CausalboardError(Exception):
    """A non-2xx answer of the API. `status` is the HTTP status, `field` the offending request
    field (dotted) or None, `message` the server's `error` text, `body` the decoded JSON body
    (`{"error": <text>}` when the body was not JSON)."""

    def __init__(self, status: int, field: str | None, message: str, body: dict | None = None):
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status
        self.field = field
        self.message = message
        self.body = body if body is not None else {"error": message, "field": field}

    @classmethod
    def from_response(cls, response: httpx.Response) -> "CausalboardError":
        """From a response whose body has been read."""
        try:
            body = response.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            text = response.text.strip() or response.reason_phrase
            body = {"error": text, "field": None}
        message = body.get("error") or body.get("detail") or response.reason_phrase
        return cls(response.status_code, body.get("field"), str(message), body)


class SweepFailed(CausalboardError):
    """A streamed sweep that the server reported failed (an `error` event). `result` is the
    partial `SweepResult` of its summary (cells done so far), or None when none came."""

    def __init__(self, message: str, event: dict, result: SweepResult | None):
        super().__init__(500, event.get("field"), message, event)
        self.result = result


class CaptureResult(dict):
    """`site -> numpy array (positions x hidden)` (keys are the server's canonical site text,
    e.g. "L2.post_block"), plus the capture's metadata as attributes: `positions`,
    `prompt_token_ids`, `token_strings` (lists, or None when the server did not send them) and
    `stored_as` (the kept run id, or None). The server sends the arrays as npz members and the
    rest in `X-Causalboard-*` headers."""

    positions: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    token_strings: list[str] | None = None
    stored_as: str | None = None


# ---- request descriptions shared by both clients --------------------------------------------------
_RAISE = object()


@dataclass
class _Call:
    """One HTTP exchange: what to send, how to read a 2xx answer, and what a 404 returns
    (`on_404`; by default it raises like any other error)."""

    method: str
    path: str
    json: Any = None
    parse: Callable[[httpx.Response], Any] = lambda r: r.json()
    on_404: Any = _RAISE
    headers: dict[str, str] = field(default_factory=dict)
    content: bytes | None = None

    def finish(self, response: httpx.Response) -> Any:
        if response.status_code == 404 and self.on_404 is not _RAISE:
            return self.on_404
        if response.status_code >= 400:
            raise CausalboardError.from_response(response)
        return self.parse(response)


def _seg(value: str, keep_slash: bool = False) -> str:
    """`value` as a URL path segment (percent-encoded; vector names may hold "/")."""
    return quote(str(value), safe="/" if keep_slash else "")


def jsonable(obj: Any) -> Any:
    """`obj` with numpy arrays / scalars (and tuples) turned into JSON types."""
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj


def _generate_body(prompt: str, max_tokens: int, temperature: float, logprobs: int | None, seed: int | None,
                   interventions: dict | None, extra: dict, stream: bool) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, **extra}
    if logprobs is not None:
        body["logprobs"] = logprobs
    if seed is not None:
        body["seed"] = seed
    if interventions is not None:
        body["interventions"] = interventions
    body["stream"] = stream
    return jsonable(body)


def _sweep_body(fields: dict, stream: bool) -> dict:
    return jsonable({**fields, "stream": stream})


def _parse_capture(response: httpx.Response) -> CaptureResult:
    out = CaptureResult()
    with np.load(io.BytesIO(response.content), allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    for key, arr in arrays.items():
        if key not in CAPTURE_META_KEYS:
            out[key] = arr
    out.positions = _int_list(arrays.get("positions"), response.headers.get("x-causalboard-positions"))
    out.prompt_token_ids = _int_list(arrays.get("prompt_token_ids", arrays.get("token_ids")),
                                     response.headers.get("x-causalboard-prompt-token-ids"))
    strings = response.headers.get("x-causalboard-token-strings")
    if strings:
        out.token_strings = json.loads(strings)
    out.stored_as = response.headers.get("x-causalboard-stored-as") or None
    return out


def _int_list(array: np.ndarray | None, header: str | None) -> list[int] | None:
    """Ints from an npz member, else from a comma-separated header, else None."""
    if array is not None:
        return [int(x) for x in array.reshape(-1).tolist()]
    if header:
        return [int(x) for x in header.split(",")]
    return None


def _finished_sweep(response: httpx.Response) -> SweepResult:
    body = response.json()
    if "layers" not in body:  # the server answers a running sweep's state instead of a summary
        raise CausalboardError(409, None, f"sweep {body.get('sweep_id')!r} has not finished (state {body.get('state')!r})", body)
    return SweepResult.from_summary(body)


def _vector_file(data: bytes | str | Path) -> bytes:
    return data if isinstance(data, bytes) else Path(data).read_bytes()


class _Ops:
    """The request of every simple method (the same for both clients)."""

    @staticmethod
    def status() -> _Call:
        return _Call("GET", "/v1/status")

    @staticmethod
    def model_tasks() -> _Call:
        return _Call("GET", "/v1/model/tasks", on_404=None)

    @staticmethod
    def tokenize(prompt: str, add_special_tokens: bool) -> _Call:
        return _Call("POST", "/v1/tokenize", {"prompt": prompt, "add_special_tokens": add_special_tokens})

    @staticmethod
    def generate(body: dict) -> _Call:
        return _Call("POST", "/v1/generate", body)

    @staticmethod
    def patch_sweep(fields: dict) -> _Call:
        return _Call("POST", "/v1/patch_sweep", _sweep_body(fields, stream=False), parse=lambda r: SweepResult.from_summary(r.json()))

    @staticmethod
    def sweep_status(sweep_id: str) -> _Call:
        return _Call("GET", f"/v1/patch_sweep/{_seg(sweep_id)}")

    @staticmethod
    def get_sweep(sweep_id: str) -> _Call:
        return _Call("GET", f"/v1/patch_sweep/{_seg(sweep_id)}", parse=_finished_sweep)

    @staticmethod
    def cancel_sweep(sweep_id: str) -> _Call:
        return _Call("DELETE", f"/v1/patch_sweep/{_seg(sweep_id)}", parse=lambda r: bool(r.json().get("cancelled")))

    @staticmethod
    def capture(prompt: str, sites: Any, positions: Any, keep_as: str | None) -> _Call:
        body = {"prompt": prompt, "sites": sites, "positions": positions, "format": "npz"}
        if keep_as is not None:
            body["keep_as"] = keep_as
        return _Call("POST", "/v1/capture", jsonable(body), parse=_parse_capture)

    @staticmethod
    def list_vectors() -> _Call:
        return _Call("GET", "/v1/steering/vectors")

    @staticmethod
    def get_vector(name: str) -> _Call:
        return _Call("GET", f"/v1/steering/vectors/{_seg(name, keep_slash=True)}")

    @staticmethod
    def register_vector(name: str, vector: Any) -> _Call:
        vec = np.asarray(vector, dtype=np.float64).reshape(-1)
        return _Call("POST", "/v1/steering/vectors", {"name": name, "vector": vec.tolist()})

    @staticmethod
    def upload_vector(name: str, data: bytes | str | Path) -> _Call:
        return _Call("PUT", f"/v1/steering/vectors/{_seg(name, keep_slash=True)}", content=_vector_file(data),
                     headers={"Content-Type": "application/octet-stream"})

    @staticmethod
    def delete_vector(name: str) -> _Call:
        return _Call("DELETE", f"/v1/steering/vectors/{_seg(name, keep_slash=True)}", parse=lambda r: True, on_404=False)

    @staticmethod
    def set_global_steer(steer: list[dict], clamp: list[dict] | None, replace: bool) -> _Call:
        body = {"steer": steer, "replace": replace}
        if clamp:
            body["clamp"] = clamp
        return _Call("POST", "/v1/steering/set", jsonable(body))

    @staticmethod
    def clear_global_steer() -> _Call:
        return _Call("POST", "/v1/steering/clear")

    @staticmethod
    def global_steer() -> _Call:
        return _Call("GET", "/v1/steering")

    @staticmethod
    def drop_source(run_id: str) -> _Call:
        return _Call("DELETE", f"/v1/patch_source/{_seg(run_id)}", parse=lambda r: True, on_404=False)

    # dynamic steering (docs/dynamic-steering.md)
    @staticmethod
    def list_probes() -> _Call:
        return _Call("GET", "/v1/steering/probes", parse=lambda r: r.json()["probes"])

    @staticmethod
    def register_probe(fields: dict) -> _Call:
        return _Call("POST", "/v1/steering/probes", jsonable(fields))

    @staticmethod
    def fit_probe(fields: dict) -> _Call:
        return _Call("POST", "/v1/steering/probes/fit", jsonable(fields))

    @staticmethod
    def delete_probe(name: str) -> _Call:
        return _Call("DELETE", f"/v1/steering/probes/{_seg(name)}", parse=lambda r: True, on_404=False)

    @staticmethod
    def set_dynamic_policies(policies: list) -> _Call:
        return _Call("PUT", "/v1/steering/dynamic/policies", jsonable({"policies": policies}),
                     parse=lambda r: r.json()["policies"])

    @staticmethod
    def dynamic_status() -> _Call:
        return _Call("GET", "/v1/steering/dynamic")


# ---- stream book-keeping shared by both clients -------------------------------------------------
def _check_stream(response: httpx.Response) -> None:
    """Raise for an error answer or a body that is not an event stream (call after reading the
    body when the status or content type is wrong)."""
    if response.status_code >= 400:
        raise CausalboardError.from_response(response)
    ctype = response.headers.get("content-type", "")
    if not ctype.startswith("text/event-stream"):
        raise CausalboardError(response.status_code, None, f"expected an event stream, got '{ctype or 'no content type'}'")


def _stream_is_ok(response: httpx.Response) -> bool:
    return response.status_code < 400 and response.headers.get("content-type", "").startswith("text/event-stream")


class _ResumeState:
    """What a sweep stream has delivered, for de-duplication and resumption."""

    def __init__(self) -> None:
        self.sweep_id: str | None = None
        self.last_id: str | None = None
        self.seen_ids: set[str] = set()
        self.delivered = 0
        self.fresh_tries = RESUME_TRIES
        self._skip = 0  # events to drop on a replay of a stream without ids

    def accept(self, ev: StreamEvent) -> bool:
        """Whether `ev` is new (to be yielded); records it."""
        if ev.id is not None:
            if ev.id in self.seen_ids:
                return False
            self.seen_ids.add(ev.id)
            self.last_id = ev.id
        elif self._skip:
            self._skip -= 1
            return False
        if ev.data.get("type") == "start" and ev.data.get("sweep_id"):
            self.sweep_id = str(ev.data["sweep_id"])
        self.delivered += 1
        self.fresh_tries = RESUME_TRIES
        return True

    def next_resume(self) -> tuple[str, dict[str, str], float] | None:
        """(path, headers, seconds to wait first) of the next replay request, or None when the
        stream cannot resume."""
        if self.sweep_id is None or self.fresh_tries <= 0:
            return None
        delay = RESUME_BACKOFF_S * (RESUME_TRIES - self.fresh_tries)
        self.fresh_tries -= 1
        headers = {}
        if self.last_id is not None:
            headers["Last-Event-ID"] = self.last_id
        else:
            self._skip = self.delivered
        return f"/v1/patch_sweep/{_seg(self.sweep_id)}/events", headers, delay


def _fold(fold: SweepFold, ev: dict) -> None:
    try:
        fold.apply(ev)
    except SweepEventError as exc:
        raise CausalboardError(0, exc.field, f"malformed sweep event: {exc}", {"error": str(exc), "field": exc.field, "event": ev}) from exc


def _sweep_outcome(fold: SweepFold) -> SweepResult:
    """The result of a folded sweep stream: its summary's, or `SweepFailed` when the server
    reported an error (with the partial result when a summary followed)."""
    partial = fold.result if fold.finished else None
    if fold.errors:
        message = fold.errors[-1] or "the sweep failed"
        raise SweepFailed(message, {"type": "error", "error": fold.errors[-1]}, partial)
    if partial is None:
        raise CausalboardError(0, None, "the sweep stream ended without a summary")
    return partial


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


# ---- the clients ------------------------------------------------------------------------------------
#: seconds an idle pooled connection is kept for reuse: less than the 5 s after which uvicorn
#: (`causalboard serve`) closes an idle keep-alive connection. A request sent on a connection just
#: as the server closes it fails with "connection reset by peer" (seen in CI, a poll after a pause
#: of a few seconds); a connection the client retires first is never in that race.
KEEPALIVE_EXPIRY_S = 2.0


class CausalboardClient:
    """Synchronous client. `timeout` (seconds) bounds connecting and each read, so for a
    streaming sweep it is the longest silence between two events. `transport` replaces httpx's
    (proxies, tests)."""

    def __init__(self, base_url: str = DEFAULT_URL, api_key: str | None = None, timeout: float = 600.0, *,
                 transport: httpx.BaseTransport | None = None):
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, headers=_headers(api_key), timeout=timeout, transport=transport,
                                  limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S))

    def __enter__(self) -> "CausalboardClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _do(self, call: _Call) -> Any:
        response = self._http.request(call.method, call.path, json=call.json, content=call.content, headers=call.headers)
        return call.finish(response)

    # ---- status and tokens
    def status(self) -> dict:
        return self._do(_Ops.status())

    def model_tasks(self) -> dict | None:
        """The served model's `tasks.json` (example prompts with known answers), None when it has none."""
        return self._do(_Ops.model_tasks())

    def health(self) -> bool:
        """True when the server answers `/health` with 200 (False when down or unreachable)."""
        try:
            return self._http.get("/health").status_code == 200
        except httpx.TransportError:
            return False

    def tokenize(self, prompt: str, *, add_special_tokens: bool = True) -> dict:
        return self._do(_Ops.tokenize(prompt, add_special_tokens))

    # ---- generation
    def generate(self, prompt: str, *, max_tokens: int = 16, temperature: float = 0.0, logprobs: int | None = None,
                 seed: int | None = None, interventions: dict | None = None, **extra: Any) -> dict:
        """`POST /v1/generate`; `extra` holds further request fields (top_p, stop, ...)."""
        return self._do(_Ops.generate(_generate_body(prompt, max_tokens, temperature, logprobs, seed, interventions, extra, False)))

    def stream_generate(self, prompt: str, *, max_tokens: int = 16, temperature: float = 0.0, logprobs: int | None = None,
                        seed: int | None = None, interventions: dict | None = None, **extra: Any) -> Iterator[dict]:
        """The SSE events of `/v1/generate` (`start`, `token`..., `done`, or `error`)."""
        body = _generate_body(prompt, max_tokens, temperature, logprobs, seed, interventions, extra, True)
        yield from self._events("POST", "/v1/generate", body, {}, None)

    # ---- sweeps
    def patch_sweep(self, *, on_event: Callable[[dict], Any] | None = None, progress: bool = False,
                    **request_fields: Any) -> SweepResult:
        """Run `POST /v1/patch_sweep` (fields as in the API) and return its result. Without
        `on_event` and `progress` the request is not streamed; otherwise every event is passed to
        `on_event(ev)` and/or drives a progress bar (in a notebook cell an HTML bar updated in place,
        else tqdm on stderr: `app/client/progress.py`), and the result is the summary event's.
        A streamed sweep that the server reports failed (an `error` event) raises `SweepFailed`
        (a `CausalboardError` carrying the partial result); a cancelled one returns its result
        with `meta["cancelled"]` true."""
        if on_event is None and not progress:
            return self._do(_Ops.patch_sweep(request_fields))
        fold, bar = SweepFold(), SweepProgress(progress)
        try:
            for ev in self.stream_sweep(**request_fields):
                _fold(fold, ev)
                bar.show(fold)
                if on_event is not None:
                    on_event(ev)
        finally:
            bar.close(fold)
        return _sweep_outcome(fold)

    def stream_sweep(self, **request_fields: Any) -> Iterator[dict]:
        """The SSE events of `POST /v1/patch_sweep` (resumed after a break; see the module doc).
        Closing the iterator early disconnects, which cancels the sweep on the server."""
        yield from self._events("POST", "/v1/patch_sweep", _sweep_body(request_fields, True), {}, _ResumeState())

    def sweep_events(self, sweep_id: str, *, last_event_id: str | int | None = None) -> Iterator[dict]:
        """Replay a sweep's events after `last_event_id` (all when None), live while it runs."""
        headers = {} if last_event_id is None else {"Last-Event-ID": str(last_event_id)}
        yield from self._events("GET", f"/v1/patch_sweep/{_seg(sweep_id)}/events", None, headers, None)

    def get_sweep(self, sweep_id: str) -> SweepResult:
        """The result of a recently finished sweep; CausalboardError 404 when the server does
        not know it, 409 while it still runs (see `sweep_status`)."""
        return self._do(_Ops.get_sweep(sweep_id))

    def sweep_status(self, sweep_id: str) -> dict:
        """The raw `GET /v1/patch_sweep/{id}`: the summary, or `{"sweep_id", "state",
        "cells_done", ...}` while it runs."""
        return self._do(_Ops.sweep_status(sweep_id))

    def cancel_sweep(self, sweep_id: str) -> bool:
        """Cancel a running sweep; False when it had already finished (404 → CausalboardError)."""
        return self._do(_Ops.cancel_sweep(sweep_id))

    def _events(self, method: str, path: str, body: Any, headers: dict, resume: _ResumeState | None) -> Iterator[dict]:
        while True:
            try:
                with connect_sse(self._http, method, path, json=body, headers=dict(headers)) as source:
                    response = source.response
                    if not _stream_is_ok(response):
                        response.read()
                        _check_stream(response)
                    for ev in iter_events(response):
                        if resume is None or resume.accept(ev):
                            yield ev.data
                    return
            except _RETRYABLE:
                nxt = resume.next_resume() if resume is not None else None
                if nxt is None:
                    raise
                method, body = "GET", None
                path, headers, delay = nxt
                time.sleep(delay)

    # ---- capture and sources
    def capture(self, prompt: str, sites: Any, positions: Any = "last_prompt", *, keep_as: str | None = None) -> CaptureResult:
        """Activations at `sites` (e.g. `["L2.post_block"]`) and `positions`: a `CaptureResult`
        mapping each site to a float array (positions x hidden). `keep_as` also stores the run on
        the server as a patch source under that id."""
        return self._do(_Ops.capture(prompt, sites, positions, keep_as))

    def drop_source(self, run_id: str) -> bool:
        """Drop a stored source run; False when there was none."""
        return self._do(_Ops.drop_source(run_id))

    # ---- steering
    def list_vectors(self) -> dict:
        return self._do(_Ops.list_vectors())

    def get_vector(self, name: str) -> dict:
        return self._do(_Ops.get_vector(name))

    def register_vector(self, name: str, vector: Any) -> dict:
        return self._do(_Ops.register_vector(name, vector))

    def upload_vector(self, name: str, data: bytes | str | Path) -> dict:
        """Register a vector from a `.npy` or `.safetensors` file (its bytes or its path)."""
        return self._do(_Ops.upload_vector(name, data))

    def delete_vector(self, name: str) -> bool:
        """Delete a named vector; False when there was none (409 CausalboardError while the
        global steering uses it)."""
        return self._do(_Ops.delete_vector(name))

    def set_global_steer(self, steer: list[dict] | None = None, *, clamp: list[dict] | None = None,
                         replace: bool = True) -> dict:
        """Server-wide steering, native form `[{"sites", "vector" | "name", "scale", "positions",
        "phase"}]`, and/or directional clamps `[{"sites", "vector", "min", "max" | "value",
        "strength", "positions", "phase"}]` (docs/api.md: clamps); at least one of the two.
        `replace=False` merges with the current entries (same site + phase replaced)."""
        return self._do(_Ops.set_global_steer(list(steer or ()), clamp, replace))

    def clear_global_steer(self) -> dict:
        return self._do(_Ops.clear_global_steer())

    def global_steer(self) -> dict:
        return self._do(_Ops.global_steer())

    # ---- dynamic steering: probes, global policies, status (docs/dynamic-steering.md)
    def list_probes(self) -> list[dict]:
        return self._do(_Ops.list_probes())

    def register_probe(self, **fields: Any) -> dict:
        """`POST /v1/steering/probes` (name, site, kind, direction | weights, bias, labels)."""
        return self._do(_Ops.register_probe(fields))

    def fit_probe(self, **fields: Any) -> dict:
        """`POST /v1/steering/probes/fit` (name, site, positive, negative, method, positions, keep)."""
        return self._do(_Ops.fit_probe(fields))

    def delete_probe(self, name: str) -> bool:
        return self._do(_Ops.delete_probe(name))

    def set_dynamic_policies(self, policies: list[dict]) -> list[dict]:
        return self._do(_Ops.set_dynamic_policies(policies))

    def dynamic_status(self) -> dict:
        return self._do(_Ops.dynamic_status())


class AsyncCausalboardClient:
    """asyncio client with the methods of `CausalboardClient` (`async def`; `stream_*` and
    `sweep_events` are async iterators; `aclose()`). `patch_sweep`'s `on_event` may be a plain
    function or a coroutine function."""

    def __init__(self, base_url: str = DEFAULT_URL, api_key: str | None = None, timeout: float = 600.0, *,
                 transport: httpx.AsyncBaseTransport | None = None):
        self.base_url = base_url.rstrip("/")
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=_headers(api_key), timeout=timeout,
                                       transport=transport, limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S))

    async def __aenter__(self) -> "AsyncCausalboardClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _do(self, call: _Call) -> Any:
        response = await self._http.request(call.method, call.path, json=call.json, content=call.content, headers=call.headers)
        return call.finish(response)

    async def status(self) -> dict:
        return await self._do(_Ops.status())

    async def model_tasks(self) -> dict | None:
        """The served model's `tasks.json`, None when it has none."""
        return await self._do(_Ops.model_tasks())

    async def health(self) -> bool:
        try:
            return (await self._http.get("/health")).status_code == 200
        except httpx.TransportError:
            return False

    async def tokenize(self, prompt: str, *, add_special_tokens: bool = True) -> dict:
        return await self._do(_Ops.tokenize(prompt, add_special_tokens))

    async def generate(self, prompt: str, *, max_tokens: int = 16, temperature: float = 0.0, logprobs: int | None = None,
                       seed: int | None = None, interventions: dict | None = None, **extra: Any) -> dict:
        return await self._do(_Ops.generate(_generate_body(prompt, max_tokens, temperature, logprobs, seed, interventions, extra, False)))

    async def stream_generate(self, prompt: str, *, max_tokens: int = 16, temperature: float = 0.0, logprobs: int | None = None,
                              seed: int | None = None, interventions: dict | None = None, **extra: Any) -> AsyncIterator[dict]:
        body = _generate_body(prompt, max_tokens, temperature, logprobs, seed, interventions, extra, True)
        async for ev in self._events("POST", "/v1/generate", body, {}, None):
            yield ev

    async def patch_sweep(self, *, on_event: Callable[[dict], Any] | None = None, progress: bool = False,
                          **request_fields: Any) -> SweepResult:
        if on_event is None and not progress:
            return await self._do(_Ops.patch_sweep(request_fields))
        fold, bar = SweepFold(), SweepProgress(progress)
        try:
            async for ev in self.stream_sweep(**request_fields):
                _fold(fold, ev)
                bar.show(fold)
                out = on_event(ev) if on_event is not None else None
                if inspect.isawaitable(out):
                    await out
        finally:
            bar.close(fold)
        return _sweep_outcome(fold)

    async def stream_sweep(self, **request_fields: Any) -> AsyncIterator[dict]:
        async for ev in self._events("POST", "/v1/patch_sweep", _sweep_body(request_fields, True), {}, _ResumeState()):
            yield ev

    async def sweep_events(self, sweep_id: str, *, last_event_id: str | int | None = None) -> AsyncIterator[dict]:
        headers = {} if last_event_id is None else {"Last-Event-ID": str(last_event_id)}
        async for ev in self._events("GET", f"/v1/patch_sweep/{_seg(sweep_id)}/events", None, headers, None):
            yield ev

    async def get_sweep(self, sweep_id: str) -> SweepResult:
        return await self._do(_Ops.get_sweep(sweep_id))

    async def sweep_status(self, sweep_id: str) -> dict:
        return await self._do(_Ops.sweep_status(sweep_id))

    async def cancel_sweep(self, sweep_id: str) -> bool:
        return await self._do(_Ops.cancel_sweep(sweep_id))

    async def _events(self, method: str, path: str, body: Any, headers: dict, resume: _ResumeState | None) -> AsyncIterator[dict]:
        while True:
            try:
                async with aconnect_sse(self._http, method, path, json=body, headers=dict(headers)) as source:
                    response = source.response
                    if not _stream_is_ok(response):
                        await response.aread()
                        _check_stream(response)
                    async for ev in aiter_events(response):
                        if resume is None or resume.accept(ev):
                            yield ev.data
                    return
            except _RETRYABLE:
                nxt = resume.next_resume() if resume is not None else None
                if nxt is None:
                    raise
                method, body = "GET", None
                path, headers, delay = nxt
                await asyncio.sleep(delay)

    async def capture(self, prompt: str, sites: Any, positions: Any = "last_prompt", *, keep_as: str | None = None) -> CaptureResult:
        return await self._do(_Ops.capture(prompt, sites, positions, keep_as))

    async def drop_source(self, run_id: str) -> bool:
        return await self._do(_Ops.drop_source(run_id))

    async def list_vectors(self) -> dict:
        return await self._do(_Ops.list_vectors())

    async def get_vector(self, name: str) -> dict:
        return await self._do(_Ops.get_vector(name))

    async def register_vector(self, name: str, vector: Any) -> dict:
        return await self._do(_Ops.register_vector(name, vector))

    async def upload_vector(self, name: str, data: bytes | str | Path) -> dict:
        return await self._do(_Ops.upload_vector(name, data))

    async def delete_vector(self, name: str) -> bool:
        return await self._do(_Ops.delete_vector(name))

    async def set_global_steer(self, steer: list[dict] | None = None, *, clamp: list[dict] | None = None,
                               replace: bool = True) -> dict:
        return await self._do(_Ops.set_global_steer(list(steer or ()), clamp, replace))

    async def clear_global_steer(self) -> dict:
        return await self._do(_Ops.clear_global_steer())

    async def global_steer(self) -> dict:
        return await self._do(_Ops.global_steer())

    async def list_probes(self) -> list[dict]:
        return await self._do(_Ops.list_probes())

    async def register_probe(self, **fields: Any) -> dict:
        return await self._do(_Ops.register_probe(fields))

    async def fit_probe(self, **fields: Any) -> dict:
        return await self._do(_Ops.fit_probe(fields))

    async def delete_probe(self, name: str) -> bool:
        return await self._do(_Ops.delete_probe(name))

    async def set_dynamic_policies(self, policies: list[dict]) -> list[dict]:
        return await self._do(_Ops.set_dynamic_policies(policies))

    async def dynamic_status(self) -> dict:
        return await self._do(_Ops.dynamic_status())
