"""Reading SSE bodies in tests (the server's framing: optional `id:` line, one `data:` line)."""

from __future__ import annotations

import json


def sse_events(text: str) -> list[tuple[int | None, object]]:
    """(id, data) per event; data is the decoded JSON, or the string '[DONE]'."""
    out = []
    for block in text.strip().split("\n\n"):
        eid, data = None, None
        for line in block.splitlines():
            if line.startswith("id: "):
                eid = int(line[4:])
            elif line.startswith("data: "):
                data = line[6:]
        if data is not None:
            out.append((eid, data if data == "[DONE]" else json.loads(data)))
    return out


def sse_data(text: str) -> list:
    """The data of each event (decoded JSON, or '[DONE]')."""
    return [data for _, data in sse_events(text)]
