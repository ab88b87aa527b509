"""Wire format of the hybrid-model state check (`POST /v1/state_check`, docs/hybrid-models.md)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

TokenPrompt = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1, max_length=512)]


class StateCheckRequest(BaseModel):
    """Run the sentinel 4-arm check on the served hybrid model (the engine must be idle)."""

    model_config = ConfigDict(extra="forbid")

    probes: list[TokenPrompt] | None = Field(
        None, min_length=1, max_length=16,
        description="token-id prompts to probe (default: a 1-token prompt, a 3-token and a longer one)")
    max_tokens: int = Field(4, ge=1, le=64, description="greedy tokens generated per probe")
    sentinel_std: float = Field(1.0, gt=0, le=100, description="std of the Gaussian sentinel written into reallocated slots")
    seed: int = Field(0, ge=0, description="seed of the sentinel values")


class StateCheckProbe(BaseModel):
    prompt_token_ids: list[int]
    token_ids: list[int]
    baseline_token_ids: list[int]
    changed: bool = Field(description="greedy tokens or any logprob differ from the clean baseline")
    max_logprob_diff: float


class ArmExpectation(BaseModel):
    changed: bool
    guard_fired: bool


class StateCheckArm(BaseModel):
    arm: str = Field(description="zeroed+mask, zeroed+mask_off, sentinel+mask or sentinel+mask_off")
    slots: str = Field(description="what reallocated slots hold: 'zeroed' (the guard) or 'sentinel'")
    mask: str = Field(description="vLLM's has_initial_state mask: 'intact' or 'off' (forced all-true)")
    changed: bool = Field(description="some probe's output differs from the clean baseline")
    guard_fired: bool = Field(description="the guard's marker: slots were zeroed during this arm")
    slots_zeroed: int
    slots_filled: int
    expected: ArmExpectation
    as_expected: bool
    meaning: str = Field(description="what this arm proves")
    probes: list[StateCheckProbe]


class StateCheckBaseline(BaseModel):
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]


class StateCheckReport(BaseModel):
    model: str
    architecture: str
    dtype: str
    device: str
    max_tokens: int
    sentinel_std: float
    seed: int
    probes: list[list[int]]
    baseline: list[StateCheckBaseline]
    arms: list[StateCheckArm]
    hygienic: bool = Field(description="the zeroed arms are unchanged with the marker fired, and the sentinel arm "
                                       "with the mask off changed (the slots are really read)")
    mask_misses: list[list[int]] = Field(description="probes whose output the sentinel changed with the mask intact "
                                                     "(requests vLLM's mask alone does not protect)")
    seconds: float
