"""Server-sent-event framing in the reference fork's format: `data: <json>` lines, `\\n\\n` apart,
plus an `id:` line (old clients ignore it) and a final `data: [DONE]`."""

from __future__ import annotations

import json
from typing import Any

DONE = "data: [DONE]\n\n"


def sse_event(data: Any, event_id: int | str | None = None) -> str:
    payload = json.dumps(data, separators=(",", ":"), allow_nan=False)
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}data: {payload}\n\n"
