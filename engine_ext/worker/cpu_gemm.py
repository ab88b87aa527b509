"""Row-invariant CPU linear layers: a row's output does not depend on how many rows share the call.

Why: causalboard's exactness claims (a sweep cell equals the same cell run alone; a cell that
reuses the prompt's cached KV equals one computed from scratch) need every kernel of the forward
to give a row the same bits whatever it is batched with. On the CPU the kernel that is not always
so is the GEMM: on hosts with AVX2 and no AVX-512, oneDNN's fp32 `onednn_mm` (vLLM's CPU linear)
picks its blocking from the row count M, and rows differ by ~1e-5 between, say, M=7 and M=64
(`benchmarks/diag/gemm_row_invariance.py`). On the hosts of earlier CI runs (their ISA was not
recorded) the bit-for-bit tests passed with vLLM's kernels as they are.

What: `make_row_invariant(layer, n, k)` runs after vLLM chose the layer's CPU kernel
(`layer.cpu_linear`, set by `dispatch_cpu_unquantized_gemm`, wrapped in the seam) and probes it
on this host, with this process's threads:

* **native** — the kernel already gives equal rows for every probed M: left alone (no cost);
* **chunked** (`CHUNK_ROWS` = 16) — otherwise every call is split into calls of exactly 16 rows
  (the tail padded with zeros), so the kernel always sees one shape; used when that is also
  invariant to a row's place in its chunk (probed: all 16 rotations). The bulk of a long input
  goes in calls of `BULK_ROWS` where the probe found those give every row the 16-row calls' bits;
* **per_row** — else one call per row (each call is then the same shape by construction).

The probe compares rows of a `PROBE_ROWS`-row product with the same rows computed in smaller
calls (`PROBE_MS`), so "native" is an observation on those sizes, not a proof for every M. The
per-row form is invariant by construction (every call has one shape); the chunked form's 16-row
calls too, once the rotation probe passed, and its bulk calls give the same bits as those (probed
on random rows: a kernel path that differs shows on them, as the probe's failures show).
Decisions are cached per (kernel kind, N, K, dtype) in the process; the seam counts them per
engine (`WorkerState.cpu_gemm`), which the engine reports (`EngineInfo.cpu_gemm`).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any, Callable

import torch

#: rows per call of the chunked form (16 is invariant to a row's place in the chunk on the AVX2
#: host measured; 8 and 32 were not — the rotation probe checks it on every host)
CHUNK_ROWS = 16
#: larger calls the chunked form uses for the bulk of a long input, each only where the probe found
#: its rows equal to those of 16-row calls bit for bit (on the AVX2 host 64 and 256 were, for the
#: bundled model's shapes and for 2048 x 2048; 32 and 384 were not): fewer calls, same values
BULK_ROWS = (256, 64)
#: the probe's reference call and the smaller calls compared with it
PROBE_ROWS = 64
PROBE_MS = (1, 2, 3, 4, 5, 7, 8, 9, 13, 15, 16, 17, 31, 33, 47, 63)

NATIVE, CHUNKED, PER_ROW = "native", "chunked", "per_row"

_lock = threading.Lock()
#: (kernel, N, K, dtype) -> (form, call sizes)
_modes: dict[tuple, tuple[str, tuple[int, ...]]] = {}

Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def _in_calls(inner: Linear, sizes: tuple[int, ...], x: torch.Tensor, weight, bias) -> torch.Tensor:
    """`inner` over `x` in calls of exactly one of `sizes` rows (descending): as many calls of
    each size as fit, the rest in one call of the last size padded with zeros."""
    x2 = x.reshape(-1, x.shape[-1])
    m = x2.shape[0]
    parts, i = [], 0
    for size in sizes:
        while m - i >= size:
            parts.append(inner(x2[i:i + size], weight, bias))
            i += size
    if i < m:
        padded = x2.new_zeros((sizes[-1], x2.shape[1]))
        padded[:m - i] = x2[i:]
        parts.append(inner(padded, weight, bias)[:m - i])
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _native_invariant(inner: Linear, x: torch.Tensor, weight, bias) -> bool:
    ref = inner(x, weight, bias)
    return all(torch.equal(inner(x[:m].contiguous(), weight, bias), ref[:m]) for m in PROBE_MS)


def _rotation_invariant(inner: Linear, x: torch.Tensor, weight, bias) -> bool:
    chunk = x[:CHUNK_ROWS].contiguous()
    ref = inner(chunk, weight, bias)
    return all(torch.equal(inner(torch.roll(chunk, s, 0), weight, bias), torch.roll(ref, s, 0))
               for s in range(1, CHUNK_ROWS))


def _bulk_sizes(inner: Linear, k: int, dtype: torch.dtype, gen: torch.Generator, weight, bias) -> tuple[int, ...]:
    """The `BULK_ROWS` sizes whose calls give every row (at every place of the call, twice) the
    bits 16-row calls give it."""
    x = torch.randn(2 * max(BULK_ROWS), k, generator=gen).to(dtype)
    ref = _in_calls(inner, (CHUNK_ROWS,), x, weight, bias)
    return tuple(b for b in BULK_ROWS if torch.equal(_in_calls(inner, (b, CHUNK_ROWS), x, weight, bias), ref))


def choose_mode(inner: Linear, k: int, dtype: torch.dtype, weight, bias) -> tuple[str, tuple[int, ...]]:
    """Probe `inner` (a CPU linear taking (x, weight, bias)) on random inputs of width `k`: its
    form and the call sizes that form uses (none for `native`)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(PROBE_ROWS, k, generator=gen).to(dtype)
    with torch.inference_mode():
        if _native_invariant(inner, x, weight, bias):
            return NATIVE, ()
        if _rotation_invariant(inner, x, weight, bias):
            return CHUNKED, (*_bulk_sizes(inner, k, dtype, gen, weight, bias), CHUNK_ROWS)
    return PER_ROW, (1,)


