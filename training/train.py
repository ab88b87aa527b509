"""Train ``causalboard-tiny`` (a small LlamaForCausalLM) from scratch on the synthetic corpus.

Usage (repo root): ``.venv/bin/python -m training.train``

Contract: deterministic given ``--seed`` on a given machine/thread count (seeded
corpus, seeded data order, ``torch.manual_seed``, 2 CPU threads).  Writes the model in
bfloat16 HF format (config.json, model.safetensors, generation_config.json), the
tokenizer files and ``tasks.json`` to ``--out-dir``, and a training log to
``training/results/train_log.json``.  Loss: next-token cross-entropy over every real
token of each sentence (BOS ... EOS); answer tokens get weight ``--answer-weight``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

if __name__ == "__main__":
    # Before torch loads OpenMP: keep its 2 threads spinning on their own cores between the many
    # small ops instead of sleeping (a 130-step run 16 % faster on the 2-core machine; the numbers
    # are identical).
    for _var, _value in (("OMP_WAIT_POLICY", "ACTIVE"), ("OMP_PROC_BIND", "close"), ("OMP_PLACES", "cores")):
        os.environ.setdefault(_var, _value)
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from training import corpus
from training.modeling import MODEL_DIR, last_token_logits, pad_rows
from training.tasks import build_tasks, write_tasks
from training.tokenizer import BOS, EOS, PAD, UNK, MODEL_MAX_LENGTH, build_tokenizer, save_tokenizer

RESULTS_DIR = Path("training/results")


@dataclass
class TrainConfig:
    """Architecture, optimisation and data-mix hyperparameters."""

    seed: int = corpus.SEED
    hidden: int = 192
    layers: int = 8
    heads: int = 2
    kv_heads: int = 2
    intermediate: int = 384
    steps: int = 1950  # optimizer steps trained (<= schedule_steps): the targets are met by then
    schedule_steps: int = 2600  # horizon of the cosine decay: the learning rate would reach 0 here
    batch_size: int = 64
    micro_batches: int = 3  # length-sorted parts per batch (less padding; same gradient)
    ioi_fraction: float = 0.4
    answer_weight: float = 3.0
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.05
    eval_every: int = 650
    threads: int = 2
    device: str = "cpu"
    out_dir: str = str(MODEL_DIR)


def lr_factor(cfg: TrainConfig, step: int) -> float:
    """Learning-rate multiplier at ``step``: linear warm-up, then cosine decay reaching 0 at
    ``cfg.schedule_steps``.  A run of ``steps < schedule_steps`` is the first ``steps`` of the
    longer run, step for step (the batches are a prefix too)."""
    return (min(1.0, (step + 1) / cfg.warmup)
            * 0.5 * (1 + math.cos(math.pi * step / cfg.schedule_steps)))


def model_config(cfg: TrainConfig, vocab_size: int, special_ids: dict[str, int]) -> LlamaConfig:
    """The LlamaConfig for ``cfg`` (tied embeddings, bf16 on disk)."""
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=cfg.hidden, num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.hidden // cfg.heads, intermediate_size=cfg.intermediate,
        max_position_embeddings=MODEL_MAX_LENGTH, rope_theta=10000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=special_ids[BOS],
        eos_token_id=special_ids[EOS], pad_token_id=special_ids[PAD], dtype="bfloat16")


def batches(cfg: TrainConfig, world: corpus.World) -> list[list[str]]:
    """Deterministic list of ``cfg.steps`` batches of sentences (facts in shuffled epochs + fresh IOI)."""
    rng = np.random.default_rng([cfg.seed, 10])
    facts = corpus.fact_train_texts(world)
    n_ioi = int(round(cfg.batch_size * cfg.ioi_fraction))
    n_fact = cfg.batch_size - n_ioi
    ioi = corpus.ioi_train_texts(world, n_ioi * cfg.steps, cfg.seed)
    order = np.concatenate([rng.permutation(len(facts))
                            for _ in range(math.ceil(n_fact * cfg.steps / len(facts)))])
    return [[facts[j] for j in order[s * n_fact:(s + 1) * n_fact]]
            + ioi[s * n_ioi:(s + 1) * n_ioi] for s in range(cfg.steps)]


def answer_positions(ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Boolean ``[N, T]`` mask of each answer token: rows are ``... answer . EOS`` + padding, ``lengths`` counts EOS."""
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[torch.arange(len(ids)), lengths - 3] = True
    return mask


