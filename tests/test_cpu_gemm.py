"""Row-invariant CPU linear layers (engine_ext/worker/cpu_gemm.py): the probe picks the form a
kernel needs, and every form gives a row the same bits whatever the rows beside it.

The fakes stand for the kernel behaviours met on real hosts: one that is row-invariant (the earlier
CI hosts' kernels, judging by the bit-for-bit tests passing there), one whose rounding depends on
the row count (AVX2 oneDNN: `benchmarks/diag/gemm_row_invariance.py`), one whose rounding also
depends on a row's place in the call (AVX2 oneDNN in calls of 8 or 32 rows). The real-kernel test runs vLLM's own CPU dispatch on this host."""

import gc

import pytest
import torch

from engine_ext.worker import cpu_gemm


def _rowwise(x, w, b):
    """A kernel that computes each row on its own (invariant by construction)."""
    out = torch.stack([torch.mv(w, r) for r in x.reshape(-1, x.shape[-1])])
    out = out if b is None else out + b
    return out.reshape(*x.shape[:-1], w.shape[0])


def _count_dependent(x, w, b):
    """Rounds differently when the call's row count leaves a short tail (like AVX2 oneDNN)."""
    return _rowwise(x, w, b) + (1e-3 if x.reshape(-1, x.shape[-1]).shape[0] % 6 in (1, 2, 3) else 0.0)


def _place_dependent(x, w, b):
    """Also depends on a row's place in its call."""
    m = x.reshape(-1, x.shape[-1]).shape[0]
    return _count_dependent(x, w, b) + 1e-3 * (torch.arange(m) % 6 >= 4).float()[:, None]


def _layer(kernel, n=24, k=12, bias=True):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(n, k, generator=gen)
    layer = torch.nn.Module()  # what vLLM's layers are (the wrapper's bookkeeping follows the layer's life)
    layer.weight, layer.bias, layer.cpu_linear = w, (torch.randn(n, generator=gen) if bias else None), kernel
    return layer


def _rows_independent_of_the_call(layer, max_m=40) -> bool:
    x = torch.randn(max_m, layer.weight.shape[1], generator=torch.Generator().manual_seed(2))
    full = layer.cpu_linear(x, layer.weight, layer.bias)
    return all(torch.equal(layer.cpu_linear(x[:m].contiguous(), layer.weight, layer.bias), full[:m])
               for m in range(1, max_m)) and all(
        torch.equal(layer.cpu_linear(x[s:s + 7].contiguous(), layer.weight, layer.bias), full[s:s + 7]) for s in range(0, 30, 5))


@pytest.mark.parametrize("kernel,form", [(_rowwise, cpu_gemm.NATIVE), (_count_dependent, cpu_gemm.CHUNKED),
                                         (_place_dependent, cpu_gemm.PER_ROW)])
def test_the_probe_picks_the_form_each_kernel_needs_and_rows_no_longer_depend_on_their_call(kernel, form):
    layer = _layer(kernel)
    if kernel is not _rowwise:
        assert not _rows_independent_of_the_call(layer)  # the fake does show the fault
    assert cpu_gemm.make_row_invariant(layer, 24, 12, torch.float32) == form
    assert (layer.cpu_linear is kernel) == (form == cpu_gemm.NATIVE)
    assert _rows_independent_of_the_call(layer)


def test_calls_of_fixed_sizes_give_the_kernels_values_for_any_shape_with_or_without_bias():
    for bias in (True, False):
        layer = _layer(_rowwise, bias=bias)
        for shape in ((1, 12), (16, 12), (17, 12), (3, 5, 12), (2, 16, 12), (7, 13, 12)):
            x = torch.randn(*shape)
            for sizes in ((16,), (4, 16), (1,)):
                got = cpu_gemm._in_calls(_rowwise, sizes, x, layer.weight, layer.bias)
                assert got.shape == (*shape[:-1], 24)
                assert torch.allclose(got, _rowwise(x, layer.weight, layer.bias), atol=1e-6)


