"""Recurrent-state hygiene for hybrid models (worker side): zero-on-realloc and the sentinel arms.

A hybrid model (Qwen3-Next: gated delta-net layers beside full attention) keeps, per request, a
*recurrent state slot* in every linear-attention layer: a conv state and an SSM state, rows of the
layer's `kv_cache = [conv_state, ssm_state]` tensors indexed by the request's block id in the
Mamba KV-cache group. vLLM 0.25.1 hands a freed slot to the next request without clearing it and
relies on a `has_initial_state` mask (`context_lens > 0`) to ignore what is there. The mask covers
prefills only: a new request whose prompt is **one token** is scheduled as a decode, and the decode
kernels read the slot unconditionally — the previous owner's state leaks into its output.

The guard: when the V1 runner registers a request that starts from scratch (a new request, or one
resumed after preemption, which vLLM recomputes from position 0), every recurrent-state row of its
Mamba-group blocks is set to zero — exactly the initial state of a fresh sequence — before the
forward reads it. The seam calls `on_update_states` from its wrapper of
`GPUModelRunner._update_states` (the CPU runner inherits it).

Modes (per worker; `set_mode`, through the `cb_state_hygiene` RPC):

* `zero` (default): the guard. Counts `slots_zeroed` (the guard's marker) and the seconds spent.
* `sentinel`: instead of zeroing, fill the same rows with seeded Gaussian noise (`sentinel_std`)
  — a stand-in for the worst stale state a previous owner could leave. Counts `slots_filled`.
  Only the sentinel check uses it.
* `off`: stock vLLM (no guard).

`mask_off` additionally forces the GDN metadata's `has_initial_state` masks to all-true (seam wrapper
of `GDNAttentionMetadataBuilder.build`), so every prefill reads its slot as if it continued an
earlier sequence: with `zero` the output must not change (zeroing alone protects); with
`sentinel` it must (the slots are really read). This is what the 4-arm check
(`engine_ext.engine.hybrid.run_state_check`) combines.

Only `mamba_cache_mode="none"` (no prefix caching for the hybrid) is supported: with Mamba prefix
caching ("all"/"align") a request's blocks carry copied state by design, and the facade refuses it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

MODES = ("zero", "sentinel", "off")

#: process-wide: force the GDN `has_initial_state` masks on (only the sentinel check sets it)
_MASK_OFF = threading.Event()


@dataclass
class Hygiene:
    """The guard's state on one model runner."""

    mode: str = "zero"
    sentinel_std: float = 1.0
    sentinel_seed: int = 0
    #: (Mamba group, block) pairs zeroed / sentinel-filled: one per state group per fresh request
    slots_zeroed: int = 0
    slots_filled: int = 0
    seconds: float = 0.0
    events: int = 0
    #: (conv, ssm) tensors of every Mamba-group layer, per group id (found lazily)
    tensors: dict[int, list[Any]] | None = None
    _fills: int = field(default=0, repr=False)

    def counters(self) -> dict:
        return {"mode": self.mode, "mask_off": _MASK_OFF.is_set(), "slots_zeroed": self.slots_zeroed,
                "slots_filled": self.slots_filled, "events": self.events, "seconds": self.seconds,
                "sentinel_std": self.sentinel_std, "state_layers": sum(len(v) for v in (self.tensors or {}).values()) // 2,
                "state_groups": len(self.tensors or {})}


def hygiene_of(runner: Any) -> Hygiene:
    h = getattr(runner, "_cb_hygiene", None)
    if h is None:
        h = Hygiene()
        runner._cb_hygiene = h
    return h


def _state_tensors(runner: Any, h: Hygiene) -> dict[int, list[Any]]:
    """group id -> the conv/ssm state tensors of that Mamba group's layers (deduplicated)."""
    if h.tensors is not None:
        return h.tensors
    import torch
    from vllm.v1.kv_cache_interface import MambaSpec

    out: dict[int, list[Any]] = {}
    cfg = getattr(runner, "kv_cache_config", None)
    if cfg is None:
        return out  # KV caches not allocated yet: nothing can be stale
    ctx = runner.compilation_config.static_forward_context
    for gid, group in enumerate(cfg.kv_cache_groups):
        if not isinstance(group.kv_cache_spec, MambaSpec):
            continue
        seen: set[int] = set()
        tensors: list[Any] = []
        for name in group.layer_names:
            layer = ctx.get(name)
            for t in getattr(layer, "kv_cache", None) or ():
                if isinstance(t, torch.Tensor) and t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    tensors.append(t)
        out[gid] = tensors
    h.tensors = out
    return out


