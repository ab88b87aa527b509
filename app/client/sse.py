"""Reading server-sent events (the client side of `app/api/sse.py`).

`SSEParser` turns text lines into `SSEMessage`s following the WHATWG event-stream rules that
matter here: `data:` lines (several in one event are joined with "\\n"), `id:`, `event:`,
comment lines starting with `:`, `retry:` (ignored), one optional space after the colon, a blank
line ending an event, and an unterminated last event being discarded. `decode_events` turns
messages into the JSON objects the causalboard API sends and stops at `data: [DONE]`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from dataclasses import dataclass

#: the data of the stream's last message (not JSON; never delivered as an event)
DONE_DATA = "[DONE]"


@dataclass(frozen=True)
class SSEMessage:
    """One dispatched event: `data` (lines joined by "\\n"), `event` type ("message" when the
    stream gave none), and `id`: the event's own `id:` field, or None when it had none (unlike a
    browser's `lastEventId`, which persists: callers that resume track the last id themselves,
    and de-duplicate by the ids events really carried)."""

    data: str
    event: str = "message"
    id: str | None = None


class SSEParser:
    """Incremental parser: feed lines (without their line terminator), get messages."""

    def __init__(self) -> None:
        self._data: list[str] = []
        self._event = ""
        self._id: str | None = None

    def feed_line(self, line: str) -> SSEMessage | None:
        """Consume one line; return the message it completes (a blank line), else None."""
        line = line.rstrip("\r\n")
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "id":
            if "\0" not in value:
                self._id = value
        elif name == "event":
            self._event = value
        # `retry` and unknown field names are ignored, as the spec says
        return None

    def _dispatch(self) -> SSEMessage | None:
        data, event, event_id = self._data, self._event, self._id
        self._data, self._event, self._id = [], "", None
        if not data:
            return None
        return SSEMessage("\n".join(data), event or "message", event_id)


def iter_messages(lines: Iterable[str]) -> Iterator[SSEMessage]:
    """Messages of a stream of text lines."""
    parser = SSEParser()
    for line in lines:
        msg = parser.feed_line(line)
        if msg is not None:
            yield msg


async def aiter_messages(lines: AsyncIterable[str]) -> AsyncIterator[SSEMessage]:
    """Messages of an async stream of text lines."""
    parser = SSEParser()
    async for line in lines:
        msg = parser.feed_line(line)
        if msg is not None:
            yield msg


@dataclass(frozen=True)
class StreamEvent:
    """A decoded API event: the JSON object and the SSE id it came with (None if it had none)."""

    data: dict
    id: str | None


def decode_message(msg: SSEMessage) -> StreamEvent | None:
    """The JSON event of a message, or None for `[DONE]`. Non-object JSON payloads are wrapped
    as `{"type": "<event name>", "data": payload}` so callers always get a dict."""
    if msg.data.strip() == DONE_DATA:
        return None
    payload = json.loads(msg.data)
    if not isinstance(payload, dict):
        payload = {"type": msg.event, "data": payload}
    return StreamEvent(payload, msg.id)


def decode_events(lines: Iterable[str]) -> Iterator[StreamEvent]:
    """Decoded events of a stream, stopping at `[DONE]`."""
    for msg in iter_messages(lines):
        ev = decode_message(msg)
        if ev is None:
            return
        yield ev


async def adecode_events(lines: AsyncIterable[str]) -> AsyncIterator[StreamEvent]:
    """Async `decode_events`."""
    async for msg in aiter_messages(lines):
        ev = decode_message(msg)
        if ev is None:
            return
        yield ev
