"""`PatchSweepRequest`: the body of `POST /v1/patch_sweep`.

Field names and meanings are the reference fork's (`PatchSweepRequest`), so its clients work
unchanged; causalboard's extensions (`prob`, `recovered_basis`, `noise`, `subject`,
`max_concurrency`, `noise_floor_samples`) are optional. Fork fields causalboard cannot honour
(`mask`, `patch_vectors`/`source_inline`, `mlp_*` hooks) are accepted by the schema only to be
refused with a 400 naming them — never silently ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from app.wire import MAX_PROMPT_CHARS, SpanSpec, StrictModel

METRICS = ("logprob", "logit_diff", "recovered", "prob")
BASES = ("logprob", "logit_diff", "prob")


class LayerRange(StrictModel):
    start: int = Field(0, ge=0)
    stop: int = Field(..., ge=0)
    step: int = Field(1, ge=1)


class NoiseSpec(StrictModel):
    """ROME-style corruption: Gaussian noise of `scale` x (std of the embedding matrix) added to
    the input embeddings at `span` (or `positions`) of `prompt`; the clean run is the prompt
    without noise. `samples` noise draws (seeds `seed`, `seed+1`, ...) are averaged."""

    span: str | None = Field(None, min_length=1, description="Text whose tokens get noise.")
    occurrence: int = Field(0, ge=0)
    positions: list[int] | None = Field(None, description="Token positions instead of a span.")
    scale: float = Field(3.0, ge=0.0, le=100.0)
    seed: int = Field(0, ge=0)
    samples: int = Field(1, ge=1, le=32)


class PatchSweepRequest(StrictModel):
    model: str | None = Field(None, description="Ignored if it names the served model; 404 otherwise.")
    prompt: str = Field(..., min_length=1, max_length=MAX_PROMPT_CHARS, description="The corrupted (destination) prompt.")
    clean_prompt: str | None = Field(None, min_length=1, max_length=MAX_PROMPT_CHARS,
                                     description="Clean prompt: captured automatically when `source_run` is absent or not stored; drives alignment.")
    source_run: str | None = Field(None, min_length=1, max_length=200, description="Id of a stored clean run to patch from.")
    source_module: str | None = Field(None, description='Ablation source instead of a clean run: "zeros", "mean" (mean of the clean run over positions) or a registered vector name.')
    source_inline: int | None = Field(None, description="Not supported (fork: row of patch_vectors).")
    patch_vectors: dict | None = Field(None, description="Not supported (fork: packed vectors for source_inline).")
    mask: dict | None = Field(None, description="Not supported (fork: partial-dimension patch mask).")
    hook: str = Field("post_block", description="Hook of every cell (pre_attn, post_attn, post_block).")
    hooks: list[str] | None = Field(None, min_length=1, description="Several hooks: one grid per hook (wins over `hook`).")
    layers: list[int] | LayerRange | None = Field(None, description="Layer list or {start, stop, step} (range semantics); default all layers.")
    positions: Literal["all_prompt"] | list[int | SpanSpec] = Field("all_prompt", description='"all_prompt", token indices, {"span", "occurrence"} or a mix.')
    alpha: float = Field(1.0, ge=0.0, le=1.0, description="(1 - alpha) * h + alpha * source; 1 = replace (exact).")
    answer_token: str | None = Field(None, description="The answer as text; must be exactly one token.")
    answer_token_id: int | None = Field(None, ge=0)
    foil_token: str | None = None
    foil_token_id: int | None = Field(None, ge=0)
    metric: Literal["logprob", "logit_diff", "recovered", "prob"] = "logprob"
    recovered_basis: Literal["logprob", "logit_diff", "prob"] = Field(
        "logprob", description="Quantity normalised by `recovered` (the fork uses logprob).")
    logprobs: int = Field(20, ge=1, description="Accepted for fork compatibility; cells are scored exactly on the answer/foil ids.")
    clean_baseline: float | None = Field(None, description="Clean value of the basis metric, when it cannot be measured (e.g. a stored run without clean_prompt).")
    keep_source: bool = Field(False, description="Keep the auto-captured clean run (for zoom follow-ups).")
    stream: bool = Field(False, description="Stream cells as server-sent events.")
    noise: NoiseSpec | None = Field(None, description="Noise corruption of the prompt instead of a corrupt prompt.")
    subject: SpanSpec | None = Field(None, description="Subject span of the corrupt prompt, marked in figures.")
    noise_floor_samples: int = Field(6, ge=1, le=32, description="Unpatched baseline re-runs spread through the cell batch.")
    max_concurrency: int = Field(64, ge=1, le=1024, description="Cells in flight at once.")

    def hook_list(self) -> list[str]:
        return list(dict.fromkeys(self.hooks)) if self.hooks else [self.hook]

    def positions_json(self) -> Any:
        if isinstance(self.positions, str):
            return self.positions
        return [p.model_dump() if isinstance(p, SpanSpec) else p for p in self.positions]
