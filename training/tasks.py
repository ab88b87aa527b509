"""Builds ``tasks.json``: the compact evaluation set shipped next to the model.

Contract: every item carries explicit token ids (``answer_id``, ``foil_id``: the id of
the word as the next token after the prompt, i.e. of ``" " + word``) and, for facts,
the subject's token span ``[start, end)`` in the prompt's encoding *including* the BOS
token at position 0.  ``hf_top1`` records whether the saved model (bf16 weights run in
float32 through transformers) ranks the answer first.  Item selection is seeded.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer
from transformers import LlamaForCausalLM

from training import corpus
from training.modeling import last_token_logits
from training.tokenizer import answer_token_id

N_FACTS_TRAIN, N_FACTS_HELDOUT, N_PAIRS, N_IOI = 240, 60, 60, 100


def subject_span(tok: Tokenizer, prompt: str, subject: str) -> list[int]:
    """Token span ``[start, end)`` of ``subject`` in ``tok.encode(prompt)`` (BOS included)."""
    c0 = prompt.index(subject)
    c1 = c0 + len(subject)
    enc = tok.encode(prompt)
    idx = [i for i, (a, b) in enumerate(enc.offsets)
           if enc.special_tokens_mask[i] == 0 and a < c1 and b > c0]
    if idx != list(range(idx[0], idx[-1] + 1)) or len(idx) != len(subject.split()):
        raise ValueError(f"subject {subject!r} is not a clean token span of {prompt!r}")
    return [idx[0], idx[-1] + 1]


def _sample(items: list, n: int, rng: np.random.Generator) -> list:
    return [items[i] for i in sorted(rng.choice(len(items), size=n, replace=False))]


def build_tasks(world: corpus.World, tok: Tokenizer, model: LlamaForCausalLM) -> dict:
    """The tasks.json payload for ``world`` (see module docstring)."""
    rng = np.random.default_rng([world.seed, 6])
    ids = lambda word: answer_token_id(tok, word)  # noqa: E731
    facts = (_sample(corpus.fact_items(world, "train"), N_FACTS_TRAIN, rng)
             + _sample(corpus.fact_items(world, "heldout_template"), N_FACTS_HELDOUT, rng))
    fact_rows = [{**asdict(f), "answer_id": ids(f.answer), "foil_id": ids(f.foil),
                  "subject_span": subject_span(tok, f.prompt, f.subject)} for f in facts]
    pairs = corpus.fact_pairs(world, N_PAIRS, True) + corpus.fact_pairs(world, N_PAIRS, False)
    pair_rows = [{**asdict(p), "answer_id": ids(p.answer), "foil_id": ids(p.foil),
                  "subject_span_clean": subject_span(tok, p.clean_prompt, p.subject_clean),
                  "subject_span_corrupt": subject_span(tok, p.corrupt_prompt, p.subject_corrupt)}
                 for p in pairs]
    ioi_rows = [{**asdict(it), "answer_id": ids(it.answer), "foil_id": ids(it.foil)}
                for it in corpus.ioi_items(world, "heldout_pairs", N_IOI)]
    for rows, key in ((fact_rows, "prompt"), (pair_rows, "clean_prompt"), (ioi_rows, "prompt")):
        top1 = last_token_logits(model, tok, [r[key] for r in rows]).argmax(-1)
        for r, t in zip(rows, top1.tolist()):
            r["hf_top1"] = t == r["answer_id"]
    return {
        "model": "causalboard-tiny",
        "seed": world.seed,
        "notes": ("Prompts are encoded with BOS (id 1) prepended and no trailing space; the "
                  "answer is the next token, the word with a leading space (' ' + answer), "
                  "whose id is answer_id. subject_span is [start, end) in token positions "
                  "counting BOS as position 0. fact split: 'train' = trained template, "
                  "'heldout_template' = phrasing never seen in training. IOI items use name "
                  "pairs never seen together in training. hf_top1: saved model's top-1 "
                  "(transformers, float32) equals the answer."),
        "facts": fact_rows,
        "pairs": pair_rows,
        "ioi": ioi_rows,
    }


def write_tasks(payload: dict, path: Path) -> None:
    """Write ``payload`` as JSON, one item per line."""
    lines = ["{"]
    head = [k for k in payload if not isinstance(payload[k], list)]
    lines += [f"{json.dumps(k)}: {json.dumps(payload[k])}," for k in head]
    lists = [k for k in payload if isinstance(payload[k], list)]
    for j, k in enumerate(lists):
        rows = ",\n".join(" " + json.dumps(r, separators=(",", ":")) for r in payload[k])
        lines.append(f"{json.dumps(k)}: [\n{rows}\n]" + ("," if j < len(lists) - 1 else ""))
    lines.append("}")
    path.write_text("\n".join(lines) + "\n")
    json.loads(path.read_text())  # guard: the hand-assembled file must be valid JSON

