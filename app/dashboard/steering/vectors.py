"""Steering-vector helpers for the steering view and the notebooks (plain numpy + the HTTP client).

Contrastive mean difference
---------------------------
Given activations captured at one site for two prompt sets A and B, the steering vector is
`mean(A) - mean(B)`: the direction that moves the residual stream from "B-like" to "A-like"
(Turner et al.'s ActAdd with averaged pairs; Rimsky et al.'s contrastive activation addition).

* `positions="last_prompt"` (default): each prompt contributes the stream at its last prompt
  token, the position whose activations produce the first generated token.
* `positions="all_prompt"`: each prompt contributes the mean over all its prompt tokens, so long
  and short prompts weigh the same.

Normalisation (`NORMALISATIONS`): `"none"` keeps the raw difference (scale 1 = the full A-B
shift), `"unit"` divides by its norm (scale = length added to the stream), `"activation"` gives it
the mean norm of the captured activations (scale 1 = one typical residual-stream norm at that
site).

Everything here is pure except `build_contrastive_vector` / `abuild_contrastive_vector`, which
capture through a causalboard client (`app.client.http`) over HTTP.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

from engine_ext.errors import SpecError
from engine_ext.sites import Site

CAPTURE_MODES = ("last_prompt", "all_prompt")
NORMALISATIONS = ("none", "unit", "activation")

_NAME_RE = re.compile(r"^[\w.\-:]{1,128}$")


class VectorInputError(SpecError):
    """Bad input to a vector helper; `field` names the offending input (dashboard/notebook field)."""


# ---- prompt lists ---------------------------------------------------------------------------------
def parse_prompt_lines(text: str, field: str = "prompts") -> list[str]:
    """One prompt per non-empty line (surrounding whitespace stripped, so write prompts without a
    trailing space, as the bundled model's tasks are). Raises when there is none."""
    prompts = [line.strip() for line in (text or "").splitlines() if line.strip()]
    if not prompts:
        raise VectorInputError(field, "give at least one prompt (one per line)")
    return prompts


def check_vector_name(name: str) -> str:
    name = (name or "").strip()
    if not _NAME_RE.match(name):
        raise VectorInputError("name", "must be 1-128 characters of letters, digits, '_', '-', '.', ':'")
    return name


# ---- the vector ---------------------------------------------------------------------------------
def prompt_activation(values: np.ndarray, positions: str = "last_prompt") -> np.ndarray:
    """One prompt's contribution from its captured `values` (positions x hidden, in position
    order): the last row for `last_prompt`, the mean over rows for `all_prompt`."""
    arr = np.asarray(values, dtype=np.float64)
    if arr.ndim == 1:
        arr = arr[None, :]
    if arr.ndim != 2 or arr.shape[0] == 0:
        raise VectorInputError("activations", f"expected (positions x hidden) values, got shape {list(arr.shape)}")
    if positions == "last_prompt":
        return arr[-1]
    if positions == "all_prompt":
        return arr.mean(axis=0)
    raise VectorInputError("positions", f"must be one of {', '.join(CAPTURE_MODES)}, got {positions!r}")


def mean_difference(acts_a: Sequence[np.ndarray], acts_b: Sequence[np.ndarray],
                    positions: str = "last_prompt") -> np.ndarray:
    """`mean_i(a_i) - mean_j(b_j)` in float64, where each prompt's activation is reduced by
    `prompt_activation(values, positions)`. Returns float32."""
    if not acts_a:
        raise VectorInputError("prompts_a", "no activations for set A")
    if not acts_b:
        raise VectorInputError("prompts_b", "no activations for set B")
    a = np.stack([prompt_activation(v, positions) for v in acts_a])
    b = np.stack([prompt_activation(v, positions) for v in acts_b])
    if a.shape[1] != b.shape[1]:
        raise VectorInputError("activations", f"hidden sizes differ: A has {a.shape[1]}, B has {b.shape[1]}")
    return (a.mean(axis=0) - b.mean(axis=0)).astype(np.float32)


def mean_activation_norm(acts: Iterable[np.ndarray], positions: str = "last_prompt") -> float:
    """Mean L2 norm of the per-prompt activations (the reference for `"activation"` normalisation)."""
    norms = [float(np.linalg.norm(prompt_activation(v, positions))) for v in acts]
    return float(np.mean(norms)) if norms else float("nan")


def normalise(vector: np.ndarray, mode: str = "none", reference_norm: float | None = None) -> np.ndarray:
    """Rescale `vector` per `mode` (see module docstring); float32. A zero vector cannot be
    normalised (the two prompt sets gave identical activations)."""
    vec = np.asarray(vector, dtype=np.float32)
    if mode == "none":
        return vec.copy()
    if mode not in NORMALISATIONS:
        raise VectorInputError("normalise", f"must be one of {', '.join(NORMALISATIONS)}, got {mode!r}")
    norm = float(np.linalg.norm(vec.astype(np.float64)))
    if norm == 0.0:
        raise VectorInputError("normalise", "the vector is zero (the two prompt sets have identical activations)")
    target = 1.0
    if mode == "activation":
        if reference_norm is None or not math.isfinite(reference_norm) or reference_norm <= 0:
            raise VectorInputError("normalise", "'activation' needs a positive reference norm")
        target = float(reference_norm)
    return (vec.astype(np.float64) * (target / norm)).astype(np.float32)


@dataclass
class ContrastiveVector:
    """A steering vector built from two prompt sets, with what it was built from."""

    vector: np.ndarray
    site: str
    positions: str
    normalisation: str
    prompts_a: list[str]
    prompts_b: list[str]
    raw_norm: float                 #: norm of mean(A) - mean(B) before normalisation
    activation_norm: float          #: mean norm of the captured per-prompt activations
    name: str | None = None

    @property
    def norm(self) -> float:
        return float(np.linalg.norm(self.vector.astype(np.float64)))

    def summary(self) -> dict[str, Any]:
        """Plain-data description (no vector values)."""
        return {"name": self.name, "site": self.site, "positions": self.positions,
                "normalisation": self.normalisation, "n_a": len(self.prompts_a), "n_b": len(self.prompts_b),
                "norm": self.norm, "raw_norm": self.raw_norm, "activation_norm": self.activation_norm,
                "dim": int(self.vector.shape[0])}


def contrastive_from_activations(acts_a: Sequence[np.ndarray], acts_b: Sequence[np.ndarray], *, site: str,
                                 positions: str = "last_prompt", normalisation: str = "none",
                                 prompts_a: Sequence[str] = (), prompts_b: Sequence[str] = (),
                                 name: str | None = None) -> ContrastiveVector:
    """The mean-difference vector of already captured activations, normalised."""
    raw = mean_difference(acts_a, acts_b, positions)
    act_norm = mean_activation_norm(list(acts_a) + list(acts_b), positions)
    vec = normalise(raw, normalisation, act_norm)
    return ContrastiveVector(vec, site, positions, normalisation, list(prompts_a), list(prompts_b),
                             float(np.linalg.norm(raw.astype(np.float64))), act_norm, name)


# ---- capture through the client -----------------------------------------------------------------
def _check_build_args(prompts_a: Sequence[str], prompts_b: Sequence[str], site: str, positions: str,
                      normalisation: str) -> None:
    Site.parse(site)
    if not prompts_a:
        raise VectorInputError("prompts_a", "give at least one prompt")
    if not prompts_b:
        raise VectorInputError("prompts_b", "give at least one prompt")
    if positions not in CAPTURE_MODES:
        raise VectorInputError("positions", f"must be one of {', '.join(CAPTURE_MODES)}, got {positions!r}")
    if normalisation not in NORMALISATIONS:
        raise VectorInputError("normalise", f"must be one of {', '.join(NORMALISATIONS)}, got {normalisation!r}")


def _site_values(captured: dict, site: str) -> np.ndarray:
    if site not in captured:
        raise VectorInputError("site", f"the capture returned no values for {site} (got {sorted(captured)})")
    return np.asarray(captured[site])


def build_contrastive_vector(client: Any, prompts_a: Sequence[str], prompts_b: Sequence[str], site: str, *,
                             positions: str = "last_prompt", normalisation: str = "none",
                             name: str | None = None, register: bool = False) -> ContrastiveVector:
    """Capture `site` for every prompt through a sync `CausalboardClient` (`POST /v1/capture`),
    build the mean-difference vector and, with `register=True`, register it under `name`."""
    _check_build_args(prompts_a, prompts_b, site, positions, normalisation)
    acts_a = [_site_values(client.capture(p, [site], positions), site) for p in prompts_a]
    acts_b = [_site_values(client.capture(p, [site], positions), site) for p in prompts_b]
    cv = contrastive_from_activations(acts_a, acts_b, site=site, positions=positions, normalisation=normalisation,
                                      prompts_a=prompts_a, prompts_b=prompts_b, name=name)
    if register:
        client.register_vector(check_vector_name(name or ""), cv.vector.tolist())
    return cv


async def abuild_contrastive_vector(client: Any, prompts_a: Sequence[str], prompts_b: Sequence[str], site: str, *,
                                    positions: str = "last_prompt", normalisation: str = "none",
                                    name: str | None = None, register: bool = False) -> ContrastiveVector:
    """`build_contrastive_vector` with an `AsyncCausalboardClient`; captures run concurrently
    (the engine batches them)."""
    import asyncio

    _check_build_args(prompts_a, prompts_b, site, positions, normalisation)
    captured = await asyncio.gather(*(client.capture(p, [site], positions) for p in [*prompts_a, *prompts_b]))
    acts = [_site_values(c, site) for c in captured]
    cv = contrastive_from_activations(acts[:len(prompts_a)], acts[len(prompts_a):], site=site, positions=positions,
                                      normalisation=normalisation, prompts_a=prompts_a, prompts_b=prompts_b, name=name)
    if register:
        await client.register_vector(check_vector_name(name or ""), cv.vector.tolist())
    return cv


# ---- steering specs -----------------------------------------------------------------------------
def steer_entry(site: str, *, name: str | None = None, vector: Any = None, scale: float = 1.0,
                positions: Any = "all", phase: str = "both") -> dict[str, Any]:
    """One native `interventions.steer` entry (engine_ext/specs.py `Steer`) for `/v1/generate`:
    a registered vector by `name` or an inline `vector`."""
    Site.parse(site)
    if (name is None) == (vector is None):
        raise VectorInputError("vector", "give exactly one of a registered name and an inline vector")
    entry: dict[str, Any] = {"sites": [site], "scale": float(scale), "positions": positions, "phase": phase}
    if name is not None:
        entry["name"] = name
    else:
        entry["vector"] = np.asarray(vector, dtype=np.float32).tolist()
    return entry


def steering_interventions(entries: Iterable[dict]) -> dict | None:
    """`{"steer": [...]}` for the entries with a non-zero scale, or None when nothing steers (a
    zero scale is the baseline: sending no intervention keeps the prefix cache usable)."""
    steer = [e for e in entries if float(e.get("scale", 0.0)) != 0.0]
    return {"steer": steer} if steer else None


# ---- defaults from the bundled model --------------------------------------------------------------
@dataclass
class ContrastDefaults:
    """Default contrastive prompt sets, site and test prompt for the steering view."""

    prompts_a: list[str]
    prompts_b: list[str]
    label_a: str
    label_b: str
    test_prompt: str
    layer: int = 2
    hook: str = "post_block"
    name: str = "capital_minus_language"
    notes: list[str] = field(default_factory=list)


FALLBACK_DEFAULTS = ContrastDefaults(
    prompts_a=["The capital of Tarn is", "The capital of Port Grisk is", "The capital of Vale of Ostrel is"],
    prompts_b=["The language of Tarn is", "The language of Port Brisk is", "The language of Rudan is"],
    label_a="capital", label_b="language", test_prompt="The language of Saint Ystra is")


def contrast_defaults(tasks: dict | None = None, relation_a: str = "capital", relation_b: str = "language",
                      template: str = "of", n: int = 8) -> ContrastDefaults:
    """Prompt sets from a model's `tasks.json` facts: `n` prompts of `relation_a` vs `n` of
    `relation_b`, same template (so only the relation word differs in form); the test prompt is
    another `relation_b` prompt of that template, not in set B. Falls back to a fixed set when the
    tasks do not have enough facts."""
    if not tasks:
        return FALLBACK_DEFAULTS
    facts = tasks.get("facts") or []
    a = [f["prompt"] for f in facts if f.get("relation") == relation_a and f.get("template_id") == template]
    b = [f["prompt"] for f in facts if f.get("relation") == relation_b and f.get("template_id") == template]
    if len(a) < 2 or len(b) < 3:
        return FALLBACK_DEFAULTS
    k = min(n, len(a), len(b) - 1)
    return ContrastDefaults(a[:k], b[:k], relation_a, relation_b, test_prompt=b[k],
                            name=f"{relation_a}_minus_{relation_b}")


