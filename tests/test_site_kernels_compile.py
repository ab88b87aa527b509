"""Fast tier (no GPU needed): the CUDA site kernels (`engine_ext/worker/site_kernels.py`) compile
ahead of time for an H100 (sm_90) with the Triton of the pinned environment and its bundled
`ptxas`, for every specialisation the engine launches (a pair site and a branch site; the merged
call with and without the next layer's `pre_attn`), with bf16 streams as on the GPU. A kernel that
only a GPU machine could have found not to compile fails here instead."""

from __future__ import annotations

import inspect

import pytest

triton = pytest.importorskip("triton")

POINTERS_OF_THE_STREAM = {"x_ptr", "r_ptr", "px_ptr", "pr_ptr", "capx_ptr", "capr_ptr"}
INT_TABLES = {"row_slot_ptr", "cap_dst_ptr", "mode_ptr", "adim_ptr", "sclamp_ptr", "sgate_ptr"}


def _compile(fn, constexprs: dict):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(fn.fn).parameters)
    signature = {}
    for name in names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in POINTERS_OF_THE_STREAM:
            signature[name] = "*bf16"
        elif name in INT_TABLES:
            signature[name] = "*i32"
        elif name.endswith("_ptr"):
            signature[name] = "*fp32"
        else:
            signature[name] = "i32"
    src = ASTSource(fn=fn, signature=signature,
                    constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "enable_fp_fusion": False})


@pytest.mark.parametrize("kernel, constexprs", [
    ("site_kernel", {"HAS_R": True}),
    ("site_kernel", {"HAS_R": False}),
    ("sites_kernel", {"HAS_N": True}),
    ("sites_kernel", {"HAS_N": False}),
], ids=["pair-site", "branch-site", "merged", "merged-last-layer"])
def test_the_site_kernels_compile_for_an_h100(kernel, constexprs):
    try:
        from triton.backends.nvidia.compiler import get_ptxas  # noqa: F401  (the bundled ptxas)
    except ImportError:
        pytest.skip("this Triton has no CUDA backend")
    from engine_ext.worker import site_kernels

    compiled = _compile(getattr(site_kernels, kernel), {**constexprs, "BLOCK": 2048, "PAIR": 1, "KC": 4})
    assert len(compiled.asm["cubin"]) > 10_000
    assert ".entry " + kernel in compiled.asm["ptx"]
