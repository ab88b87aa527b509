"""Captured values through shared memory (`engine_ext.capture_ring`).

Fast tier: the ring's allocator against a model of it (random allocations and out-of-order frees:
live regions never overlap and stay inside the ring; a full ring says so instead of overwriting,
and only when no gap holds the region; a region held long holds only its own bytes), the client's
copy-out and acknowledgements, lent values (views of the ring, acknowledged only once the last
value viewing them is garbage, within `LEND_SHARE` of the ring, copied beyond), and that no file
stays in /dev/shm.

Engine tier (real vLLM on CPU, the engine core in its own process): captures that came through
the ring equal, bit for bit, the same captures from the session's in-process engine; the regions
are given back once read (copied) or once dropped (lent), and values a caller keeps lent stay
unchanged while many more requests pass through the ring; with a ring too small for a result the values come inline, equal too;
nothing is left in /dev/shm after the engine closes."""

from __future__ import annotations

import contextlib
import gc
import os
import random

import numpy as np
import pytest

from engine_ext.capture_ring import ALIGN, SHM_DIR, CaptureRing, RingReaders
from engine_ext.specs import Capture, Interventions

from .conftest import model_path


def _ring_files() -> set[str]:
    return {f for f in os.listdir(SHM_DIR) if f.startswith("causalboard-ring-")}


