"""Captured values through shared memory (`engine_ext.capture_ring`).

Fast tier: the ring's allocator against a model of it (random allocations and out-of-order frees:
live regions never overlap and stay inside the ring; a full ring says so instead of overwriting),
the client's copy-out and acknowledgements, and that no file stays in /dev/shm.

Engine tier (real vLLM on CPU, the engine core in its own process): captures that came through
the ring equal, bit for bit, the same captures from the session's in-process engine; the regions
are given back once read; with a ring too small for a result the values come inline, equal too;
nothing is left in /dev/shm after the engine closes."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

from engine_ext.capture_ring import ALIGN, SHM_DIR, CaptureRing, RingReaders
from engine_ext.specs import Capture, Interventions

from .conftest import model_path


def _ring_files() -> set[str]:
    return {f for f in os.listdir(SHM_DIR) if f.startswith("causalboard-ring-")}


def test_regions_never_overlap_and_a_full_ring_refuses():
    ring = CaptureRing(64 * ALIGN)
    rng = random.Random(0)
    live: dict[int, int] = {}
    refused = wrapped = 0
    try:
        for _ in range(5000):
            if live and rng.random() < 0.45:
                off = rng.choice(list(live))
                ring.deref(off)
                del live[off]
                continue
            n = rng.randrange(1, 12 * ALIGN)
            off = ring.alloc(n)
            if off is None:
                refused += 1
                # refused only when no gap after the newest region (or at the start) could hold it
                continue
            size = -(-n // ALIGN) * ALIGN
            wrapped += off == 0 and bool(live)
            assert off % ALIGN == 0 and off + size <= ring.size
            for o, s in live.items():
                assert off + size <= o or o + s <= off, (off, size, o, s)
            live[off] = size
            ring.buffer(off, n)[:] = bytes([len(live) % 256]) * n
        assert refused and wrapped, "the run must reach a full ring and wrap around"
        assert ring.alloc(ring.size + 1) is None
        for off in live:
            ring.deref(off)
        assert ring.in_use == 0 and ring.alloc(ring.size) == 0, "a ring with nothing live has all its room"
        ring.release([12345])  # an unknown offset (acknowledged twice): ignored
    finally:
        ring.close()
    assert ring.name not in _ring_files()


def test_the_client_copies_out_acknowledges_and_unlinks():
    ring = CaptureRing(1 << 16)
    readers = RingReaders()
    try:
        assert readers.open(ring.name)
        assert ring.name not in _ring_files(), "the client unlinks the file once mapped"
        vals = np.arange(24, dtype="<f4")
        off = ring.alloc(vals.nbytes)
        ring.buffer(off, vals.nbytes)[:] = vals.tobytes()
        desc = ring.share(off, 0, vals.nbytes)
        ring.deref(off)
        reply = {"k": {"key": "k", "status": "ok", "captures": {"keys": [[0, 1]], "ring": desc}},
                 "plain": {"key": "plain", "status": "ok"}}
        out = readers.materialize(reply)
        data = out["k"]["captures"]["data"]
        assert isinstance(data, np.ndarray) and data.flags.writeable and "ring" not in out["k"]["captures"]
        assert np.array_equal(np.frombuffer(data, "<f4"), vals)
        ring.buffer(off, 8)[:] = np.float32([7.0, 7.0]).tobytes()  # the worker reuses the region...
        assert np.array_equal(np.frombuffer(data, "<f4"), vals), "...the client's copy is its own"
        acks = readers.take_acks()
        assert acks == {ring.name: [off]} and readers.take_acks() == {}
        ring.release(acks[ring.name])
        assert ring.in_use == 0
        assert not readers.open("causalboard-ring-no-such-ring")
        # a slice this process cannot read voids its result instead of handing over short or wrong values
        bad = readers.materialize({
            "outside": {"key": "outside", "status": "ok", "errors": [],
                        "captures": {"keys": [[0, 1]], "ring": [ring.name, ring.size - 8, 64]}},
            "unmapped": {"key": "unmapped", "status": "ok", "captures": {"keys": [[0, 1]], "ring": ["causalboard-ring-x", 0, 64]}}})
        for res in bad.values():
            assert res["status"] == "voided" and "captured values lost" in res["errors"][-1]
            assert res["captures"] == {"keys": [], "data": bytearray()}
        assert readers.take_acks() == {}
    finally:
        readers.close()
        ring.close()


def test_a_large_reply_is_copied_out_by_several_threads(monkeypatch):
    """A reply of at least `PARALLEL_COPY_BYTES` (lowered here) is copied by the reader's threads,
    each block into a writable array of its own, equal to what the ring held and independent of it;
    a smaller reply takes the one-thread path (the same kind of arrays)."""
    import engine_ext.capture_ring as cr

    monkeypatch.setattr(cr, "PARALLEL_COPY_BYTES", 4096)
    ring = CaptureRing(1 << 20)
    readers = RingReaders()
    readers.threads = 3
    try:
        assert readers.open(ring.name)
        rng = np.random.default_rng(0)
        reply, want = {}, {}
        for i in range(7):  # 7 blocks over 3 threads: uneven shares
            vals = rng.standard_normal(256 + 64 * i).astype("<f4")
            off = ring.alloc(vals.nbytes)
            ring.buffer(off, vals.nbytes)[:] = vals.tobytes()
            reply[f"r{i}"] = {"key": f"r{i}", "status": "ok", "captures": {"keys": [[0, 1]], "ring": ring.share(off, 0, vals.nbytes)}}
            ring.deref(off)
            want[f"r{i}"] = (off, vals)
        out = readers.materialize(reply)
        for k, (off, vals) in want.items():
            data = out[k]["captures"]["data"]
            assert isinstance(data, np.ndarray) and data.flags.writeable
            got = np.frombuffer(data, "<f4")
            assert got.flags.writeable and np.array_equal(got, vals)
            ring.buffer(off, 4)[:] = np.float32([9.0]).tobytes()
            assert np.array_equal(np.frombuffer(data, "<f4"), vals), "the copy is the client's own"
        assert sorted(readers.take_acks()[ring.name]) == sorted(off for off, _ in want.values())
        # below the threshold: one thread, bytearrays
        vals = np.arange(16, dtype="<f4")
        off = ring.alloc(vals.nbytes)
        ring.buffer(off, vals.nbytes)[:] = vals.tobytes()
        small = readers.materialize({"s": {"key": "s", "status": "ok", "captures": {"keys": [[0, 1]], "ring": ring.share(off, 0, vals.nbytes)}}})
        assert np.array_equal(np.frombuffer(small["s"]["captures"]["data"], "<f4"), vals)
    finally:
        readers.close()
        ring.close()


def test_the_copy_threads_setting(monkeypatch):
    from engine_ext.capture_ring import copy_threads

    monkeypatch.setenv("CAUSALBOARD_RING_COPY_THREADS", "1")
    assert copy_threads() == 1 and RingReaders().threads == 1
    monkeypatch.delenv("CAUSALBOARD_RING_COPY_THREADS")
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert copy_threads() == 8
    monkeypatch.setattr("os.cpu_count", lambda: 64)
    assert copy_threads() == 8
    monkeypatch.setattr("os.cpu_count", lambda: 6)
    assert copy_threads() == 3
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert copy_threads() == 1


def test_slab_views_pack_consecutive_blocks_up_to_the_slab_size(monkeypatch):
    """Consecutive blocks share a slab up to `SLAB_BYTES` (lowered here), a block of at least
    that size has one of its own, every view has its size, is writable, and none overlaps
    another; the reply's blocks land in their own ranges with their own bytes."""
    import engine_ext.capture_ring as cr

    monkeypatch.setattr(cr, "SLAB_BYTES", 100)
    sizes = [40, 40, 40, 0, 100, 8, 120, 60, 40]
    views = cr.slab_views(sizes)
    assert [len(v) for v in views] == sizes and all(v.flags.writeable for v in views)
    slabs = [v.base.size for v in views]
    assert slabs == [80, 80, 40, 40, 100, 8, 120, 100, 100]
    for i, v in enumerate(views):
        v[:] = i
    assert [int(v[0]) for v in views if len(v)] == [i for i, n in enumerate(sizes) if n], "no view overlaps another"

    ring = CaptureRing(1 << 16)
    readers = RingReaders()
    try:
        assert readers.open(ring.name)
        reply, want = {}, {}
        for i, n in enumerate((24, 24, 16, 30)):  # 96, 96, 64 and 120 bytes: four slabs of 100 at most
            vals = np.arange(n, dtype="<f4") + 100 * i
            off = ring.alloc(vals.nbytes)
            ring.buffer(off, vals.nbytes)[:] = vals.tobytes()
            reply[f"r{i}"] = {"key": f"r{i}", "status": "ok", "captures": {"keys": [[0, 1]], "ring": ring.share(off, 0, vals.nbytes)}}
            ring.deref(off)
            want[f"r{i}"] = vals
        out = readers.materialize(reply)
        for k, vals in want.items():
            got = np.frombuffer(out[k]["captures"]["data"], "<f4")
            assert got.flags.writeable and np.array_equal(got, vals)
        ring.release(readers.take_acks()[ring.name])
        assert ring.in_use == 0
    finally:
        readers.close()
        ring.close()


