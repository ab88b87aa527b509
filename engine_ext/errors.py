"""Errors engine_ext raises for bad input and engine failure."""

from __future__ import annotations


class SpecError(ValueError):
    """A request or spec was refused before admission. `field` names the offending field
    (dotted path, e.g. `params.max_tokens`), so the API can return it verbatim."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class EngineDeadError(RuntimeError):
    """The vLLM engine stopped (a step raised or it was closed); no request can be served."""