def test_vllms_own_cpu_kernel_on_this_host_is_made_row_invariant():
    """vLLM's CPU dispatch (oneDNN where available) on this host, then the probe: whatever form
    it picks, rows then equal the rows of a larger call bit for bit."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    torch.manual_seed(0)
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(torch.randn(96, 64) * 0.1, requires_grad=False)
    module.bias = None
    n, k = module.weight.shape
    dispatch_cpu_unquantized_gemm(module, remove_weight=False)
    form = cpu_gemm.make_row_invariant(module, n, k, torch.float32)
    assert form in (cpu_gemm.NATIVE, cpu_gemm.CHUNKED, cpu_gemm.PER_ROW)
    x = torch.randn(70, 64)
    full = module.cpu_linear(x, module.weight, None)
    assert torch.allclose(full, x @ module.weight.T, atol=1e-4)
    assert all(torch.equal(module.cpu_linear(x[:m].contiguous(), module.weight, None), full[:m]) for m in range(1, 70))


def test_the_engine_reports_the_form_of_every_linear_layer(engine):
    """The default CPU engine asks for batch invariance; its status counts each linear layer's form."""
    info = engine.info
    assert info.batch_invariant is True
    assert set(info.cpu_gemm) <= {cpu_gemm.NATIVE, cpu_gemm.CHUNKED, cpu_gemm.PER_ROW}
    # 8 decoder layers x (qkv, o, gate_up, down) + the tied embedding / LM head
    assert sum(info.cpu_gemm.values()) >= 8 * 4 + 1


def test_bulk_calls_are_used_only_where_they_give_the_16_row_calls_bits():
    """A kernel whose rounding depends on the call's size beyond the tail (64-row calls differ,
    256-row calls do not) gets 256-row bulk calls and 16-row calls, never 64-row ones."""
    def size_dependent(x, w, b):
        return _count_dependent(x, w, b) + (1e-3 if x.reshape(-1, x.shape[-1]).shape[0] == 64 else 0.0)

    layer = _layer(size_dependent, n=8, k=6)
    gen = torch.Generator().manual_seed(0)
    assert cpu_gemm._bulk_sizes(size_dependent, 6, torch.float32, gen, layer.weight, layer.bias) == (256,)
    cpu_gemm.make_row_invariant(layer, 8, 6, torch.float32)
    x = torch.randn(600, 6)
    full = layer.cpu_linear(x, layer.weight, layer.bias)
    assert all(torch.equal(layer.cpu_linear(x[:m].contiguous(), layer.weight, layer.bias), full[:m])
               for m in (1, 15, 16, 64, 65, 255, 256, 257, 320, 599))


def test_a_compiled_forward_calls_the_row_invariant_kernel_as_one_op_with_the_same_values():
    """Compiled CPU engines trace `cpu_linear` with a symbolic row count: the wrapped kernel is then
    one opaque op (`torch.ops.vllm.causalboard_cpu_linear`), whole graph, same values as eager."""
    layer = _layer(_count_dependent)
    assert cpu_gemm.make_row_invariant(layer, 24, 12, torch.float32) == cpu_gemm.CHUNKED
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: layer.cpu_linear(x, layer.weight, layer.bias) * 2.0, fullgraph=True,
                             dynamic=True, backend="eager")
    for m in (3, 17, 40):
        x = torch.randn(m, 12)
        assert torch.equal(compiled(x), layer.cpu_linear(x, layer.weight, layer.bias) * 2.0)


def test_a_wrapped_kernel_is_not_kept_once_its_layer_is_gone():
    """Engines started and closed in one process (tests, notebooks) must not pile up old layers'
    kernels (vLLM's oneDNN handlers hold the packed weights)."""
    before = len(cpu_gemm._KERNELS)
    layer = torch.nn.Module()
    layer.weight, layer.bias, layer.cpu_linear = torch.randn(24, 12), None, _count_dependent
    cpu_gemm.make_row_invariant(layer, 24, 12, torch.float32)
    assert len(cpu_gemm._KERNELS) == before + 1
    del layer
    gc.collect()
    assert len(cpu_gemm._KERNELS) == before
