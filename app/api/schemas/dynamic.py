"""Request and response bodies of dynamic steering (probes, policies, status; docs/dynamic-steering.md).

Types and bounds are checked here; what depends on the model or the registries (dimensions, sites
in range, probe names, inverted thresholds) is checked by `engine_ext.dynamic.specs`, whose
`SpecError`s name the same fields.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from app.wire import StrictModel

SiteText = str


class ProbeSpec(StrictModel):
    """A probe: a direction, a linear classifier (weights + bias) or a small bank of them, at one site."""

    name: str = Field(..., description="Registry name (letters, digits, '_', '-', '.', ':'; at most 128).")
    site: SiteText = Field(..., description="The site it reads, e.g. 'L3.post_block'.")
    kind: Literal["direction", "linear", "bank"] = "direction"
    direction: list[float] | None = Field(None, description="kind 'direction': the direction (score = projection, unnormalised).")
    weights: list[float] | list[list[float]] | None = Field(
        None, description="kind 'linear': one vector; kind 'bank': k vectors (k <= 16).")
    bias: float | list[float] | None = Field(None, description="kind 'linear': a number; kind 'bank': k numbers.")
    labels: list[str] = Field(default_factory=list, description="Optional: one label per score.")
    description: str = ""


class ProbeInfo(BaseModel):
    name: str
    site: str
    kind: str
    size: int = Field(description="Number of scores (1, or k for a bank).")
    hidden_size: int
    labels: list[str] = Field(default_factory=list)
    description: str = ""
    digest: str = Field(description="Content digest of the probe (name, site, weights, bias).")


class ProbeList(BaseModel):
    probes: list[ProbeInfo]


class ProbeDeleted(BaseModel):
    name: str
    deleted: bool


class ProbeFitRequest(StrictModel):
    """Build a probe from captures of two prompt sets."""

    name: str
    site: SiteText
    positive: list[str] = Field(..., min_length=1, max_length=256, description="Prompts of the class the probe should score high.")
    negative: list[str] = Field(..., min_length=1, max_length=256, description="Prompts of the other class.")
    method: Literal["mean_diff", "least_squares", "logistic"] = Field(
        "mean_diff", description="mean_diff: difference of class means (a direction); least_squares / logistic: a linear classifier.")
    positions: str | list[int] = Field("last_prompt", description="Which positions of each prompt to use (as in captures).")
    l2: float = Field(1e-2, ge=0.0, description="Ridge / L2 penalty (least_squares, logistic).")
    keep: bool = Field(True, description="Register the fitted probe under `name` (false: fit and report only).")


class ProbeFitResponse(BaseModel):
    probe: ProbeInfo
    threshold: float = Field(description="The score halfway between the classes' mean scores (a starting 'on').")
    positive_scores: list[float]
    negative_scores: list[float]


class PolicySpec(StrictModel):
    """A policy (plain data): threshold with hysteresis, or proportional control of a steering
    vector's scale. Its action adds `scale * vector` at `sites` from the position after the one
    whose score decided it."""

    probe: str = Field(..., description="Name of a registered probe.")
    mode: Literal["threshold", "proportional"] = "threshold"
    sites: list[SiteText] = Field(..., min_length=1, description="Sites the action steers, e.g. ['L2.post_attn'].")
    vector: list[float] | None = Field(None, description="The steering vector (or `vector_name`).")
    vector_name: str | None = Field(None, description="A registered named vector (or `vector`).")
    component: int = Field(0, ge=0, description="Which of the probe's scores (a bank has several).")
    on: float | None = Field(None, description="threshold: engage when the score is >= on.")
    off: float | None = Field(None, description="threshold: release when the score is < off (off <= on; default on).")
    min_hold: int = Field(0, ge=0, description="threshold: steer at least this many tokens once engaged.")
    scale: float = Field(1.0, description="threshold: the scale while engaged.")
    latch: Literal["none", "request", "conversation"] = Field(
        "none", description="threshold: once engaged stay engaged for the request, or also for later requests of the conversation_id.")
    target: float | None = Field(None, description="proportional: the score to hold.")
    gain: float | None = Field(None, description="proportional: scale += gain * (target - score) after each token.")
    min_scale: float | None = Field(None, description="proportional: lower limit of the scale (default -10).")
    max_scale: float | None = Field(None, description="proportional: upper limit of the scale (default 10).")
    initial_scale: float = Field(0.0, description="proportional: the scale before the first decision.")


class DynamicSpec(StrictModel):
    """Dynamic steering of one generation request."""

    policies: list[PolicySpec] = Field(default_factory=list, max_length=8)
    conversation_id: str | None = Field(None, description="Groups requests for `latch: conversation`.")
    use_global: bool = Field(True, description="Also apply the server's global policies.")

    def to_engine(self):
        from engine_ext.dynamic.specs import DynamicRequest

        return DynamicRequest.make([p.model_dump(exclude_none=True) for p in self.policies], self.conversation_id,
                                   self.use_global)


class PoliciesRequest(StrictModel):
    policies: list[PolicySpec] = Field(default_factory=list, max_length=8, description="The new global policies ([] clears).")


class PoliciesResponse(BaseModel):
    policies: list[dict]


class DynamicStatusResponse(BaseModel):
    """Every worker's dynamic state and the cross-rank comparison of applied-action checksums."""

    probes: list[ProbeInfo]
    policies: list[dict] = Field(description="The global policies.")
    workers: list[dict] = Field(description="Per worker: tp_rank, pp_rank, probes, requests, engaged_requests, "
                                            "latched_conversations, dynamic_actions, rejected_actions, replayed_steps (steady decode "
                                            "steps whose plan repeated the last one's), graph_replays (per-step device work "
                                            "launched as a CUDA graph replay), action_count, action_checksum (hex).")
    determinism: dict = Field(description="{consistent: true, action_count: N} or {consistent: false, checksums: {rank: hex}}, "
                                          "compared within each pipeline stage.")
