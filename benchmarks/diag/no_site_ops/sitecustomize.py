"""Diagnosis only (issue 13: where batch-1 decode loses to stock vLLM): run causalboard's engine
with some or all of its site ops left out of the decoder layers, without changing causalboard's
code, to measure what the ops' launches cost. Interventions at the left-out sites do nothing
while this is on: never use it outside a benchmark. Put this folder first on PYTHONPATH:

    CB_DIAG_NO_SITE_OPS=all VLLM_DISABLE_COMPILE_CACHE=1 PYTHONPATH=benchmarks/diag/no_site_ops:$PYTHONPATH \\
        python3 benchmarks/compare/cb_bench.py --tasks p2 ...

(`VLLM_DISABLE_COMPILE_CACHE=1`: a graph compiled by an earlier run with every op must not be
loaded from vLLM's compile cache.)

Python imports `sitecustomize` at start-up in every process, vLLM's spawned engine core included;
with `CB_DIAG_NO_SITE_OPS` set, right after `engine_ext.worker.seam` loads, its layer helpers
(`_pre_attn_sites`, `_post_attn_sites`) are replaced:

  all     no site op at all (the layer is vLLM's own forward): the ceiling any change to the ops
          could reach;
  merged  the ops one merged launch per layer would absorb are left out — `mlp_out` and every
          `pre_attn` but layer 0's (the same point of the stream as the previous layer's
          `post_block`): per layer `post_attn`, `mlp_in` and `post_block` remain (3 launches per
          layer + 1, against 5 per layer), what a kernel handling `mlp_out`, `post_block` and the
          next `pre_attn` in one launch would leave.

A line `causalboard diag: site ops left out (...)` goes to stderr in each process it applies in.
"""
import os

_MODE = os.environ.get("CB_DIAG_NO_SITE_OPS", "")
if _MODE:
    import importlib.util
    import sys

    if _MODE not in ("all", "merged"):
        raise SystemExit(f"CB_DIAG_NO_SITE_OPS: expected all or merged, got {_MODE!r}")

    def _patch_seam(seam) -> None:
        import torch

        def pre_attn_sites(layer, hidden_states, residual):
            if residual is None:
                if _MODE == "merged":  # layer 0's pre_attn stays
                    torch.ops.vllm.causalboard_embed_site(hidden_states, layer._cb_state,
                                                          layer._cb_layer * seam.SITES_PER_LAYER + seam._PRE_ATTN)
                return layer.input_layernorm(hidden_states), hidden_states
            return layer.input_layernorm(hidden_states, residual)

        def post_attn_sites(layer, attn_out, residual, mlp_scale=None):
            sid, base = layer._cb_state, layer._cb_layer * seam.SITES_PER_LAYER
            keep = _MODE == "merged"
            if keep:
                torch.ops.vllm.causalboard_site(attn_out, residual, sid, base + seam._POST_ATTN)
            hidden_states, residual = layer.post_attention_layernorm(attn_out, residual)
            if keep:
                torch.ops.vllm.causalboard_embed_site(hidden_states, sid, base + seam._MLP_IN)
            hidden_states = layer.mlp(hidden_states)
            if mlp_scale is not None:
                hidden_states = seam._times_layer_scale(hidden_states, mlp_scale)
            if keep:
                torch.ops.vllm.causalboard_site(hidden_states, residual, sid, base + seam._POST_BLOCK)
            return hidden_states, residual

        seam._pre_attn_sites = pre_attn_sites
        seam._post_attn_sites = post_attn_sites
        print(f"causalboard diag: site ops left out ({_MODE}) in pid {os.getpid()}", file=sys.stderr, flush=True)

    # benchmarks/diag/after_import.py, loaded by its path (only this folder is on sys.path)
    _spec = importlib.util.spec_from_file_location(
        "_cb_diag_after_import", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "after_import.py"))
    _spec.loader.exec_module(_after := importlib.util.module_from_spec(_spec))
    _after.patch_after_import({"engine_ext.worker.seam": _patch_seam})
