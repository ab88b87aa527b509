"""Hybrid models (client side): engine settings and the sentinel 4-arm state check.

Hybrids (`seam.HYBRID_ARCHITECTURES`: Qwen3-Next) keep recurrent state per request besides the KV
cache; the worker zeroes each state slot when it is (re)allocated (`worker/state_hygiene.py`).
This module

* picks the vLLM settings a hybrid needs (`hybrid_engine_kwargs`) and refuses those that cannot be
  exact (`check_hybrid_config`): vLLM's prefix caching for hybrids ("all"/"align" Mamba cache
  modes) restores recurrent state saved at block boundaries; causalboard serves hybrids with
  prefix caching off, so every request computes its state from position 0;
* runs the sentinel check (`run_state_check`, `Engine.state_check`): the four arms
  {slots zeroed, slots sentinel-filled} x {has_initial_state mask intact, forced off} on the served
  model, each compared with a clean baseline, with the guard's marker per arm
  (docs/hybrid-models.md says what each arm proves).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

from engine_ext.errors import SpecError

#: the arms of the check, in report order: (name, hygiene mode, mask forced off)
ARMS: tuple[tuple[str, str, bool], ...] = (
    ("zeroed+mask", "zero", False),
    ("zeroed+mask_off", "zero", True),
    ("sentinel+mask", "sentinel", False),
    ("sentinel+mask_off", "sentinel", True),
)

#: what each arm must show on a hygienic engine: (outputs changed?, marker = slots zeroed?)
ARM_EXPECTED: dict[str, dict[str, bool]] = {
    "zeroed+mask": {"changed": False, "guard_fired": True},
    "zeroed+mask_off": {"changed": False, "guard_fired": True},
    "sentinel+mask": {"changed": True, "guard_fired": False},
    "sentinel+mask_off": {"changed": True, "guard_fired": False},
}

#: what each arm proves (also in docs/hybrid-models.md)
ARM_MEANING: dict[str, str] = {
    "zeroed+mask": "the guard as served: outputs equal the clean baseline and the guard fired once per new request",
    "zeroed+mask_off": "zeroing alone protects: even with vLLM's has_initial_state mask forced off, outputs are unchanged",
    "sentinel+mask": "the mask alone does not protect: stale state reaches requests the mask misses "
                     "(a 1-token prompt is scheduled as a decode and reads its slot)",
    "sentinel+mask_off": "the slots are really read: with the mask off every request sees the sentinel, so "
                         "the unchanged outputs of the zeroed arms are the guard's doing, not an unread slot",
}

_EXCLUSIVE_LOCK = threading.Lock()


def hybrid_engine_kwargs(device: str) -> dict[str, Any]:
    """vLLM settings a hybrid is served with (the user's `engine_kwargs` still win)."""
    kwargs: dict[str, Any] = {"enable_prefix_caching": False, "mamba_cache_mode": "none"}
    if device == "cpu":
        # the CPU gated delta-net kernels keep the SSM state in float32 ("Input tensor dtype mismatch" otherwise)
        kwargs["mamba_ssm_cache_dtype"] = "float32"
    return kwargs


def hybrid_dtype(device: str, requested: str | None, default: str) -> str:
    """The dtype a hybrid is served in: on CPU vLLM 0.25.1's gated delta-net kernels
    (`causal_conv1d_fwd_kernel_impl`) exist for bfloat16 only, so the CPU default (float32) becomes
    bfloat16 and an explicit float32 is refused."""
    if device != "cpu":
        return requested or default
    if requested in (None, "auto"):
        return "bfloat16"
    if requested in ("float32", "float", "fp32"):
        raise SpecError("dtype", "vLLM 0.25.1's CPU kernels for hybrid (gated delta-net) layers run in bfloat16 only "
                                 "(causal_conv1d_fwd_kernel_impl is not implemented for float32); use dtype='bfloat16'")
    return requested


def check_hybrid_config(config: Any) -> None:
    """Refuse settings under which a hybrid's interventions or state hygiene cannot be exact."""
    kw = dict(config.engine_kwargs or {})
    if kw.get("enable_prefix_caching"):
        raise SpecError("engine_kwargs", "enable_prefix_caching: vLLM's prefix caching for hybrid models restores "
                                         "recurrent state saved at block boundaries, which causalboard's zero-on-realloc "
                                         "guard and KV salting do not cover; hybrids are served without it")
    if kw.get("mamba_cache_mode", "none") != "none":
        raise SpecError("engine_kwargs", f"mamba_cache_mode={kw['mamba_cache_mode']!r}: only 'none' is supported for hybrids "
                                         "(every request computes its recurrent state from position 0)")
    if kw.get("speculative_config"):
        raise SpecError("engine_kwargs", "speculative_config: speculative decoding on hybrids is not supported by causalboard")
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").strip().lower() in ("1", "true", "yes"):
        # vLLM 0.25.1 serves hybrids with the V1 runner by default; the zero-on-realloc guard is a
        # V1 patch (seam `_wrap_v1_update_states`)
        raise SpecError("VLLM_USE_V2_MODEL_RUNNER", "the V2 model runner is not supported for hybrid models "
                                                    "(the recurrent-state guard patches the V1 runner); unset it")


def default_probes(engine: Any) -> list[list[int]]:
    """Probe prompts: a 1-token prompt (the case vLLM's mask misses), a short and a longer prompt."""
    ids = engine.tokenize("The capital of Tarn is")
    bos = ids[:1] if ids else [1]
    return [bos, ids[:3], ids]


def _outputs(engine: Any, probes: Sequence[Sequence[int]], max_tokens: int) -> list[dict]:
    from engine_ext.generation import GenerationParams

    params = GenerationParams(max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    return [{"token_ids": list(g.token_ids), "logprobs": [float(x) for x in g.logprobs]}
            for g in (engine.generate(list(p), params) for p in probes)]


def _dirty(engine: Any, fillers: Sequence[Sequence[int]], max_tokens: int) -> None:
    """Requests that run before each probe, so its slot has had a previous owner."""
    from engine_ext.generation import GenerationParams

    for f in fillers:
        engine.generate(list(f), GenerationParams(max_tokens=max_tokens, ignore_eos=True))


def run_state_check(engine: Any, probes: Sequence[Sequence[int]] | None = None, *, max_tokens: int = 4,
                    sentinel_std: float = 1.0, seed: int = 0) -> dict:
    """The sentinel 4-arm check on a served hybrid. The arms switch the worker's hygiene mode for
    every request while they run (restored afterwards), so the check holds the engine: requests
    already admitted get 5 s to finish, and other threads' new requests are refused (`SpecError`
    on `engine`) until it ends.

    Baseline: each probe with the guard on. Per arm: filler requests (so the probe's slot had a
    previous owner), then the probe; a probe *changed* when its greedy tokens or any logprob
    differ from the baseline; the marker is the guard's zero count (and the sentinel's fill
    count) in that arm."""
    if not getattr(engine, "is_hybrid", False):
        raise SpecError("model", f"{engine.info.architecture} keeps no recurrent state; the state check applies to hybrid "
                                 "models only")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 1 <= max_tokens <= 64:
        raise SpecError("max_tokens", f"must be an integer in [1, 64], got {max_tokens!r}")
    if not sentinel_std > 0:
        raise SpecError("sentinel_std", f"must be > 0, got {sentinel_std!r}")
    probes = [list(map(int, p)) for p in (probes if probes is not None else default_probes(engine))]
    if not probes or any(not p for p in probes):
        raise SpecError("probes", "give at least one non-empty token-id prompt")
    vocab = engine.info.vocab_size
    if any(not 0 <= t < vocab for p in probes for t in p):
        raise SpecError("probes", f"token ids must be in [0, {vocab})")
    fillers = [[(7 * i + 11 * j + 3) % vocab for j in range(5 + 3 * i)] for i in range(3)]

    def rpc(**kw: Any) -> dict:
        return engine._rpc("cb_state_hygiene", kw)[0]

    with _exclusive(engine):
        return _run_arms(engine, probes, fillers, rpc, max_tokens=max_tokens, sentinel_std=sentinel_std, seed=seed)


@contextlib.contextmanager
def _exclusive(engine: Any, wait_s: float = 5.0):
    """Hold the engine for this thread: other threads' new requests are refused meanwhile, and the
    requests already admitted get `wait_s` to finish (else the check is refused)."""
    with _EXCLUSIVE_LOCK:
        if engine._exclusive_owner is not None:
            raise SpecError("engine", "a state check is already running on this engine")
        engine._exclusive_owner = threading.get_ident()
    try:
        deadline = time.monotonic() + wait_s
        while engine.in_flight:
            if time.monotonic() > deadline:
                raise SpecError("engine", f"{engine.in_flight} request(s) in flight: the state check switches the hygiene "
                                          "mode of every request and needs an idle engine")
            time.sleep(0.02)
        yield
    finally:
        engine._exclusive_owner = None


def _run_arms(engine: Any, probes: list[list[int]], fillers: list[list[int]], rpc: Any, *, max_tokens: int,
              sentinel_std: float, seed: int) -> dict:
    previous = rpc()
    t0 = time.perf_counter()
    arms = []
    try:
        rpc(mode="zero", mask_off=False, sentinel_std=sentinel_std, sentinel_seed=seed, reset=True)
        baseline = _outputs(engine, probes, max_tokens)  # first requests on fresh slots where possible
        for name, mode, mask_off in ARMS:
            rpc(mode=mode, mask_off=mask_off, reset=True)
            results = []
            for probe, base in zip(probes, baseline):
                _dirty(engine, fillers, max_tokens)
                out = _outputs(engine, [probe], max_tokens)[0]
                diff = max((abs(a - b) for a, b in zip(out["logprobs"], base["logprobs"])), default=0.0)
                results.append({"prompt_token_ids": probe, "token_ids": out["token_ids"],
                                "baseline_token_ids": base["token_ids"],
                                "changed": out["token_ids"] != base["token_ids"] or diff > 0.0,
                                "max_logprob_diff": float(diff)})
            counters = rpc(reset=True)
            changed = any(r["changed"] for r in results)
            arms.append({"arm": name, "slots": "zeroed" if mode == "zero" else "sentinel", "mask": "off" if mask_off else "intact",
                         "changed": changed, "guard_fired": counters["slots_zeroed"] > 0,
                         "slots_zeroed": counters["slots_zeroed"], "slots_filled": counters["slots_filled"],
                         "expected": ARM_EXPECTED[name],
                         "as_expected": changed == ARM_EXPECTED[name]["changed"]
                         and (counters["slots_zeroed"] > 0) == ARM_EXPECTED[name]["guard_fired"],
                         "meaning": ARM_MEANING[name], "probes": results})
    finally:
        rpc(mode=previous["mode"], mask_off=False, sentinel_std=previous["sentinel_std"])
    zero_ok = all(a["as_expected"] for a in arms if a["slots"] == "zeroed")
    sentinel_read = all(a["changed"] for a in arms if a["slots"] == "sentinel" and a["mask"] == "off")
    return {
        "model": engine.info.model, "architecture": engine.info.architecture, "dtype": engine.info.dtype,
        "device": engine.info.device, "max_tokens": max_tokens, "sentinel_std": sentinel_std, "seed": seed,
        "probes": probes, "baseline": [{"prompt_token_ids": p, **b} for p, b in zip(probes, baseline)],
        "arms": arms,
        # the verdict a user acts on: zeroed arms unchanged with the marker, and the sentinel really read
        "hygienic": bool(zero_ok and sentinel_read),
        "mask_misses": [a["probes"][i]["prompt_token_ids"] for a in arms if a["arm"] == "sentinel+mask"
                        for i in range(len(probes)) if a["probes"][i]["changed"]],
        "seconds": round(time.perf_counter() - t0, 2),
    }


def state_hygiene_status(engine: Any) -> dict:
    """The guard's counters on the (first) worker: mode, slots zeroed, seconds spent zeroing."""
    return engine._rpc("cb_state_hygiene", {})[0]