def test_copy_runs_merge_adjacent_slices_that_land_next_to_each_other(monkeypatch):
    """`copy_runs`: slices adjacent in one ring and in one slab move with one copy; a gap in the
    ring, another ring, a new slab or an empty slice ends a run; every byte lands where its own
    view is."""
    import engine_ext.capture_ring as cr

    monkeypatch.setattr(cr, "SLAB_BYTES", 100)
    jobs = [("a", 0, 40), ("a", 40, 40), ("a", 80, 40),   # the third starts a new slab
            ("a", 120, 10), ("a", 140, 10),                # a gap in the ring
            ("b", 150, 10), ("b", 160, 0), ("b", 160, 10)]  # another ring; an empty slice
    where: list = []
    views = cr.slab_views([n for *_, n in jobs], where)
    runs = cr.copy_runs(jobs, where)
    assert [(name, off, at, n) for name, off, _, at, n in runs] == [
        ("a", 0, 0, 80), ("a", 80, 0, 50), ("a", 140, 50, 10), ("b", 150, 60, 20)]
    src = {"a": np.arange(200, dtype=np.uint8), "b": np.arange(200, dtype=np.uint8)[::-1].copy()}
    for name, off, slab, at, n in runs:
        slab[at: at + n] = src[name][off: off + n]
    for (name, off, n), v in zip(jobs, views):
        assert np.array_equal(v, src[name][off: off + n])