@contextlib.contextmanager
def _mapped_ring(size: int, lend: bool | None = None):
    """A worker's ring of `size` bytes and the client's readers with it mapped; both closed after."""
    ring = CaptureRing(size)
    readers = RingReaders(lend) if lend is not None else RingReaders()
    try:
        assert readers.open(ring.name)
        yield ring, readers
    finally:
        readers.close()
        ring.close()


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
                # refused only when no gap between live regions (or at either end) holds it
                size = -(-n // ALIGN) * ALIGN
                ends = sorted(live.items())
                gaps = [b - (a + sa) for (a, sa), (b, _) in zip([(0, 0)] + ends, ends + [(ring.size, 0)])]
                assert max(gaps) < size, (gaps, size)
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
    with _mapped_ring(1 << 16, lend=False) as (ring, readers):
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


def test_a_large_reply_is_copied_out_by_several_threads(monkeypatch):
    """A reply of at least `PARALLEL_COPY_BYTES` (lowered here) is copied by the reader's threads,
    each block into a writable array of its own, equal to what the ring held and independent of it;
    a smaller reply takes the one-thread path (the same kind of arrays)."""
    import engine_ext.capture_ring as cr

    monkeypatch.setattr(cr, "PARALLEL_COPY_BYTES", 4096)
    with _mapped_ring(1 << 20, lend=False) as (ring, readers):
        readers.threads = 3
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

    with _mapped_ring(1 << 16, lend=False) as (ring, readers):
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
    with _mapped_ring(1 << 16) as (ring, readers):
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


def test_a_region_held_long_holds_only_its_own_bytes():
    """Next-fit allocation: one old region still referenced (a value a caller keeps lent) does not
    stop the ring from reusing the free space after it, nor before it once the newest regions
    reach the end."""
    ring = CaptureRing(8 * ALIGN)
    try:
        regions = [ring.alloc(2 * ALIGN) for _ in range(4)]
        assert regions == [0, 2 * ALIGN, 4 * ALIGN, 6 * ALIGN] and ring.alloc(ALIGN) is None
        for off in regions[:1] + regions[2:]:
            ring.deref(off)  # the second region stays referenced
        assert ring.in_use == 2 * ALIGN
        assert ring.alloc(4 * ALIGN) == 4 * ALIGN, "the gap after the held region"
        assert ring.alloc(2 * ALIGN) == 0, "and the one before it"
        assert ring.alloc(ALIGN) is None and ring.full == 2
    finally:
        ring.close()


def _lendable_reply(ring, values: list[np.ndarray]) -> dict:
    """A reply of one result per array, the arrays one after another in one region of the ring
    (as one step's results lie), the step's own reference dropped."""
    total = sum(v.nbytes for v in values)
    region = ring.alloc(total)
    reply, at = {}, 0
    for i, v in enumerate(values):
        ring.buffer(region + at, v.nbytes)[:] = v.tobytes()
        reply[f"r{i}"] = {"key": f"r{i}", "status": "ok",
                          "captures": {"keys": [[0, j] for j in range(len(v) // 4)], "ring": ring.share(region, at, v.nbytes)}}
        at += v.nbytes
    ring.deref(region)
    return reply


def test_lent_values_view_the_ring_until_the_last_one_is_dropped():
    """A lent reply: each block a writable view of the ring (no copy), its values the ring's bytes;
    nothing is acknowledged while any value viewing the run is alive — not the reply, not a
    converted result's captures, not a torch tensor made from one —, everything at once when the
    last goes, from whichever thread drops it; then the worker's region is free."""
    import threading

    import torch

    from engine_ext.engine.outputs import _intervention_result

    with _mapped_ring(1 << 16, lend=True) as (ring, readers):
        rng = np.random.default_rng(1)
        vals = [rng.standard_normal(16).astype("<f4") for _ in range(3)]
        out, copied = readers.materialize_started(_lendable_reply(ring, vals))
        copied()
        assert readers.lent_replies == 1 and readers.copied_replies == 0
        datas = [out[f"r{i}"]["captures"]["data"] for i in range(3)]
        ring_bytes = np.frombuffer(readers._maps[ring.name][1], np.uint8)
        for d, v in zip(datas, vals):
            assert d.flags.writeable and np.shares_memory(d, ring_bytes), "a view of the ring, not a copy"
            assert np.array_equal(np.frombuffer(d, "<f4"), v)
        assert readers.status()["lent_bytes"] == {ring.name: 3 * 64}
        results = [_intervention_result(out[f"r{i}"], None) for i in range(3)]
        del out, datas, d
        gc.collect()
        assert readers.take_acks() == {}, "the converted results still view the ring"
        kept = torch.from_numpy(results[2].captures[next(iter(results[2].captures))])
        del results
        gc.collect()
        assert readers.take_acks() == {}, "a torch tensor made from a value keeps the run lent"
        assert float(kept[0]) == float(vals[2][0])
        holder = [kept]  # the last value goes on another thread
        del kept
        t = threading.Thread(target=holder.clear)
        t.start()
        t.join()
        acks = readers.take_acks()
        assert sorted(acks[ring.name]) == sorted(ring._slices), "every slice of the run, once"
        assert readers.status()["lent_bytes"] == {}
        ring.release(acks[ring.name])
        assert ring.in_use == 0


def test_lending_stops_at_its_share_of_the_ring_and_copies_beyond():
    """What is lent of a ring stays within `LEND_SHARE` of it: a reply that would pass it is
    copied and acknowledged at once (the caller's values its own); once lent values are dropped,
    lending resumes. A ring mapped read-only is never lent from."""
    from engine_ext.capture_ring import LEND_SHARE

    with _mapped_ring(16 * 1024, lend=True) as (ring, readers):
        share = int(LEND_SHARE * ring.size)
        first = readers.materialize(_lendable_reply(ring, [np.full(share // 4 - 16, 1.0, "<f4")]))
        assert readers.lent_replies == 1
        second = readers.materialize(_lendable_reply(ring, [np.full(64, 2.0, "<f4")]))
        assert readers.copied_replies == 1, "past the share: copied"
        data = second["r0"]["captures"]["data"]
        assert not np.shares_memory(data, np.frombuffer(readers._maps[ring.name][1], np.uint8))
        assert np.all(np.frombuffer(data, "<f4") == 2.0)
        assert len(readers.take_acks()[ring.name]) == 1, "the copied slice, at once"
        del first
        assert len(readers.take_acks()[ring.name]) == 1, "the lent one, once dropped"
        readers.materialize(_lendable_reply(ring, [np.full(64, 3.0, "<f4")]))
        assert readers.lent_replies == 2
        readers._writable.discard(ring.name)
        readers.materialize(_lendable_reply(ring, [np.full(64, 4.0, "<f4")]))
        assert readers.lent_replies == 2 and readers.copied_replies == 2


def test_the_lend_setting(monkeypatch):
    from engine_ext.capture_ring import lend_values

    monkeypatch.delenv("CAUSALBOARD_RING_LEND", raising=False)
    assert lend_values() and RingReaders().lend
    monkeypatch.setenv("CAUSALBOARD_RING_LEND", "0")
    assert not lend_values() and not RingReaders().lend and RingReaders(lend=True).lend


def test_rings_left_by_ended_processes_are_swept_at_the_next_ring():
    """A ring file whose process is gone (killed before its client mapped it, or before it closed
    it) and older than `STALE_AFTER_S` is removed when a worker creates its ring; a fresh one, a
    live process's and a file of another name stay."""
    import subprocess
    import sys
    import time

    from engine_ext.capture_ring import STALE_AFTER_S, sweep_stale

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    dead = int(gone.stdout)
    names = {"old_dead": f"causalboard-ring-{dead}-1", "new_dead": f"causalboard-ring-{dead}-2",
             "old_live": f"causalboard-ring-{os.getppid()}-99", "other": f"causalboard-ringx-{dead}-1"}
    old = time.time() - 2 * STALE_AFTER_S
    try:
        for key, name in names.items():
            with open(os.path.join(SHM_DIR, name), "wb") as f:
                f.write(b"x")
            if key != "new_dead":
                os.utime(os.path.join(SHM_DIR, name), (old, old))
        assert sweep_stale() == [names["old_dead"]]
        left = set(os.listdir(SHM_DIR))
        assert names["old_dead"] not in left and {names["new_dead"], names["old_live"], names["other"]} <= left
        os.utime(os.path.join(SHM_DIR, names["new_dead"]), (old, old))
        ring = CaptureRing.create(1 << 16)  # a worker's new ring sweeps first
        assert ring is not None and names["new_dead"] not in os.listdir(SHM_DIR)
        ring.close()
    finally:
        for name in names.values():
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except FileNotFoundError:
                pass


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
    assert mp_engine._loop.rings.lent_replies > 0, "the values were lent (views of the ring)"
    # every region read is acknowledged with the next collect once its values are dropped (lent)
    # or at once (copied): one more request frees them all
    del got, g
    gc.collect()
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
    monkeypatch.setattr(readers, "lend", False)
    want = _capture_all(engine, PROMPTS, SITES)
    for _ in range(2):
        got = _capture_all(mp_engine, PROMPTS, SITES)
        for g, w in zip(got, want):
            assert sorted(g) == sorted(w)
            for k, v in w.items():
                assert np.array_equal(g[k], v), k
    assert readers._pool is not None, "the threads copied"


@pytest.fixture(scope="module")
def small_ring_engine():
    """A multiprocess engine whose ring holds 256 KiB (~41 KB of values a `_capture_all` call)."""
    from engine_ext import Engine

    with Engine(model=str(model_path()), device="cpu", multiprocess=True, capture_ring_bytes=256 << 10) as eng:
        yield eng


def test_lent_values_a_caller_keeps_stay_unchanged_while_the_ring_is_reused(engine, small_ring_engine):
    """A small ring (256 KiB, ~41 KB of values a call here), one call's values kept lent while
    twelve more calls pass through it (the ring wraps several times; each call's values lent
    while the previous call's are still alive, or copied where that would pass `LEND_SHARE`):
    the kept values never change (the worker writes a region again only after every slice of it
    is given back), every later result is right although callers write into their own lent
    values, and once dropped the values' regions are given back."""
    eng = small_ring_engine
    readers = eng._loop.rings
    assert readers and readers.lend
    lent0 = readers.lent_replies
    want = _capture_all(engine, PROMPTS, SITES)
    kept = _capture_all(eng, PROMPTS, SITES)
    kept_copy = [{k: v.copy() for k, v in c.items()} for c in kept]
    per_call = sum(v.nbytes for c in kept for v in c.values())
    assert readers.lent_replies == lent0 + 1 and 30_000 < per_call < 60_000, per_call
    for _ in range(12):
        got = _capture_all(eng, PROMPTS, SITES)
        for g, w in zip(got, want):
            assert sorted(g) == sorted(w)
            for k, v in w.items():
                assert np.array_equal(g[k], v), k
        for g in got:
            for v in g.values():
                v[:] = -1.0  # a caller writing into its own (lent or copied) value
    ring = eng.intervention_status()["workers"][0]["capture_ring"]
    assert ring["allocs"] * per_call > 2 * ring["bytes"], ("the ring wrapped", ring)
    assert readers.lent_replies >= lent0 + 6, readers.status()
    for c, w in zip(kept, kept_copy):
        for k, v in w.items():
            assert np.array_equal(c[k], v), k
    del kept, got, g, c, v
    gc.collect()
    last = _capture_all(eng, PROMPTS[:1], SITES[:1])[0]
    held = sum(readers.status()["lent_bytes"].values())
    assert held <= sum(v.nbytes for v in last.values()), (held, readers.status())
    ring = eng.intervention_status()["workers"][0]["capture_ring"]
    assert ring["in_use"] <= -(-held // ALIGN) * ALIGN + ALIGN, ring


def test_a_multiprocess_engine_froze_its_workers_startup_heaps(mp_engine):
    """The engine core's process (the worker's) froze its heap after causalboard's own start-up
    calls (`cb_freeze_heap`, issue 13; tests/test_startup_heap.py has the rest)."""
    assert len(mp_engine._workers_frozen) == 1 and mp_engine._workers_frozen[0] > 100_000, mp_engine._workers_frozen


def test_values_too_large_for_the_ring_come_inline(engine, small_ring_engine):
    """A reply larger than the ring (every site at every prompt position of a long prompt:
    ~560 KB against 256 KiB) finds no room: its values travel in the reply itself, equal."""
    from engine_ext.sites import HOOKS

    prompts = ["one two three four five six seven eight nine ten eleven twelve thirteen fourteen"]
    sites = [f"L{layer}.{hook}" for layer in range(small_ring_engine.info.num_layers) for hook in HOOKS]
    before = small_ring_engine.intervention_status()["workers"][0]["capture_ring"]
    want = _capture_all(engine, prompts, sites)
    got = _capture_all(small_ring_engine, prompts, sites)
    assert sum(v.nbytes for v in got[0].values()) > before["bytes"]
    for g, w in zip(got, want):
        assert sorted(g) == sorted(w)
        for k, v in w.items():
            assert np.array_equal(g[k], v)
    after = small_ring_engine.intervention_status()["workers"][0]["capture_ring"]
    assert after["full"] > before["full"] and after["allocs"] == before["allocs"], (before, after)
