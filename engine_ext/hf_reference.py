"""The Hugging Face transformers reference implementation (the test oracle).

Loads the same local weights with transformers and computes, with plain PyTorch, what the vLLM
engine must reproduce: greedy continuations and per-token logprobs (full recomputation each step,
no KV cache, so it is simple enough to trust).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .bundled import bundled_model_path


@dataclass
class ReferenceGeneration:
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    #: per step, the gap between the best and second-best logprob (to recognise near-ties)
    top2_gaps: list[float]


class HFReference:
    """A transformers model + tokenizer on CPU (float32 by default)."""

    def __init__(self, model_path: str | Path | None = None, dtype: str = "float32", device: str = "cpu"):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_path = Path(model_path) if model_path else bundled_model_path()
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=getattr(torch, dtype)).to(device).eval()
        self.device = device

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def logits(self, ids: list[int]) -> Any:
        """Next-token logits (float32) at every position of `ids`: shape [len(ids), vocab]."""
        import torch

        with torch.no_grad():
            x = torch.tensor([ids], device=self.device)
            return self.model(input_ids=x).logits[0].float()

    def greedy(self, prompt: str | list[int], max_tokens: int) -> ReferenceGeneration:
        import torch

        ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        prompt_ids = list(ids)
        out, lps, gaps = [], [], []
        eos = self.tokenizer.eos_token_id
        for _ in range(max_tokens):
            logp = torch.log_softmax(self.logits(ids)[-1], dim=-1)
            top2 = torch.topk(logp, 2)
            tid = int(top2.indices[0])
            out.append(tid)
            lps.append(float(top2.values[0]))
            gaps.append(float(top2.values[0] - top2.values[1]))
            ids.append(tid)
            if tid == eos:
                break
        return ReferenceGeneration(prompt_ids, out, lps, gaps)
