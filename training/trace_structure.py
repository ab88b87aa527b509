"""The model card's causal-trace structure, as a check on traces of the bundled model.

One definition for the HF trace (`training.causal_trace_hf`), the CPU sweep test
(`tests/test_sweep_api.py`) and the GPU sweep benchmark (`benchmarks/gpu_sweep.py`).
Numpy only: the GPU host has neither matplotlib nor the project's virtualenv.

A trace is a ``[layers, positions]`` grid of recovered fractions over a prompt's tokens (BOS at
position 0); its columns fall into four categories (``category_positions``).
"""

from __future__ import annotations

from typing import Callable, Iterable

import numpy as np

CATEGORIES = ("subject_last", "subject_other", "after_subject", "last")


def category_positions(span: list[int], n_tok: int) -> dict[str, list[int]]:
    """Token positions of each category for a subject ``span`` = ``[start, end)`` in a prompt of
    ``n_tok`` tokens (BOS is position 0); a category may be empty."""
    return {"subject_last": [span[1] - 1], "subject_other": list(range(span[0], span[1] - 1)),
            "after_subject": list(range(span[1], n_tok - 1)), "last": [n_tok - 1]}


def sweep_trace_facts(facts: Iterable[dict], n_tokens: Callable[[str], int], n: int = 8) -> list[dict]:
    """The first ``n`` trained-template facts of ``tasks.json`` with at least one token between the
    subject and the last token (so every category but ``subject_other`` has a column)."""
    return [f for f in facts
            if f["split"] == "train" and f["subject_span"][1] < n_tokens(f["prompt"]) - 1][:n]


def mean_by_category(traces: Iterable[tuple[np.ndarray, list[int]]]) -> dict[str, np.ndarray]:
    """Per-layer means over ``(grid, subject_span)`` traces of each category's mean column, for
    ``subject_last``, ``after_subject`` and ``last`` (the categories every trace has)."""
    by_cat: dict[str, list[np.ndarray]] = {"subject_last": [], "after_subject": [], "last": []}
    for grid, span in traces:
        positions = category_positions(span, grid.shape[1])
        for cat, values in by_cat.items():
            values.append(grid[:, positions[cat]].mean(1))
    return {cat: np.mean(values, axis=0) for cat, values in by_cat.items()}


def has_model_card_structure(mean: dict[str, np.ndarray]) -> bool:
    """Whether the category means of an 8-layer trace show the model card's structure: the
    subject's last token carries most of the answer through layers 0-2, well above the last token;
    by layer 5 the last token has taken over; restoring the last layer's last token restores the
    answer; the tokens between the subject and the last token carry nothing."""
    subject, last = np.asarray(mean["subject_last"]), np.asarray(mean["last"])
    return bool(subject[:3].mean() > 0.45 and np.all(subject[:3] > last[:3] + 0.3)
                and last[5] > 0.6 and last[-1] > 0.95 and subject[5] < 0.25
                and np.all(np.abs(mean["after_subject"]) < 0.1))
