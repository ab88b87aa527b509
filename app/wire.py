"""Wire pieces shared by every request schema (`app/api/schemas/*`, `app/sweep/schema.py`).

* `StrictModel` — the base of every request model: unknown fields are refused (a typo is a 400
  naming the field, never a silently ignored option).
* `SpanSpec` — a span selector `{"span": text, "occurrence": n}`, the JSON of
  `engine_ext.sites.Span`.
* `MAX_PROMPT_CHARS` — the longest prompt any request accepts.

Pure pydantic on top of `engine_ext.sites` (no vLLM), so `app/sweep` and `app/api` can both
import it without depending on each other.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from engine_ext.sites import Span

MAX_PROMPT_CHARS = 100_000


class StrictModel(BaseModel):
    """A request body (or part of one) that forbids unknown fields."""

    model_config = ConfigDict(extra="forbid")


class SpanSpec(StrictModel):
    """The tokens overlapping the `occurrence`-th (0-based) occurrence of `span` in the prompt."""

    span: str = Field(..., min_length=1)
    occurrence: int = Field(0, ge=0)

    def to_span(self) -> Span:
        return Span(self.span, self.occurrence)
