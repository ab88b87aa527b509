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


def test_a_single_capture_block_is_stored_as_stacked_rows_equal_to_the_pairs():
    """A stored clean run (one block of distinct sites and positions) reaches the store stacked
    (`RunRows`): the same keys in the same order and bit-identical values as the per-pair path,
    copied out of the capture block (whose buffer is reused)."""
    import numpy as np

    from engine_ext.worker.source_store import RunRows, SourceRun
    from engine_ext.worker.state import CapturedBlock, RequestState

    xs, rs = torch.randn(5, 7, 16).to(torch.bfloat16), torch.randn(5, 7, 16).to(torch.bfloat16)
    positions, sites = np.array([3, 1, 4, 0, 2]), np.array([6, 2, 9, 1, 0, 5, 3])
    st = RequestState.__new__(RequestState)
    st.captures = [CapturedBlock(positions, sites, xs, rs, None, 0)]
    rows = st.capture_pairs()
    assert isinstance(rows, RunRows)
    pairs = {(s, p): (xs[i, j], rs[i, j]) for i, p in enumerate(positions.tolist()) for j, s in enumerate(sites.tolist())}
    fast, slow = SourceRun("a", rows), SourceRun("b", pairs)
    xs.zero_()
    rs.zero_()
    assert fast.keys == slow.keys and torch.equal(fast.x, slow.x) and torch.equal(fast.r, slow.r)
    assert fast.x.abs().sum() > 0, "the stored rows are a copy, not a view of the block"
    store = SourceStore(1 << 20)
    store.put("a", rows)
    assert store.value("a", 9, 4).x.equal(slow.x[slow.row_of[(9, 4)]]) and store.used_bytes == fast.nbytes


def test_blocks_that_repeat_a_key_keep_the_latest_pair():
    import numpy as np

    from engine_ext.worker.state import CapturedBlock, RequestState

    a, b = torch.ones(1, 2, 4), torch.full((1, 2, 4), 2.0)
    st = RequestState.__new__(RequestState)
    st.captures = [CapturedBlock(np.array([0]), np.array([1, 2]), a, a, None, 0),
                   CapturedBlock(np.array([0]), np.array([2]), b[:, :1], b[:, :1], None, 0)]
    pairs = st.capture_pairs()
    assert isinstance(pairs, dict) and pairs[(2, 0)][0].equal(torch.full((4,), 2.0)) and pairs[(1, 0)][0].equal(torch.ones(4))