def test_a_rank_whose_captures_are_not_used_is_acknowledged_without_a_copy():
    """`materialize(copy=False)` (a tensor-parallel rank that does not lead its stage): the block
    leaves the reply, its slice is acknowledged (the worker can reuse the region), inline blocks
    and results without captures are left as they are."""
    ring = CaptureRing(1 << 16)
    readers = RingReaders()
    try:
        assert readers.open(ring.name)
        off = ring.alloc(64)
        desc = ring.share(off, 0, 64)
        ring.deref(off)
        reply = {"k": {"key": "k", "status": "ok", "captures": {"keys": [[0, 1]], "ring": desc}},
                 "inline": {"key": "inline", "status": "ok", "captures": {"keys": [[0, 1]], "data": b"\0" * 4}},
                 "plain": {"key": "plain", "status": "ok"}}
        out = readers.materialize(reply, copy=False)
        assert "captures" not in out["k"] and out["k"]["status"] == "ok"
        assert out["inline"]["captures"]["data"] == b"\0" * 4 and out["plain"] == {"key": "plain", "status": "ok"}
        acks = readers.take_acks()
        assert acks == {ring.name: [off]}
        ring.release(acks[ring.name])
        assert ring.in_use == 0
    finally:
        readers.close()
        ring.close()


def test_a_region_is_reused_only_when_its_owner_and_every_slice_are_done():
    ring = CaptureRing(8 * ALIGN)
    try:
        step = ring.alloc(4 * ALIGN)  # a step's rows: the step holds one reference
        a = ring.share(step, 0, ALIGN)[1]
        b = ring.share(step, 2 * ALIGN, ALIGN)[1]
        later = ring.alloc(4 * ALIGN)
        assert ring.alloc(ALIGN) is None, "full"
        ring.deref(step)  # the step's host copy is gone; two slices still out
        ring.release([a])
        assert ring.alloc(ALIGN) is None, "slice b still holds the region"
        ring.release([b, b])  # acknowledged twice: the second is ignored
        assert ring.alloc(3 * ALIGN) == 0, "region free and at the tail: reused"
        ring.deref(later)
    finally:
        ring.close()


def test_a_ring_of_exactly_half_its_size_alternates_without_refusing():
    """Two regions of half the ring each, one always still being read while the next is written
    (the client acknowledges a step's slices with its next collect): every allocation finds room."""
    ring = CaptureRing(8 * ALIGN)
    try:
        live = ring.alloc(4 * ALIGN)
        for _ in range(6):
            nxt = ring.alloc(4 * ALIGN)
            assert nxt is not None
            ring.deref(live)
            live = nxt
        assert ring.full == 0
    finally:
        ring.close()


