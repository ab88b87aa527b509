"""ROME-style causal trace of the bundled model, in plain PyTorch on the HF model (float32).

Usage (repo root): ``.venv/bin/python -m training.causal_trace_hf [--model-dir DIR]``

Method (Meng et al. 2022, "Locating and Editing Factual Associations in GPT"):

1. Clean run: record the residual stream after every decoder layer ``i`` (the layer's
   output, i.e. HF ``output_hidden_states[i + 1]`` before the final norm) and
   ``p_clean = P(answer | prompt)`` at the last position.
2. Corrupted runs: add Gaussian noise with std ``3 * std(embedding matrix)`` to the input
   embeddings of the subject tokens; ``p_corrupt`` is the answer probability averaged
   over ``N_NOISE`` seeded noise samples.
3. For every (layer, position): corrupted run, but the output of that layer at that
   position is overwritten with its clean value; ``p_restored`` is averaged over the same
   noise samples.  Recovered fraction = ``(p_restored - p_corrupt) / (p_clean - p_corrupt)``.

Reports, per layer, the mean recovered fraction over ``N_PROMPTS`` correctly answered
trained-template fact prompts at: the subject's last token, the other subject tokens,
the tokens between the subject and the last token, and the last token.  Writes
``training/results/trace.json`` and the heatmap ``docs/img/bundled-model-trace.png`` of the
most typical prompt (closest to the mean table; chosen by that rule, not by hand).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

from training import corpus  # noqa: E402
from training.modeling import MODEL_DIR, last_token_logits, load_model  # noqa: E402
from training.tasks import subject_span  # noqa: E402
from training.tokenizer import answer_token_id  # noqa: E402
from training.trace_structure import CATEGORIES, category_positions  # noqa: E402

N_PROMPTS, N_NOISE, NOISE_SCALE, MIN_P_CLEAN = 40, 10, 3.0, 0.5
ORDERS = ("subject_first", "relation_first")  # template groups, see corpus.subject_first
# Heatmap example: the *typical* prompt, i.e. the one whose per-layer recovered fractions at the
# four categories are closest (Euclidean) to the mean over all prompts; chosen by rule, not by hand.
RESULTS = Path("training/results/trace.json")
FIGURE = Path("docs/img/bundled-model-trace.png")


def _set_output(output, hidden: torch.Tensor):
    return (hidden,) + tuple(output[1:]) if isinstance(output, tuple) else hidden


@torch.no_grad()
def _run(model: LlamaForCausalLM, embeds: torch.Tensor, answer_id: int,
         restore: tuple[int, torch.Tensor, torch.Tensor] | None = None,
         record: list | None = None) -> torch.Tensor:
    """P(answer) at the last position for each row of ``embeds`` ``[B, T, H]``.

    ``restore=(layer, positions[B], clean[T, H])`` overwrites row b's output of ``layer``
    at ``positions[b]`` with ``clean[positions[b]]``; ``record`` collects every layer's output.
    """
    hooks = []
    for i, layer in enumerate(model.model.layers):
        def hook(_mod, _inp, output, i=i):
            hidden = output[0] if isinstance(output, tuple) else output
            if record is not None:
                record.append(hidden[0].clone())
            if restore is not None and restore[0] == i:
                hidden = hidden.clone()
                rows = torch.arange(hidden.shape[0], device=hidden.device)
                hidden[rows, restore[1]] = restore[2][restore[1]]
                return _set_output(output, hidden)
            return None
        hooks.append(layer.register_forward_hook(hook))
    try:
        logits = model(inputs_embeds=embeds, use_cache=False).logits[:, -1]
    finally:
        for h in hooks:
            h.remove()
    return logits.float().softmax(-1)[:, answer_id]


def trace_prompt(model: LlamaForCausalLM, tok: Tokenizer, prompt: str, span: list[int],
                 answer_id: int, noise_std: float, seed: int) -> dict:
    """p_clean, p_corrupt and the ``[layers, tokens]`` matrix of p_restored for one prompt."""
    device = model.model.embed_tokens.weight.device
    ids = torch.tensor([tok.encode(prompt).ids], device=device)
    emb = model.model.embed_tokens(ids)
    n_tok, n_layers = ids.shape[1], len(model.model.layers)
    clean: list[torch.Tensor] = []
    p_clean = _run(model, emb, answer_id, record=clean).item()
    gen = torch.Generator().manual_seed(seed)
    noise = (torch.randn(N_NOISE, span[1] - span[0], emb.shape[-1], generator=gen)
             * noise_std).to(device)
    corrupt = emb.repeat(N_NOISE, 1, 1)
    corrupt[:, span[0]:span[1]] += noise
    p_corrupt = _run(model, corrupt, answer_id).mean().item()
    batch = corrupt.repeat(n_tok, 1, 1)  # row = position * N_NOISE + noise sample
    positions = torch.arange(n_tok, device=device).repeat_interleave(N_NOISE)
    p_restored = np.zeros((n_layers, n_tok))
    for layer in range(n_layers):
        p = _run(model, batch, answer_id, restore=(layer, positions, clean[layer]))
        p_restored[layer] = p.view(n_tok, N_NOISE).mean(1).cpu().numpy()
    return {"p_clean": p_clean, "p_corrupt": p_corrupt, "p_restored": p_restored}


def select_prompts(model: LlamaForCausalLM, tok: Tokenizer, world: corpus.World) -> list:
    """``N_PROMPTS`` trained-template fact items, in seeded order, answered with p >= MIN_P_CLEAN."""
    items = corpus.fact_items(world, "train")
    items = [items[i] for i in np.random.default_rng([world.seed, 7]).permutation(len(items))]
    probs = last_token_logits(model, tok, [it.prompt for it in items]).softmax(-1)
    keep = [it for it, p in zip(items, probs)
            if p[answer_token_id(tok, it.answer)] >= MIN_P_CLEAN]
    return keep[:N_PROMPTS]


def plot(example: dict, path: Path) -> None:
    """Heatmap of p_restored (layers x tokens) for one prompt."""
    p = example["p_restored"]
    labels = [f"{t}*" if example["span"][0] <= i < example["span"][1] else t
              for i, t in enumerate(example["tokens"])]
    fig, ax = plt.subplots(figsize=(max(6.5, 1.0 + 0.75 * len(labels)), 3.6))
    im = ax.imshow(p, origin="lower", cmap="Purples", vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right")
    ax.set_yticks(range(p.shape[0]))
    ax.set_ylabel("layer (restored output)")
    ax.set_title(f"{example['prompt']} -> {example['answer']}   "
                 f"p_clean={example['p_clean']:.2f}, p_corrupt={example['p_corrupt']:.2f}",
                 fontsize=9)
    fig.colorbar(im, ax=ax, label="p(answer) after restoring")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _layer_means(per_cat: dict[str, list[np.ndarray]]) -> dict[str, list[float]]:
    return {c: np.mean(v, 0).tolist() if v else [] for c, v in per_cat.items()}


def causal_trace(model_dir: Path = MODEL_DIR, device: str = "cpu") -> dict:
    """Run the trace over the selected prompts; return the summary (and the example heatmap data)."""
    model, tok = load_model(model_dir)
    model = model.to(device)
    world = corpus.build_world(json.loads((model_dir / "tasks.json").read_text())["seed"])
    noise_std = NOISE_SCALE * model.model.embed_tokens.weight.std().item()
    per_cat: dict[str, list[np.ndarray]] = {c: [] for c in CATEGORIES}
    per_order: dict[str, dict[str, list[np.ndarray]]] = {
        o: {c: [] for c in CATEGORIES} for o in ORDERS}
    per_length: dict[int, dict[str, list[np.ndarray]]] = {}
    rows, candidates = [], []
    for k, it in enumerate(select_prompts(model, tok, world)):
        span = subject_span(tok, it.prompt, it.subject)
        res = trace_prompt(model, tok, it.prompt, span, answer_token_id(tok, it.answer),
                           noise_std, seed=world.seed + k)
        frac = (res["p_restored"] - res["p_corrupt"]) / (res["p_clean"] - res["p_corrupt"])
        by_cat = {cat: frac[:, pos].mean(1)
                  for cat, pos in category_positions(span, frac.shape[1]).items() if pos}
        order = ORDERS[0] if corpus.subject_first(it.template_id) else ORDERS[1]
        by_length = per_length.setdefault(span[1] - span[0], {c: [] for c in CATEGORIES})
        for cat, layer_means in by_cat.items():
            for table in (per_cat, per_order[order], by_length):
                table[cat].append(layer_means)
        rows.append({"prompt": it.prompt, "subject": it.subject, "answer": it.answer,
                     "p_clean": res["p_clean"], "p_corrupt": res["p_corrupt"]})
        tokens = [t.replace("▁", "") for t in tok.encode(it.prompt).tokens]
        profile = np.stack([by_cat.get(c, np.zeros(frac.shape[0])) for c in CATEGORIES])
        candidates.append({**rows[-1], **res, "span": span, "tokens": tokens, "profile": profile})
    summary = _layer_means(per_cat)
    mean_profile = np.stack([np.array(summary[c]) for c in CATEGORIES])
    example = min(candidates, key=lambda c: float(np.linalg.norm(c["profile"] - mean_profile)))
    return {
        "method": {"n_prompts": len(rows), "n_noise": N_NOISE, "noise_scale": NOISE_SCALE,
                   "noise_std": noise_std, "min_p_clean": MIN_P_CLEAN,
                   "n_prompts_per_category": {c: len(per_cat[c]) for c in CATEGORIES}},
        "mean_p_clean": float(np.mean([r["p_clean"] for r in rows])),
        "mean_p_corrupt": float(np.mean([r["p_corrupt"] for r in rows])),
        "recovered_fraction_by_layer": summary,
        "recovered_fraction_by_layer_and_template_order": {
            o: {"n_prompts": len(per_order[o]["last"]), **_layer_means(per_order[o])}
            for o in ORDERS},
        "recovered_fraction_by_layer_and_subject_tokens": {
            str(n): {"n_prompts": len(per_length[n]["last"]), **_layer_means(per_length[n])}
            for n in sorted(per_length)},
        "example": {"selection": "the prompt closest to the mean recovered fractions "
                                 "(missing categories count as 0)",
                    **{k: example[k] for k in ("prompt", "answer", "p_clean", "p_corrupt",
                                               "span", "tokens")},
                    "p_restored": example["p_restored"].round(4).tolist()},
        "prompts": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=MODEL_DIR)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--figure", type=Path, default=FIGURE)
    parser.add_argument("--device", default="cpu", help="torch device (the recorded trace uses cpu)")
    args = parser.parse_args()
    res = causal_trace(args.model_dir, args.device)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    plot({**res["example"], "p_restored": np.array(res["example"]["p_restored"])}, args.figure)
    print(f"prompts={res['method']['n_prompts']} p_clean={res['mean_p_clean']:.3f} "
          f"p_corrupt={res['mean_p_corrupt']:.3f}")
    print("layer " + " ".join(f"{c:>14s}" for c in CATEGORIES))
    tables = {"all": res["recovered_fraction_by_layer"],
              **res["recovered_fraction_by_layer_and_template_order"],
              **{f"subject of {n} tokens": t for n, t in
                 res["recovered_fraction_by_layer_and_subject_tokens"].items()}}
    for name, table in tables.items():
        print(f"[{name}] n={table.get('n_prompts', res['method']['n_prompts'])}")
        for layer in range(len(table["last"])):
            print(f"{layer:5d} " + " ".join(
                f"{table[c][layer]:14.3f}" if table[c] else f"{'-':>14s}" for c in CATEGORIES))


if __name__ == "__main__":
    main()
