"""The sweep fan-out's batches (`Engine.agenerate_many` groups) on the real engine (bundled model,
CPU): never more than `max_concurrency` cells in flight, more than one group in flight at once,
and the same grid as a sweep run one cell at a time."""

from __future__ import annotations

import threading
import time

import numpy as np

from app.sweep.service import GROUP_MAX, GROUPS_PER_WINDOW


def watch_in_flight(engine) -> tuple[list[int], threading.Event, threading.Thread]:
    """Poll `engine.in_flight` in a thread; the peak is in the returned list."""
    peak, stop = [0], threading.Event()

    def poll() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], engine.in_flight)
            time.sleep(0.0005)

    t = threading.Thread(target=poll, daemon=True)
    t.start()
    return peak, stop, t


def run_sweep(http, engine, body: dict) -> tuple[dict, int]:
    peak, stop, t = watch_in_flight(engine)
    try:
        r = http.post("/v1/patch_sweep", json=body)
    finally:
        stop.set()
        t.join()
    assert r.status_code == 200, r.text
    return r.json(), peak[0]


def test_batched_sweep_respects_max_concurrency_and_matches_one_cell_at_a_time(http, engine, tasks):
    pair = [p for p in tasks["pairs"] if p["equal_length"]][0]
    body = {"prompt": pair["corrupt_prompt"], "clean_prompt": pair["clean_prompt"], "answer_token_id": pair["answer_id"],
            "foil_token_id": pair["foil_id"], "metric": "logprob", "hooks": ["pre_attn", "post_attn", "post_block"]}
    limit = 8
    group = max(1, min(GROUP_MAX, -(-limit // GROUPS_PER_WINDOW)))
    batched, peak = run_sweep(http, engine, {**body, "max_concurrency": limit})
    assert batched["cells_done"] == batched["cells_total"] > limit and not batched["cancelled"]
    assert peak <= limit, f"{peak} requests in flight with max_concurrency {limit}"
    assert peak > group, f"at most one group ({group} cells) was ever in flight (peak {peak})"

    serial, peak1 = run_sweep(http, engine, {**body, "max_concurrency": 1})
    assert peak1 == 1
    for a, b in zip(batched["hook_grids"], serial["hook_grids"]):
        assert a["hook"] == b["hook"]
        ga, gb = np.array(a["grid"], dtype=float), np.array(b["grid"], dtype=float)
        assert ga.shape == gb.shape and not np.isnan(ga).any()
        assert np.allclose(ga, gb, atol=1e-4), np.abs(ga - gb).max()
    assert engine.in_flight == 0


def test_noise_samples_count_once_per_cell_against_the_limit(http, engine, tasks):
    f = tasks["facts"][7]
    limit, samples = 3, 2
    body = {"prompt": f["prompt"], "noise": {"span": f["subject"], "samples": samples}, "answer_token_id": f["answer_id"],
            "metric": "logprob", "hooks": ["post_block"], "max_concurrency": limit}
    res, peak = run_sweep(http, engine, body)
    assert res["cells_done"] == res["cells_total"] > limit
    assert samples < peak <= limit * samples, peak
    assert engine.in_flight == 0


def test_the_clean_capture_and_the_corrupt_baselines_are_in_flight_together(http, engine, tasks, monkeypatch):
    """Phase 1 submits the clean run's capture and the corrupt solo baselines (one per noise
    sample) at once instead of one round trip after another; the sweep's result is unchanged."""
    intervals: list[tuple[str, float, float]] = []
    orig = engine.agenerate

    async def timed(prompt, params, interventions=None, **kw):
        t = time.monotonic()
        try:
            return await orig(prompt, params, interventions, **kw)
        finally:
            kind = "capture" if interventions is not None and interventions.capture is not None else "score"
            intervals.append((kind, t, time.monotonic()))

    pair = [p for p in tasks["pairs"] if p["equal_length"]][0]
    body = {"prompt": pair["corrupt_prompt"], "clean_prompt": pair["clean_prompt"], "answer_token_id": pair["answer_id"],
            "foil_token_id": pair["foil_id"], "metric": "recovered", "hooks": ["post_block"], "layers": [0]}
    before, _ = run_sweep(http, engine, body)
    monkeypatch.setattr(engine, "agenerate", timed)
    after, _ = run_sweep(http, engine, body)
    capture = [iv for iv in intervals if iv[0] == "capture"]
    scores = [iv for iv in intervals if iv[0] == "score"]
    assert len(capture) == 1 and scores, intervals
    _, c0, c1 = capture[0]
    assert any(s0 < c1 and c0 < s1 for _, s0, s1 in scores), f"no baseline overlapped the capture: {intervals}"
    assert after["grid"] == before["grid"] and after["corrupt"] == before["corrupt"] and after["clean"] == before["clean"]
    assert engine.in_flight == 0


def test_a_sweep_makes_three_control_calls_two_of_them_alongside_other_work(http, engine, tasks, monkeypatch):
    """Control round trips a sweep with an auto-captured clean run makes (each waits for the
    engine core's current step): the workers lease the clean run as they store it (no
    `cb_store lease`), the start's checksum is read while phase 1 computes, and the end drops
    the run (no `release` first: a drop removes a leased run) while reading the final checksum.
    The run is leased while the sweep runs and gone after it."""
    calls: list[tuple[str, tuple]] = []
    orig_send = engine._send_rpc  # every control call (`_rpc`, `_arpc`) goes through it
    orig = engine._rpc

    def spy(method, args):
        calls.append((method, args))
        return orig_send(method, args)

    pair = [p for p in tasks["pairs"] if p["equal_length"]][0]
    body = {"prompt": pair["corrupt_prompt"], "clean_prompt": pair["clean_prompt"], "answer_token_id": pair["answer_id"],
            "foil_token_id": pair["foil_id"], "metric": "recovered", "hooks": ["post_block"], "layers": [0, 1]}
    before, _ = run_sweep(http, engine, body)
    monkeypatch.setattr(engine, "_send_rpc", spy)
    leases: list[int] = []

    def leased_now() -> None:
        usage = orig("cb_store", "usage")  # through the spy too: left out of `names` below
        leases.extend(r["leases"] for u in usage for r in u["runs"] if r["run_id"].startswith("sweep"))

    watcher_stop = threading.Event()

    def watch() -> None:
        while not watcher_stop.is_set():
            leased_now()
            time.sleep(0.002)

    w = threading.Thread(target=watch, daemon=True)
    w.start()
    try:
        after, _ = run_sweep(http, engine, body)
    finally:
        watcher_stop.set()
        w.join()
    names = [(m, a[0] if a else None) for m, a in list(calls) if a != ("usage",)]
    assert names.count(("cb_status", None)) == 2, names
    assert [n for n in names if n[0] == "cb_store"] == [("cb_store", "drop")], names
    assert 1 in leases, "the clean run was never seen leased during the sweep"
    assert after["grid"] == before["grid"] and after["clean"] == before["clean"] and after["corrupt"] == before["corrupt"]
    assert after["captured_source_run"] not in [r["run_id"] for u in orig("cb_store", "usage") for r in u["runs"]]
    assert engine.in_flight == 0


def test_a_segmented_sweeps_cell_group_is_built_off_the_event_loop(http, engine, tasks, monkeypatch):
    """The one group of a segmented sweep's cells (`Engine.prepare_cells`) is built in a worker
    thread, not on the API's event loop (which keeps serving other requests meanwhile); the grid
    is the same."""
    pair = [p for p in tasks["pairs"] if p["equal_length"]][0]
    filler = "".join(("and ", "then ")[k % 2] for k in range(27))  # 32 tokens: whole KV blocks on the CPU
    body = {"prompt": filler + pair["corrupt_prompt"], "clean_prompt": filler + pair["clean_prompt"],
            "answer_token_id": pair["answer_id"], "foil_token_id": pair["foil_id"], "metric": "logprob",
            "hooks": ["post_block"], "layers": [0], "prefix_reuse": False}
    assert engine.segment_layout(len(engine.tokenize(body["prompt"]))) is not None, "the sweep would not be segmented"
    seen: list[str] = []
    orig = engine.prepare_cells

    def spy(*a, **k):
        seen.append(threading.current_thread().name)
        return orig(*a, **k)

    before, _ = run_sweep(http, engine, body)
    monkeypatch.setattr(engine, "prepare_cells", spy)
    after, _ = run_sweep(http, engine, body)
    assert len(seen) == 1, f"the sweep did not prepare its cells as one group: {seen}"
    assert seen[0].startswith("AnyIO worker thread"), seen
    assert after["grid"] == before["grid"] and after["cells_done"] == after["cells_total"] >= 30