def test_the_ring_size_is_checked_and_sized_from_the_capture_buffer():
    from engine_ext import Engine
    from engine_ext.capture_ring import AUTO_MAX, AUTO_MIN, auto_size
    from engine_ext.errors import SpecError

    assert auto_size(256 << 20) == 512 << 20 and auto_size(1) == AUTO_MIN and auto_size(10 << 30) == AUTO_MAX
    for bad in (-1, 1.5, "big", True):
        with pytest.raises(SpecError) as err:
            Engine(model=str(model_path()), device="cpu", capture_ring_bytes=bad).start()
        assert err.value.field == "capture_ring_bytes"


def _capture_all(eng, prompts, sites):
    from engine_ext import GenerationParams

    spec = Interventions(capture=Capture.make(sites, "all_prompt"))
    gens = eng.generate(prompts, GenerationParams(max_tokens=2), spec)
    return [g.intervention.captures for g in gens]


@pytest.fixture(scope="module")
def mp_engine():
    from engine_ext import Engine

    before = _ring_files()
    eng = Engine(model=str(model_path()), device="cpu", multiprocess=True).start()
    yield eng
    eng.close()
    assert _ring_files() <= before, "the engine left a ring in /dev/shm"


PROMPTS = ["The capital of France is", "One two three four five six", "Rings of shared memory"]
SITES = ["L0.pre_attn", "L1.post_attn", "L2.post_block"]


def test_captures_through_the_ring_equal_the_in_process_engine(engine, mp_engine):
    assert mp_engine._loop.rings, "a multiprocess engine on this host hands captures over in shared memory"
    want = _capture_all(engine, PROMPTS, SITES)
    for _ in range(3):  # the ring's regions are reused
        got = _capture_all(mp_engine, PROMPTS, SITES)
        assert [sorted(g) for g in got] == [sorted(w) for w in want]
        for g, w in zip(got, want):
            for k, v in w.items():
                assert np.array_equal(g[k], v), k
                assert g[k].flags.writeable
    # every region read is acknowledged with the next collect: one more request frees them all
    last = _capture_all(mp_engine, PROMPTS[:1], SITES[:1])[0]
    rings = [w["capture_ring"] for w in mp_engine.intervention_status()["workers"]]
    assert rings and all(r is not None for r in rings)
    assert all(r["bytes"] >= 64 << 20 for r in rings), "sized from the capture buffer by default"
    unacked = -(-sum(v.nbytes for v in last.values()) // ALIGN) * ALIGN  # the last reply's region, not yet acknowledged
    assert all(0 < r["in_use"] <= unacked for r in rings), (rings, unacked)
    assert all(r["full"] == 0 and r["allocs"] > 0 for r in rings), rings


def test_captures_copied_by_the_readers_threads_equal_the_in_process_engine(engine, mp_engine, monkeypatch):
    """The same with every reply copied out by three threads while the results are converted
    (`EngineLoop._deliver_collected`): a caller sees each value only once it is copied."""
    import engine_ext.capture_ring as cr

    readers = mp_engine._loop.rings
    monkeypatch.setattr(cr, "PARALLEL_COPY_BYTES", 1)
    monkeypatch.setattr(readers, "threads", 3)
    want = _capture_all(engine, PROMPTS, SITES)
    for _ in range(2):
        got = _capture_all(mp_engine, PROMPTS, SITES)
        for g, w in zip(got, want):
            assert sorted(g) == sorted(w)
            for k, v in w.items():
                assert np.array_equal(g[k], v), k
    assert readers._pool is not None, "the threads copied"


def test_a_multiprocess_engine_froze_its_workers_startup_heaps(mp_engine):
    """The engine core's process (the worker's) froze its heap after causalboard's own start-up
    calls (`cb_freeze_heap`, issue 13; tests/test_startup_heap.py has the rest)."""
    assert len(mp_engine._workers_frozen) == 1 and mp_engine._workers_frozen[0] > 100_000, mp_engine._workers_frozen


def test_a_ring_too_small_sends_values_inline(engine):
    from engine_ext import Engine

    with Engine(model=str(model_path()), device="cpu", multiprocess=True, capture_ring_bytes=ALIGN) as small:
        assert small._loop.rings
        want = _capture_all(engine, PROMPTS[:2], SITES)
        got = _capture_all(small, PROMPTS[:2], SITES)
        for g, w in zip(got, want):
            assert sorted(g) == sorted(w)
            for k, v in w.items():
                assert np.array_equal(g[k], v)
        rings = [w["capture_ring"] for w in small.intervention_status()["workers"]]
        assert all(r["in_use"] == 0 and r["full"] > 0 and r["allocs"] == 0 for r in rings), rings
