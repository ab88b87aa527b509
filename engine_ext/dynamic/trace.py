"""A policy's per-token trace in its two forms: the entries the worker keeps and the public
dicts (`Generation.intervention.dynamic["trace"]`: one list per policy of `{position, score,
threshold, engaged, scale}`), and the columns a result travels in between them.

A worker's result carries each policy's trace as four columns (`columns`: positions, scores,
thresholds, scales), which the client expands into the dicts (`expand`): a batch-32 decode of 256
tokens has 8,192 entries, whose dicts cost the engine-core process several milliseconds to build
and serialize per `generate` (docs/performance.md, "Twenty-eighth session"); as columns they
travel as eight flat lists per request. A result's policies travel as their indices in the
request's wire (the client holds their JSON), not as one JSON with its vector per request."""

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


def expand(result: dict | None, policies: Sequence[dict] | None = None) -> dict | None:
    """A worker's dynamic result in the public form: `trace_columns` (one entry per policy)
    replaced by `trace`, and `policy_index` (each policy's index in the request's wire) by
    `policies`, each a copy of `policies[index]` (the request's wire policies in their API JSON,
    which the client holds: `Engine`'s `_DynamicWire.policies_api`). A result in the public form
    already is returned as it is."""
    if result is None or ("trace_columns" not in result and "policy_index" not in result):
        return result
    out = {}
    for key, value in result.items():
        if key == "trace_columns":
            out["trace"] = [dicts(c) for c in value]
        elif key == "policy_index":
            if policies is None:
                raise ValueError("a dynamic result with policy indices needs the request's wire policies")
            out["policies"] = [_copy(policies[k]) for k in value]
        else:
            out[key] = value
    return out


def _copy(policy: dict) -> dict:
    """A policy's API JSON for one result (its vector list its own)."""
    out = dict(policy)
    if isinstance(out.get("vector"), list):
        out["vector"] = list(out["vector"])
    return out
