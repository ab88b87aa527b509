"""The bundled model knows its tasks when served by vLLM (the model card's targets)."""

from __future__ import annotations

from engine_ext import GenerationParams


def _accuracy(engine, items) -> float:
    gens = engine.generate([it["prompt"] for it in items], GenerationParams(max_tokens=1))
    return sum(g.token_ids[0] == it["answer_id"] for g, it in zip(gens, items)) / len(items)


def test_fact_recall_on_trained_facts(engine, tasks):
    items = [f for f in tasks["facts"] if f.get("split", "train") == "train"]
    assert len(items) >= 50
    assert _accuracy(engine, items) >= 0.95


def test_indirect_object_identification(engine, tasks):
    items = tasks["ioi"]
    assert len(items) >= 50
    assert _accuracy(engine, items) >= 0.90