def fresh_state_blocks(scheduler_output: Any, groups: Any) -> dict[int, list[int]]:
    """Per Mamba group, the block ids of every request this step starts from position 0: new
    requests and requests resumed after preemption (whose blocks vLLM replaces)."""
    ids: dict[int, set[int]] = {gid: set() for gid in groups}
    for req in scheduler_output.scheduled_new_reqs:
        for gid in groups:
            ids[gid].update(req.block_ids[gid])
    cached = scheduler_output.scheduled_cached_reqs
    resumed = getattr(cached, "resumed_req_ids", None) or ()
    if resumed:
        for rid, new in zip(cached.req_ids, cached.new_block_ids):
            if rid in resumed and new is not None:
                for gid in groups:
                    ids[gid].update(new[gid])
    return {gid: sorted(b) for gid, b in ids.items() if b}


def on_update_states(runner: Any, scheduler_output: Any) -> None:
    """Seam hook, before vLLM's `_update_states`: zero (or, in the sentinel check, fill) the
    recurrent-state rows of every request that starts from scratch this step."""
    h = hygiene_of(runner)
    if h.mode == "off":
        return
    groups = _state_tensors(runner, h)
    if not groups:
        return
    fresh = fresh_state_blocks(scheduler_output, groups)
    if not fresh:
        return
    import torch

    t0 = time.perf_counter()
    for gid, blocks in fresh.items():
        tensors = groups[gid]
        if not tensors:
            continue
        device = tensors[0].device
        # the state tensors are strided views into the shared KV pages: on CPU `index_fill_`
        # walks the whole view (~110 ms for 64 rows x 6 tensors of the tiny hybrid), a per-row
        # `zero_` touches only the rows (~1 ms); on CUDA one indexed kernel per tensor
        index = torch.tensor(blocks, dtype=torch.long, device=device) if device.type != "cpu" else None
        if h.mode == "zero":
            for t in tensors:
                if index is None:
                    for b in blocks:
                        t[b].zero_()
                else:
                    t.index_fill_(0, index, 0)
            h.slots_zeroed += len(blocks)
        else:
            for t in tensors:
                gen = torch.Generator(device="cpu").manual_seed(h.sentinel_seed * 1_000_003 + h._fills)
                h._fills += 1
                noise = torch.randn((len(blocks), *t.shape[1:]), generator=gen, dtype=torch.float32) * h.sentinel_std
                noise = noise.to(device=t.device, dtype=t.dtype)
                for j, b in enumerate(blocks):
                    t[b].copy_(noise[j])
            h.slots_filled += len(blocks)
    # no device sync: on CUDA the zeroing is stream-ordered before the forward, and `seconds`
    # counts host time only (enqueueing the kernels)
    h.seconds += time.perf_counter() - t0
    h.events += 1


def on_gdn_metadata(metadata: Any) -> Any:
    """Seam hook, after `GDNAttentionMetadataBuilder.build`: with `mask_off`, every prefill is
    told its slot holds an initial state (so it reads whatever the slot holds)."""
    if not _MASK_OFF.is_set():
        return metadata
    for name in ("has_initial_state", "prefill_has_initial_state"):
        mask = getattr(metadata, name, None)
        if mask is not None:
            setattr(metadata, name, mask.new_ones(mask.shape))
    return metadata


def set_mode(runner: Any, mode: str | None = None, *, mask_off: bool | None = None, sentinel_std: float | None = None,
             sentinel_seed: int | None = None, reset: bool = False) -> dict:
    """Change the guard's mode / the mask override on this worker; return the counters (before a
    reset, then reset them when `reset`)."""
    h = hygiene_of(runner)
    if mode is not None:
        if mode not in MODES:
            raise ValueError(f"unknown state-hygiene mode {mode!r}; expected one of {', '.join(MODES)}")
        h.mode = mode
    if sentinel_std is not None:
        h.sentinel_std = float(sentinel_std)
    if sentinel_seed is not None:
        h.sentinel_seed, h._fills = int(sentinel_seed), 0
    if mask_off is not None:
        (_MASK_OFF.set if mask_off else _MASK_OFF.clear)()
    _state_tensors(runner, h)
    out = h.counters()
    if reset:
        h.slots_zeroed = h.slots_filled = h.events = 0
        h.seconds = 0.0
    return out
