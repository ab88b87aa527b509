"""GPU foundation check: start the `Engine` facade on a model and measure start-up and throughput.

Run on the GPU host (after `source .vbundle/gpu_env.sh`), one engine per process:

    python3 benchmarks/gpu_check.py --model bundled --mode eager  --out $OUT/bundled-eager.json
    python3 benchmarks/gpu_check.py --model llama-1b --mode graphs --out $OUT/llama1b-graphs.json

`--model llama-1b` first builds a random-weight model with Llama-3.2-1B's shape (hidden 2048,
16 layers, 32 heads / 8 KV heads, MLP 8192, vocab 128256, tied embeddings, bf16) into a scratch
folder on the host, with a synthetic 128256-entry word-level tokenizer (no hub access there).
Throughput = generated tokens / wall time for greedy decoding with `ignore_eos`, batch 1 and 32.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LLAMA_1B = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=4096,
    rope_theta=500000.0, tie_word_embeddings=True, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1,
)


def build_random_llama(folder: Path) -> Path:
    """Random-weight Llama-3.2-1B-shaped model + synthetic tokenizer, built on the GPU."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    t0 = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    vocab = {"<bos>": 0, "<eos>": 1, "<unk>": 2}
    vocab.update({f"▁t{i}": i for i in range(3, LLAMA_1B["vocab_size"])})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>").save_pretrained(folder)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA_1B)).to(torch.bfloat16)
    model.save_pretrained(folder)
    n_params = sum(p.numel() for p in model.parameters())
    del model
    torch.cuda.empty_cache()
    print(json.dumps({"built": str(folder), "params": n_params, "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
    return folder


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["bundled", "llama-1b"], required=True)
    ap.add_argument("--mode", choices=["eager", "graphs"], required=True)
    ap.add_argument("--scratch", default=os.environ.get("CB_SCRATCH", tempfile.gettempdir()))
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from engine_ext import Engine, EngineConfig, GenerationParams

    model_path = None
    if args.model == "llama-1b":
        model_path = Path(args.scratch) / "llama-3.2-1b-random"
        if not (model_path / "model.safetensors").exists():
            build_random_llama(model_path)
    cfg = EngineConfig(model=str(model_path) if model_path else None, device="cuda",
                       enforce_eager=(args.mode == "eager"), max_model_len=None if args.model == "bundled" else 1024,
                       gpu_memory_utilization=0.6)
    t0 = time.perf_counter()
    eng = Engine(cfg).start()
    startup = time.perf_counter() - t0
    info = eng.info
    result: dict = {"model": args.model, "mode": args.mode, "engine_startup_s": round(startup, 2),
                    "info": info.to_dict(), "runner": os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "default(V2)")}

    if args.model == "bundled":
        g = eng.generate("The capital of", GenerationParams(max_tokens=8, logprobs=1))
        result["sample"] = {"text": g.text, "token_ids": g.token_ids}
        prompt = eng.tokenize("The capital of")
    else:
        prompt = list(range(10, 42))
    tokens = min(args.tokens, info.max_model_len - len(prompt) - 1)
    result["tokens_per_request"] = tokens
    params = GenerationParams(max_tokens=tokens, ignore_eos=True)
    eng.generate([prompt] * 2, GenerationParams(max_tokens=8, ignore_eos=True))  # warm-up (Triton JIT)
    for batch in (1, 32):
        prompts = [[(t + i) % (info.vocab_size - 3) + 3 for t in prompt] for i in range(batch)]
        t1 = time.perf_counter()
        gens = eng.generate(prompts, params)
        dt = time.perf_counter() - t1
        n = sum(len(x.token_ids) for x in gens)
        result[f"batch{batch}"] = {"tokens": n, "seconds": round(dt, 3), "tok_per_s": round(n / dt, 1),
                                   "per_request_tok_per_s": round(n / batch / dt, 1)}
    eng.close()
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
