"""A tiny random-weight Qwen3-Next hybrid (gated delta-net + full attention), built locally.

`build_tiny_hybrid(out_dir)` writes a `Qwen3NextForCausalLM` with seeded random weights and the
bundled model's tokenizer (375-token vocabulary) to `out_dir` — no download. Geometry: hidden 128,
4 decoder layers (`linear_attention` x3, then `full_attention`), 4 routed experts (top-2) plus a
shared expert, full-attention head_dim 64, linear-attention 2 key / 4 value heads of 32. vLLM 0.25.1
serves it on CPU with `dtype="bfloat16"`, `enforce_eager=True` and `mamba_ssm_cache_dtype="float32"`
(`HYBRID_ENGINE_ARGS`).

    python -m engine_ext.models.tiny_hybrid /tmp/tiny-hybrid
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

#: the layer mix of the tiny hybrid (index 3 is the only full-attention layer)
LAYER_TYPES = ("linear_attention", "linear_attention", "linear_attention", "full_attention")

#: engine settings vLLM 0.25.1 needs to serve a Qwen3-Next hybrid on CPU
HYBRID_ENGINE_ARGS = {"dtype": "bfloat16", "enforce_eager": True, "mamba_ssm_cache_dtype": "float32"}


def tiny_hybrid_config(vocab_size: int) -> dict:
    """The config dict of the tiny hybrid (plain data: also what `config.json` holds)."""
    return dict(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=len(LAYER_TYPES),
        layer_types=list(LAYER_TYPES), num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
        linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=64, decoder_sparse_step=1, norm_topk_prob=True,
        max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        rms_norm_eps=1e-6, initializer_range=0.08,
    )


def build_tiny_hybrid(out_dir: str | Path, *, seed: int = 0, tokenizer_from: str | Path | None = None) -> Path:
    """Write the tiny hybrid (float32 weights, seeded) and a tokenizer to `out_dir`; return it.

    `tokenizer_from`: a model folder whose `tokenizer.json` / `tokenizer_config.json` are copied
    (default: the bundled model's); the vocabulary size follows that folder's `config.json`."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    from engine_ext.bundled import bundled_model_path

    src = Path(tokenizer_from) if tokenizer_from else bundled_model_path()
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    out = Path(out_dir)
    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(Qwen3NextConfig(**tiny_hybrid_config(vocab)))
    model.to(torch.float32).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, out / name)
    return out


if __name__ == "__main__":  # pragma: no cover - manual use
    print(build_tiny_hybrid(sys.argv[1] if len(sys.argv) > 1 else "tiny-hybrid"))