def step_loss(model: LlamaForCausalLM, ids: torch.Tensor, lengths: torch.Tensor,
              answer_weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted next-token loss over real tokens, as ``(sum of weighted losses, sum of weights)``
    (their ratio is the mean); ``ids`` end each row with EOS then padding; each sentence's
    answer (its last word) gets weight ``answer_weight``, other real tokens 1."""
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
    targets = ids[:, 1:]
    real = torch.arange(targets.shape[1], device=ids.device)[None] < (lengths[:, None] - 1)
    w = real.float() + (answer_weight - 1.0) * answer_positions(ids, lengths)[:, 1:].float()
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    return (nll * w).sum(), w.sum()


def micro_batches(tok, texts: list[str], n: int, pad_id: int, eos_id: int):
    """``texts`` sorted by length and cut into ``n`` parts, each as ``(ids, lengths)`` padded to
    its own longest row (less padding than one batch; the summed gradient is the batch's)."""
    rows = [ids for ids, _ in sorted(((e.ids, t) for e, t in zip(tok.encode_batch(texts), texts)),
                                     key=lambda row: (len(row[0]), row[1]))]
    size = math.ceil(len(rows) / n)
    out = []
    for part in (rows[i:i + size] for i in range(0, len(rows), size)):
        ids, lengths = pad_rows(part, pad_id)
        ids = torch.cat([ids, torch.full((len(ids), 1), pad_id)], 1)
        ids[torch.arange(len(ids)), lengths] = eos_id
        out.append((ids, lengths + 1))
    return out


def quick_eval(model: LlamaForCausalLM, tok, world: corpus.World) -> dict[str, float]:
    """Top-1 accuracy on 600 trained-template facts and 300 held-out-pair IOI prompts."""
    facts = corpus.fact_items(world, "train")[::4][:600]
    ioi = corpus.ioi_items(world, "heldout_pairs", 300)
    out = {}
    for name, items in (("facts_train", facts), ("ioi_heldout", ioi)):
        top1 = last_token_logits(model, tok, [it.prompt for it in items]).argmax(-1).tolist()
        gold = [tok.token_to_id("▁" + it.answer) for it in items]
        out[name] = float(np.mean([a == b for a, b in zip(top1, gold)]))
    return out


def train(cfg: TrainConfig) -> dict:
    """Run training, save everything, return the log."""
    if not 0 < cfg.steps <= cfg.schedule_steps:
        raise ValueError(f"steps must be in 1..schedule_steps ({cfg.schedule_steps}), got {cfg.steps}")
    t0 = time.time()
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    torch.use_deterministic_algorithms(True)
    world = corpus.build_world(cfg.seed)
    tok = build_tokenizer(corpus.vocabulary_texts(world))
    specials = {t: tok.token_to_id(t) for t in (UNK, BOS, EOS, PAD)}
    model = LlamaForCausalLM(model_config(cfg, tok.get_vocab_size(), specials)).to(cfg.device)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(cfg, s))
    log = {"config": asdict(cfg), "params": n_params, "vocab": tok.get_vocab_size(), "evals": []}
    print(f"params={n_params} vocab={tok.get_vocab_size()}", flush=True)
    losses = []
    for step, texts in enumerate(batches(cfg, world)):
        model.train()
        loss_sum, weight = 0.0, 0.0
        for ids, lengths in micro_batches(tok, texts, cfg.micro_batches, specials[PAD], specials[EOS]):
            s, w = step_loss(model, ids.to(cfg.device), lengths.to(cfg.device), cfg.answer_weight)
            s.backward()  # gradients of the summed loss accumulate over the parts
            loss_sum, weight = loss_sum + s.item(), weight + w.item()
        for p in model.parameters():  # -> gradient of the batch's weighted mean loss
            p.grad.div_(weight)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss_sum / weight)
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            model.eval()
            acc = quick_eval(model, tok, world)
            row = {"step": step + 1, "loss": float(np.mean(losses[-cfg.eval_every:])),
                   "elapsed_s": round(time.time() - t0, 1), **acc}
            log["evals"].append(row)
            print(json.dumps(row), flush=True)
    out = Path(cfg.out_dir)
    model = model.to("cpu", dtype=torch.bfloat16).eval()
    model.config.dtype = torch.bfloat16
    model.generation_config = GenerationConfig(
        bos_token_id=specials[BOS], eos_token_id=specials[EOS], pad_token_id=specials[PAD])
    model.save_pretrained(out)
    save_tokenizer(tok, out)
    write_tasks(build_tasks(world, tok, model.float()), out / "tasks.json")
    log["wall_s"] = round(time.time() - t0, 1)
    print(f"saved to {out} in {log['wall_s']} s", flush=True)
    return log


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for field, default in asdict(TrainConfig()).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=type(default), default=default)
    parser.add_argument("--log", default=str(RESULTS_DIR / "train_log.json"))
    args = vars(parser.parse_args())
    log_path = Path(args.pop("log"))
    log = train(TrainConfig(**args))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.write_text(json.dumps(log, indent=2) + "\n")


if __name__ == "__main__":
    main()
