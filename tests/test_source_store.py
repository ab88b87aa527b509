"""SourceStore: whole-run LRU within a byte budget, leases block eviction."""

import pytest
import torch

from engine_ext.worker.source_store import SourceStore, SourceStoreFull


def run(n_values: int, hidden: int = 4):
    return {(0, p): (torch.ones(hidden), torch.zeros(hidden)) for p in range(n_values)}


def test_lru_eviction_keeps_within_budget():
    one = 2 * 4 * 4  # one value: two float32 vectors of 4
    store = SourceStore(budget_bytes=3 * one)
    store.put("a", run(1)); store.put("b", run(1)); store.put("c", run(1))
    store.get("a")  # a is now most recently used
    evicted = store.put("d", run(1))
    assert evicted == ["b"] and "a" in store and "b" not in store
    assert store.used_bytes <= store.budget


def test_leased_runs_are_not_evicted():
    one = 2 * 4 * 4
    store = SourceStore(budget_bytes=2 * one)
    store.put("a", run(1)); store.lease("a")
    store.put("b", run(1))
    assert store.put("c", run(1)) == ["b"] and "a" in store
    store.release("a")
    assert store.put("d", run(1)) == ["a"]


def test_a_run_larger_than_the_budget_is_refused():
    store = SourceStore(budget_bytes=10)
    with pytest.raises(SourceStoreFull):
        store.put("big", run(5))


def test_mean_and_drop():
    store = SourceStore(1 << 20)
    store.put("r", {(2, 0): (torch.tensor([1.0, 2.0]), torch.tensor([1.0, 0.0])), (2, 1): (torch.tensor([3.0, 2.0]), torch.zeros(2))})
    assert store.mean("r", 2).tolist() == [2.5, 2.0]
    assert store.mean("r", 5) is None
    assert store.drop("r") and not store.drop("r")
