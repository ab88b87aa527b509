"""Reading the API's server-sent events (the client side of `app/api/sse.py`) on `httpx-sse`.

httpx-sse parses the event stream (WHATWG rules: `data:` lines joined with "\\n", `id:`,
`event:`, comments, `retry:`, a blank line ending an event, an unterminated last event dropped).
On top of it, this module turns each event into the JSON object the causalboard API sends
(`StreamEvent`), skips events without data, stops at `data: [DONE]`, and reports a body that ends
before it (`StreamTruncated`, an httpx transport error, so a sweep stream resumes).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import httpx
from httpx_sse import EventSource, ServerSentEvent

#: the data of the stream's last message (not JSON; never delivered as an event)
DONE_DATA = "[DONE]"


@dataclass(frozen=True)
class StreamEvent:
    """A decoded API event: the JSON object, and the `id:` it carried itself (None when it had
    none). httpx-sse reports the stream's last id on every event, as a browser's `lastEventId`
    does; an event whose id equals the previous event's on the same connection did not send
    one. Callers that resume de-duplicate by the ids events really carried."""

    data: dict
    id: str | None


class StreamTruncated(httpx.RemoteProtocolError):
    """The body ended cleanly but before `data: [DONE]` (a truncated stream)."""


class _Decoder:
    """httpx-sse events of one connection -> `StreamEvent`s (None for an event without data)."""

    def __init__(self) -> None:
        self._previous_id = ""

    def decode(self, sse: ServerSentEvent) -> StreamEvent | None:
        own_id = sse.id if sse.id != self._previous_id else ""
        self._previous_id = sse.id
        if not sse.data:  # an `id:`/`retry:`-only block: nothing to deliver (WHATWG: no dispatch)
            return None
        payload = json.loads(sse.data)
        if not isinstance(payload, dict):  # callers always get an object
            payload = {"type": sse.event, "data": payload}
        return StreamEvent(payload, own_id or None)


def _is_done(sse: ServerSentEvent) -> bool:
    return sse.data.strip() == DONE_DATA


def iter_events(response: httpx.Response) -> Iterator[StreamEvent]:
    """The decoded events of a streamed `text/event-stream` response up to `data: [DONE]`.
    Raises `StreamTruncated` when the body ends before it, and ValueError for data that is not
    JSON."""
    decoder = _Decoder()
    for sse in EventSource(response).iter_sse():
        if _is_done(sse):
            return
        ev = decoder.decode(sse)
        if ev is not None:
            yield ev
    raise StreamTruncated("the event stream ended before [DONE]")


async def aiter_events(response: httpx.Response) -> AsyncIterator[StreamEvent]:
    """Async `iter_events`."""
    decoder = _Decoder()
    async for sse in EventSource(response).aiter_sse():
        if _is_done(sse):
            return
        ev = decoder.decode(sse)
        if ev is not None:
            yield ev
    raise StreamTruncated("the event stream ended before [DONE]")


__all__ = ["DONE_DATA", "StreamEvent", "StreamTruncated", "aiter_events", "iter_events"]
