"""A policy's per-token trace in its two forms: the entries the worker keeps and the public
dicts (`Generation.intervention.dynamic["trace"]`: one list per policy of `{position, score,
threshold, engaged, scale}`), and the columns a result travels in between them.

A worker's result carries each policy's trace as four columns (`columns`: positions, scores,
thresholds, scales), which the client expands into the dicts (`expand`): a batch-32 decode of 256
tokens has 8,192 entries, whose dicts cost the engine-core process several milliseconds to build
and serialize per `generate` (docs/performance.md, "Twenty-eighth session"); as columns they
travel as eight flat lists per request."""

from __future__ import annotations

from collections.abc import Sequence


def columns(entries: Sequence[tuple]) -> list[list]:
    """A policy's entries `(position, score, threshold, scale)` as four columns."""
    if not entries:
        return [[], [], [], []]
    return [list(c) for c in zip(*entries)]


def dicts(cols: Sequence[Sequence]) -> list[dict]:
    """The public form of one policy's trace, from its columns (or from entries transposed)."""
    return [{"position": p, "score": s, "threshold": t, "engaged": x != 0.0, "scale": x} for p, s, t, x in zip(*cols)]


def expand(result: dict | None) -> dict | None:
    """A worker's dynamic result with its traces in the public form: `trace_columns` (one entry
    per policy) replaced by `trace`. A result without columns is returned as it is."""
    if result is None or "trace_columns" not in result:
        return result
    out = dict(result)
    out["trace"] = [dicts(c) for c in out.pop("trace_columns")]
    return out
