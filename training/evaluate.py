"""Top-1 accuracy of the saved ``causalboard-tiny`` model on the synthetic tasks.

Usage (repo root): ``.venv/bin/python -m training.evaluate [--model-dir DIR]``

Loads the bf16 checkpoint as float32 with transformers and scores the next token after
each prompt against the answer token.  Sets: every trained-template fact (target
>= 0.95), every held-out-template fact (report only), IOI prompts over held-out name
pairs (target >= 0.90) and over trained pairs, and the clean/corrupt pair prompts.
Writes ``training/results/eval.json``.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer
from transformers import LlamaForCausalLM

from training import corpus
from training.modeling import MODEL_DIR, last_token_logits, load_model
from training.tokenizer import answer_token_id

RESULTS = Path("training/results/eval.json")
TARGETS = {"facts_train_templates": 0.95, "ioi_heldout_pairs": 0.90}
N_IOI = 2000


def score(model: LlamaForCausalLM, tok: Tokenizer, items: list, prompt_key: str = "prompt",
          group_key: str | None = None) -> dict:
    """Accuracy, mean answer probability and foil-beating rate of ``items`` (optionally per group)."""
    logits = last_token_logits(model, tok, [getattr(it, prompt_key) for it in items])
    answer = np.array([answer_token_id(tok, it.answer) for it in items])
    foil = np.array([answer_token_id(tok, it.foil) for it in items])
    probs = logits.softmax(-1).numpy()
    rows = np.arange(len(items))
    correct = logits.argmax(-1).numpy() == answer
    out = {"n": len(items), "accuracy": float(correct.mean()),
           "mean_p_answer": float(probs[rows, answer].mean()),
           "answer_beats_foil": float((probs[rows, answer] > probs[rows, foil]).mean())}
    if group_key:
        groups = defaultdict(list)
        for it, c in zip(items, correct):
            groups[str(getattr(it, group_key))].append(c)
        out[f"accuracy_by_{group_key}"] = {k: float(np.mean(v)) for k, v in sorted(groups.items())}
    return out


def evaluate(model_dir: Path = MODEL_DIR) -> dict:
    """All accuracy numbers for the model in ``model_dir``."""
    model, tok = load_model(model_dir)
    world = corpus.build_world(json.loads((model_dir / "tasks.json").read_text())["seed"])
    pairs = corpus.fact_pairs(world, 200, True) + corpus.fact_pairs(world, 200, False)
    res = {
        "facts_train_templates": score(model, tok, corpus.fact_items(world, "train"),
                                       group_key="template_id"),
        "facts_heldout_templates": score(model, tok, corpus.fact_items(world, "heldout_template"),
                                         group_key="template_id"),
        "ioi_heldout_pairs": score(model, tok, corpus.ioi_items(world, "heldout_pairs", N_IOI),
                                   group_key="pattern"),
        "ioi_train_pairs": score(model, tok, corpus.ioi_items(world, "train", N_IOI)),
        "pairs_clean_prompts": score(model, tok, pairs, "clean_prompt", group_key="equal_length"),
    }
    res["targets"] = {k: {"target": t, "measured": res[k]["accuracy"],
                          "met": res[k]["accuracy"] >= t} for k, t in TARGETS.items()}
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=MODEL_DIR)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    res = evaluate(args.model_dir)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    for k, v in res.items():
        if k != "targets":
            print(f"{k:26s} n={v['n']:5d} acc={v['accuracy']:.3f} p={v['mean_p_answer']:.3f}")
    print(json.dumps(res["targets"]))


if __name__ == "__main__":
    main()
