"""Plain-data generation parameters and results (no vLLM types cross this boundary)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from engine_ext.errors import SpecError

if TYPE_CHECKING:
    import numpy as np

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class GenerationParams:
    """How to generate. Greedy by default (temperature 0).

    `logprobs`: None (the default) computes no per-token logprobs (vLLM's own default, and what
    it costs nothing to skip); 0 reports the chosen token's logprob; k > 0 also the top-k
    alternatives per generated token. Scores of chosen ids (`Interventions.score_token_ids`) are
    independent of it."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    logprobs: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    #: vLLM's `cache_salt`: prefix-cache blocks are shared only among requests with the same salt
    cache_salt: str | None = None
    #: False: no text is decoded (`text` is empty; token ids, logprobs and scores are unchanged),
    #: for callers that read ids and scores only, like a sweep's cells (vLLM then skips its
    #: per-token detokenization). Stop strings need the text.
    detokenize: bool = True

    def validate(self, prefix: str = "") -> None:
        """Raise `SpecError` naming the first bad field."""

        def bad(name: str, msg: str) -> SpecError:
            return SpecError(f"{prefix}{name}", msg)

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise bad("top_k", f"must be >= 0 (0 disables it), got {self.top_k!r}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise bad("logprobs", f"must be null or an integer between 0 and {MAX_TOP_LOGPROBS}, got {self.logprobs!r}")
        if any(not s for s in self.stop):
            raise bad("stop", "stop strings must not be empty")
        if not isinstance(self.detokenize, bool):
            raise bad("detokenize", f"must be true or false, got {self.detokenize!r}")
        if self.stop and not self.detokenize:
            raise bad("detokenize", "stop strings are matched on the decoded text: they need detokenize=True")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise bad("cache_salt", "must be a non-empty string if provided")


@dataclass
class InterventionResult:
    """What the workers report for a request with interventions.

    `status` is "ok" or "voided" (a patch source was missing/evicted, a named vector vanished,
    or the step's capacity was exceeded): a voided request's outputs must not be used as
    patched results. `captures` maps (layer, hook, position) to the float32 stream value."""

    status: str
    errors: list[str] = field(default_factory=list)
    captures: dict[tuple[int, str, int], "np.ndarray"] = field(default_factory=dict)
    stored_as: str | None = None
    evicted: list[str] = field(default_factory=list)
    program_hash: str | None = None
    #: dynamic steering of this request (None without policies): `policies` (their JSON),
    #: `trace` (per policy, one entry per scored position: position, score, threshold,
    #: engaged, scale), `actions` applied, `latched` per policy, `conversation_id`
    dynamic: dict | None = None
    #: a segmented request's scores (`engine_ext.worker.segments`): `positions`, `ids`, and
    #: `logprobs` (one list per position, in `ids` order); None for other requests
    segment_scores: dict | None = None

    @property
    def voided(self) -> bool:
        return self.status != "ok"


@dataclass
class GenerationDelta:
    """What one engine step added to a request's output (for streaming)."""

    token_ids: list[int]
    text: str
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    finished: bool
    finish_reason: str | None = None
    #: per generated token: logprobs of the requested score token ids
    scores: list[dict[int, float]] = field(default_factory=list)
    intervention: InterventionResult | None = None
    #: prompt tokens whose KV came from the prefix cache (reported with the last delta)
    num_cached_tokens: int | None = None


@dataclass
class Generation:
    """A finished generation. `logprobs[i]` is the logprob of `token_ids[i]` under the model's
    (unprocessed) distribution at that step (empty unless `GenerationParams.logprobs` was set);
    `top_logprobs[i]` holds the requested top-k."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    scores: list[dict[int, float]] = field(default_factory=list)
    intervention: InterventionResult | None = None
    #: prompt tokens whose KV came from the prefix cache instead of being computed
    num_cached_tokens: int = 0

    def extend(self, delta: GenerationDelta) -> None:
        self.token_ids.extend(delta.token_ids)
        self.text += delta.text
        self.logprobs.extend(delta.logprobs)
        self.top_logprobs.extend(delta.top_logprobs)
        self.scores.extend(delta.scores)
        if delta.finished:
            self.finish_reason = delta.finish_reason
        if delta.intervention is not None:
            self.intervention = delta.intervention
        if delta.num_cached_tokens is not None:
            self.num_cached_tokens = delta.num_cached_tokens

    @property
    def captures(self) -> dict:
        return self.intervention.captures if self.intervention else {}

    def to_dict(self) -> dict:
        d = asdict(self)
        d["top_logprobs"] = [{str(k): v for k, v in t.items()} for t in self.top_logprobs]
        d["scores"] = [{str(k): v for k, v in t.items()} for t in self.scores]
        if self.intervention is not None:
            iv = self.intervention
            d["intervention"] = {"status": iv.status, "errors": iv.errors, "stored_as": iv.stored_as,
                                 "evicted": iv.evicted, "program_hash": iv.program_hash, "dynamic": iv.dynamic,
                                 "captures": [{"layer": k[0], "hook": k[1], "position": k[2], "value": v.tolist()}
                                              for k, v in sorted(iv.captures.items())]}
        return d
