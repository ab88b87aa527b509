"""Shared model helpers: batched next-token logits and loading the saved model.

Contract: prompts are encoded with the bundled tokenizer (BOS prepended, no EOS),
right-padded, and run without an attention mask (causal attention never lets a real
token see the padding after it); the returned logits are those at each prompt's last
real token, in float32.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer
from transformers import LlamaForCausalLM

MODEL_DIR = Path("engine_ext/bundled/causalboard-tiny")


def encode_batch(tok: Tokenizer, texts: list[str], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids ``[N, T]`` (with BOS) and each text's length ``[N]``."""
    return pad_rows([e.ids for e in tok.encode_batch(texts)], pad_id)


def pad_rows(encs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id rows right-padded to ``[N, T]``, and each row's length ``[N]``."""
    lengths = torch.tensor([len(e) for e in encs])
    ids = torch.full((len(encs), int(lengths.max())), pad_id, dtype=torch.long)
    for i, e in enumerate(encs):
        ids[i, : len(e)] = torch.tensor(e)
    return ids, lengths


@torch.no_grad()
def last_token_logits(model: LlamaForCausalLM, tok: Tokenizer, prompts: list[str],
                      batch_size: int = 256) -> torch.Tensor:
    """Next-token logits ``[len(prompts), vocab]`` (float32) after each prompt."""
    device = next(model.parameters()).device
    pad_id = model.config.pad_token_id
    out = []
    for i in range(0, len(prompts), batch_size):
        ids, lengths = encode_batch(tok, prompts[i : i + batch_size], pad_id)
        logits = model(input_ids=ids.to(device), use_cache=False).logits
        out.append(logits[torch.arange(len(ids)), lengths.to(device) - 1].float().cpu())
    return torch.cat(out)


def load_model(model_dir: Path = MODEL_DIR) -> tuple[LlamaForCausalLM, Tokenizer]:
    """Load the saved (bf16) model as float32 in eval mode, and its tokenizer."""
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, Tokenizer.from_file(str(model_dir / "tokenizer.json"))