def make_row_invariant(layer: Any, n: int, k: int, dtype: torch.dtype) -> str:
    """Give `layer.cpu_linear` (set by vLLM's CPU GEMM dispatch) the row-invariant form this host
    needs; returns the form. The probe runs once per (kernel, N, K, dtype) in this process."""
    inner = layer.cpu_linear
    weight, bias = layer.weight, getattr(layer, "bias", None)
    code = getattr(inner, "__code__", None)  # vLLM's kernels are lambdas of one function: tell them apart by line
    key = (getattr(inner, "__qualname__", type(inner).__name__), code.co_firstlineno if code else 0, n, k, dtype)
    with _lock:
        found = _modes.get(key)
    if found is None:
        found = choose_mode(inner, k, dtype, weight, bias)
        with _lock:
            _modes[key] = found
    mode, sizes = found
    if mode != NATIVE:
        layer.cpu_linear = _row_invariant_linear(layer, inner, sizes, n)
    return mode


# ---- the wrapped kernel, eager and compiled ------------------------------------------------------
#: kernels wrapped in this process and still in use, by id: (vLLM's kernel, call sizes, output
#: width N); an entry goes with its layer (a closed engine's kernels and weights are not kept)
_KERNELS: dict[int, tuple[Linear, tuple[int, ...], int]] = {}
_kernel_ids = itertools.count()
OP_NAME = "causalboard_cpu_linear"


def _op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernel: int) -> torch.Tensor:
    inner, sizes, _ = _KERNELS[kernel]
    return _in_calls(inner, sizes, x, weight, bias)


def _op_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernel: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], _KERNELS[kernel][2]))


def _register_op() -> None:
    """`torch.ops.vllm.causalboard_cpu_linear`: the wrapped kernel as one op, opaque to Dynamo, for
    compiled CPU engines (a loop over a symbolic row count cannot be traced)."""
    if hasattr(torch.ops.vllm, OP_NAME):
        return
    from vllm.utils.torch_utils import direct_register_custom_op

    direct_register_custom_op(OP_NAME, _op, mutates_args=[], fake_impl=_op_fake)


def _row_invariant_linear(layer: Any, inner: Linear, sizes: tuple[int, ...], n: int) -> Linear:
    """`inner` (the kernel of `layer`) in calls of `sizes` rows: called directly in eager mode,
    through the custom op while Dynamo traces (compiled engines)."""
    with _lock:
        _register_op()
        kernel = next(_kernel_ids)
        _KERNELS[kernel] = (inner, sizes, n)
    weakref.finalize(layer, _KERNELS.pop, kernel, None)

    def cpu_linear(x, weight, bias):
        if torch.compiler.is_compiling():
            return getattr(torch.ops.vllm, OP_NAME)(x, weight, bias, kernel)
        return _in_calls(inner, sizes, x, weight, bias)

    return cpu_linear
