"""`POST /v1/patch_sweep` on the real engine (bundled model, CPU): values against the
transformers oracle, the model card's causal-trace structure, alignment, noise floor, the
bad-input matrix, streaming, cancellation on disconnect, voiding, zoom and isolation."""

from __future__ import annotations

import asyncio
import json
import math
import time

import httpx
import numpy as np
import pytest

from engine_ext.reference.hf import RefEdit
from tests.sse import sse_events
from training.trace_structure import has_model_card_structure, mean_by_category, sweep_trace_facts

LOGPROB_ATOL = 2e-3


def sweep(http, **body) -> dict:
    r = http.post("/v1/patch_sweep", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def stream_sweep(http, body: dict, on_event=None) -> list[dict]:
    """POST a streaming sweep and read its events as they arrive; `on_event(events)` is called
    after each one and may return True to close the stream there (a client disconnect)."""
    events: list[dict] = []
    with http.stream("POST", "/v1/patch_sweep", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                if on_event is not None and on_event(events):
                    break
    return events


def equal_pair(tasks, k=0):
    return [p for p in tasks["pairs"] if p["equal_length"]][k]


def unequal_pair(tasks, k=0):
    return [p for p in tasks["pairs"] if not p["equal_length"]][k]


def pair_body(pair, **extra) -> dict:
    return {"prompt": pair["corrupt_prompt"], "clean_prompt": pair["clean_prompt"],
            "answer_token_id": pair["answer_id"], "foil_token_id": pair["foil_id"], **extra}


_RUNS_BEFORE: set[str] = set()


@pytest.fixture(autouse=True)
def _store_snapshot(engine):
    """Remember which runs other tests left in the shared engine's store."""
    _RUNS_BEFORE.clear()
    _RUNS_BEFORE.update(r["run_id"] for r in engine.source_store_usage()["runs"])


def assert_store_clean(engine):
    """No lease held and no run left behind by this test."""
    usage = engine.source_store_usage()
    assert all(r["leases"] == 0 for r in usage["runs"]), usage
    assert not [r for r in usage["runs"] if r["run_id"] not in _RUNS_BEFORE], usage


# ---- values ------------------------------------------------------------------------------------

def test_sweep_cells_match_the_reference_and_baselines(http, engine, hf_ref, tasks):
    pair = equal_pair(tasks)
    res = sweep(http, **pair_body(pair, metric="recovered"))
    clean = engine.score(pair["clean_prompt"], [pair["answer_id"], pair["foil_id"]])[pair["answer_id"]]
    corrupt = engine.score(pair["corrupt_prompt"], [pair["answer_id"], pair["foil_id"]])[pair["answer_id"]]
    assert abs(res["clean"] - clean) < 1e-5 and abs(res["corrupt"] - corrupt) < 1e-5
    assert res["metric"] == "recovered" and res["auto_captured"] is True
    n = len(engine.tokenize(pair["corrupt_prompt"]))
    assert res["layers"] == list(range(engine.info.num_layers)) and res["positions"] == list(range(n))
    grid = np.array(res["grid"], dtype=float)
    # restoring the last layer's output at the last position restores the clean answer exactly
    assert grid[-1, -1] == 1.0
    # the oracle: patch the clean post_block value at (layer, position) into the corrupt run
    clean_ids, ids = engine.tokenize(pair["clean_prompt"]), engine.tokenize(pair["corrupt_prompt"])
    for layer, pos in [(0, 1), (2, 1), (3, n - 1)]:
        target = hf_ref.run(clean_ids, capture=[(layer, "post_block")]).captures[(layer, "post_block")].numpy()[pos:pos + 1]
        ref = hf_ref.score(ids, [pair["answer_id"]], edits=[RefEdit.patch((layer, "post_block"), [pos], target)])
        raw = res["corrupt"] + grid[layer, pos] * (res["clean"] - res["corrupt"])
        assert abs(raw - ref[pair["answer_id"]]) <= LOGPROB_ATOL, (layer, pos, raw, ref)
    assert_store_clean(engine)


def test_sweep_reproduces_the_model_card_trace_structure(http, engine, tasks):
    """ROME-style noise sweeps (subject noised, post_block restored) averaged over fact prompts
    show the model card's structure: the subject's last token carries most of the answer through
    the early-middle layers (0-2), the last token takes over in the middle (layers 3-4) and carries
    everything at the end, the tokens in between carry nothing."""
    facts = sweep_trace_facts(tasks["facts"], lambda prompt: len(engine.tokenize(prompt)))
    assert len(facts) == 8
    traces = []
    for f in facts:
        res = sweep(http, prompt=f["prompt"], noise={"span": f["subject"], "samples": 4, "scale": 3.0},
                    answer_token_id=f["answer_id"], metric="recovered", recovered_basis="prob")
        assert res["metric"] == "recovered" and res["noise"]["samples"] == 4
        assert res["subject_positions"] == list(range(*f["subject_span"]))
        traces.append((np.array(res["grid"], dtype=float), f["subject_span"]))
    mean = mean_by_category(traces)
    assert has_model_card_structure(mean), mean


def test_unequal_lengths_are_aligned_and_the_middle_skipped(http, engine, tasks):
    pair = unequal_pair(tasks)
    clean_ids, ids = engine.tokenize(pair["clean_prompt"]), engine.tokenize(pair["corrupt_prompt"])
    res = sweep(http, **pair_body(pair, metric="logit_diff", hooks=["post_block"]))
    a = res["alignment"]
    assert (a["n_clean"], a["n_corrupt"]) == (len(clean_ids), len(ids))
    assert a["prefix_len"] + a["suffix_len"] <= min(len(ids), len(clean_ids))
    unaligned = set(range(a["prefix_len"], len(ids) - a["suffix_len"]))
    assert set(a["unaligned_positions"]) == unaligned and unaligned
    skipped = {s["position"]: s["reason"] for s in res["skipped"] if "layer" not in s}
    assert set(skipped) == unaligned and all(r.startswith("unaligned") for r in skipped.values())
    # the fork's shape: `positions`/`grid` hold the run positions only; `swept_positions` keeps them all
    assert res["swept_positions"] == list(range(len(ids)))
    assert res["positions"] == [p for p in range(len(ids)) if p not in unaligned]
    grid = np.array(res["grid"], dtype=float)
    assert grid.shape == (len(res["layers"]), len(res["positions"])) and not np.isnan(grid).any()
    assert res["hook_grids"][0]["grid"] == res["grid"]  # hooks=[one]: hook_grids filled, as in the fork
    # suffix positions map with the length difference: the last token patches from the clean last token
    assert a["position_map"][str(len(ids) - 1)] == len(clean_ids) - 1
    clean_ld = res["clean"]
    assert abs(grid[-1, -1] - clean_ld) < 1e-5  # the last layer at the last position restores clean


def test_noise_floor_is_reported_and_flags_cells(http, tasks):
    res = sweep(http, **pair_body(equal_pair(tasks, 1), metric="logprob", noise_floor_samples=3))
    nf = res["noise_floor_detail"]
    assert len(nf["in_batch"]) == 3 and len(nf["cell_repeats"]) == 3 and nf["units"] == "logprob"
    assert res["noise_floor"] == max([abs(v - nf["solo"]) for v in nf["in_batch"]] +
                                     [abs(r["repeat"] - r["first"]) for r in nf["cell_repeats"]])
    grid = np.array(res["grid"], dtype=float)
    for r in nf["cell_repeats"]:  # the grid shows each repeated cell's first run
        assert grid[res["layers"].index(r["layer"]), res["positions"].index(r["position"])] == r["first"]
    thr = res["within_noise_threshold"]
    flagged = {(c["layer"], c["position"]) for c in res["within_noise"]}
    for i, layer in enumerate(res["layers"]):
        for j, pos in enumerate(res["positions"]):
            assert ((layer, pos) in flagged) == (abs(grid[i, j] - res["corrupt"]) <= thr)
    # position 0 (BOS) is the same in both prompts: patching it changes nothing
    assert all((layer, 0) in flagged for layer in res["layers"])


def test_multi_hook_grids_and_stream_equal_to_json(http, engine, tasks):
    pair = equal_pair(tasks, 2)
    body = pair_body(pair, metric="logprob", hooks=["post_block", "pre_attn"])
    res = sweep(http, **body)
    grids = {g["hook"]: np.array(g["grid"], dtype=float) for g in res["hook_grids"]}
    # the request's order, as in the fork: `hook` / `grid` are the first requested hook's
    assert set(grids) == {"pre_attn", "post_block"} and res["hooks"] == ["post_block", "pre_attn"] and res["hook"] == "post_block"
    assert res["grid"] == res["hook_grids"][0]["grid"] and res["hook_grids"][0]["hook"] == "post_block"
    # pre_attn of layer L+1 is the same residual stream as post_block of layer L
    assert np.allclose(grids["pre_attn"][1:], grids["post_block"][:-1], atol=1e-5, rtol=0)
    with http.stream("POST", "/v1/patch_sweep", json={**body, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.read().decode())
    assert events[-1][1] == "[DONE]"
    ids = [e for e, _ in events[:-1]]
    assert ids == list(range(len(ids)))
    kinds = [d["type"] for _, d in events[:-1]]
    assert kinds[0] == "start" and kinds[-1] == "summary"
    start, summary = events[0][1], events[-2][1]
    cells = [d for _, d in events if isinstance(d, dict) and d["type"] == "cell"]
    assert len(cells) == start["cells_total"] == summary["cells_done"] == 2 * len(res["layers"]) * len(res["positions"])
    assert {"progress", "noise_floor", "checksum"} <= set(kinds)
    for g in summary["hook_grids"]:
        assert np.allclose(np.array(g["grid"], dtype=float), grids[g["hook"]], atol=1e-5, rtol=0)
    assert summary["checksum"]["consistent"] is True


def test_ablation_sources_and_undefined_recovered(http, engine, hf_ref, tasks):
    f = tasks["facts"][5]
    res = sweep(http, prompt=f["prompt"], source_module="zeros", answer_token_id=f["answer_id"], layers=[2], hook="post_attn",
                positions=[-1], metric="logprob")
    assert res["source"] == {"kind": "zeros", "name": "zeros"} and res["alignment"] is None
    ids = engine.tokenize(f["prompt"])
    ref = hf_ref.score(ids, [f["answer_id"]], edits=[RefEdit.zero((2, "post_attn"), [len(ids) - 1])])
    assert abs(res["grid"][0][0] - ref[f["answer_id"]]) <= LOGPROB_ATOL
    # clean == corrupt: recovered is undefined and the response says so instead of pretending
    same = sweep(http, prompt=f["prompt"], clean_prompt=f["prompt"], answer_token_id=f["answer_id"], metric="recovered", layers=[0])
    assert same["metric_requested"] == "recovered" and same["metric"] == "logprob"
    assert any("undefined" in n for n in same["notes"])


# ---- bad input ----------------------------------------------------------------------------------

BAD = [
    ({"prompt": ""}, 400, "prompt"),
    ({"hook": "attn_out"}, 400, "hook"),
    ({"hook": "resid"}, 400, "hook"),
    ({"hooks": ["post_block", "nope"]}, 400, "hooks[1]"),
    ({"layers": [0, 99]}, 400, "layers[1]"),
    ({"layers": {"start": 0, "stop": 99}}, 400, "layers.stop"),
    ({"layers": {"start": 3, "stop": 3}}, 400, "layers"),
    ({"positions": [999]}, 400, "positions[0]"),
    ({"positions": [{"span": "zzz-not-there"}]}, 400, "positions[0].span"),
    ({"answer_token_id": None}, 400, "answer_token"),
    ({"answer_token_id": None, "answer_token": "is ruled"}, 400, "answer_token"),
    ({"answer_token_id": 10**7}, 400, "answer_token_id"),
    ({"foil_token_id": None, "metric": "logit_diff"}, 400, "foil_token"),
    ({"metric": "kl"}, 400, "metric"),
    ({"alpha": "much"}, 400, "alpha"),
    ({"mask": {"indices": [10**6]}}, 400, "mask.indices[0]"),
    ({"source_inline": 0, "clean_prompt": None}, 400, "patch_vectors"),
    ({"source_inline": 0}, 400, "clean_prompt"),
    ({"clean_prompt": None}, 400, "clean_prompt"),
    ({"clean_prompt": None, "source_run": "never-stored"}, 404, "source_run"),
    ({"source_run": "bad id!"}, 400, "source_run"),
    ({"source_module": "no-such-vector"}, 404, "source_module"),
    ({"model": "gpt-9"}, 404, "model"),
    ({"noise": {"scale": 3.0}}, 400, "noise"),
    ({"unknown_field": 1}, 400, "unknown_field"),
    ({"clean_prompt": None, "metric": "recovered", "source_module": "zeros"}, 400, "clean_baseline"),
    ({"prompt": "word " * 5000}, 400, "prompt"),
]


@pytest.mark.parametrize("patch,status,field", BAD, ids=[b[2] + "-" + str(i) for i, b in enumerate(BAD)])
def test_bad_sweep_requests_name_the_field(http, engine, tasks, patch, status, field):
    body = {k: v for k, v in {**pair_body(equal_pair(tasks)), **patch}.items() if v is not None}
    before = engine.in_flight
    r = http.post("/v1/patch_sweep", json=body)
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()
    assert err["field"] == field and err["error"].startswith(field), err
    assert engine.in_flight == before
    assert_store_clean(engine)


def test_errors_of_a_streaming_request_are_plain_json(http, tasks):
    body = {**pair_body(equal_pair(tasks)), "layers": [42], "stream": True}
    with http.stream("POST", "/v1/patch_sweep", json=body) as r:
        assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
        assert json.loads(r.read())["field"] == "layers[0]"


def test_a_source_too_big_for_the_store_is_refused(http, engine, tasks):
    # keep_source captures 3 hooks x 6 layers x 117 positions x 1 KiB > the 2 MiB test store
    prompt = " ".join(["Garrow is ruled by"] * 29)
    r = http.post("/v1/patch_sweep", json={"prompt": prompt, "clean_prompt": prompt.replace("Garrow", "Guzar", 1),
                                           "answer_token": "Hadrian", "keep_source": True, "positions": [1]})
    assert r.status_code == 507 and r.json()["field"] == "clean_prompt" and "budget" in r.json()["error"]
    assert_store_clean(engine)


# ---- lifecycle: disconnect, voiding, eviction, zoom, isolation --------------------------------

def _wait_idle(engine, timeout=20.0) -> None:
    deadline = time.time() + timeout
    while engine.in_flight and time.time() < deadline:
        time.sleep(0.05)
    assert engine.in_flight == 0


def test_disconnect_cancels_remaining_cells_and_releases_leases(http, engine, tasks):
    f = tasks["facts"][7]
    body = {"prompt": f["prompt"], "noise": {"span": f["subject"], "samples": 8}, "answer_token_id": f["answer_id"],
            "metric": "recovered", "recovered_basis": "prob", "hooks": ["pre_attn", "post_attn", "post_block"],
            "max_concurrency": 2, "stream": True}
    seen = stream_sweep(http, body, lambda evs: sum(e["type"] == "cell" for e in evs) >= 3)
    start = seen[0]
    _wait_idle(engine)
    deadline = time.time() + 20
    while (summary := http.get(f"/v1/patch_sweep/{start['sweep_id']}").json()).get("cancelled") is None and time.time() < deadline:
        time.sleep(0.1)
    assert summary["cancelled"] is True and summary["cells_done"] < summary["cells_total"]
    assert not engine.has_source(start["captured_source_run"])
    assert_store_clean(engine)
    # and the engine keeps serving
    assert http.post("/v1/generate", json={"prompt": f["prompt"], "max_tokens": 1}).status_code == 200


def test_explicit_cancel_racing_the_disconnect_still_ends_the_sweep(http, engine, tasks):
    """DELETE /v1/patch_sweep/{id} sent while the client also closes the stream (what the
    dashboard does): the sweep is cancelled once, cleans up, and writes its summary."""
    f = tasks["facts"][7]
    body = {"prompt": f["prompt"], "noise": {"span": f["subject"], "samples": 8}, "answer_token_id": f["answer_id"],
            "metric": "recovered", "hooks": ["pre_attn", "post_attn", "post_block"], "max_concurrency": 2, "stream": True}
    def delete_at_first_cell(events: list[dict]) -> bool:
        if events[-1]["type"] != "cell":
            return False
        assert http.delete(f"/v1/patch_sweep/{events[0]['sweep_id']}").json()["cancelled"] is True
        return True  # ... and close the stream right away

    sweep_id = stream_sweep(http, body, delete_at_first_cell)[0]["sweep_id"]
    deadline = time.time() + 30
    while (summary := http.get(f"/v1/patch_sweep/{sweep_id}").json()).get("cancelled") is None and time.time() < deadline:
        time.sleep(0.1)
    assert summary["cancelled"] is True and summary["cells_done"] < summary["cells_total"]
    _wait_idle(engine)
    assert not engine.has_source(summary["captured_source_run"])
    assert_store_clean(engine)


def test_a_dropped_source_voids_cells_instead_of_reporting_unpatched_values(http, engine, tasks):
    pair = equal_pair(tasks, 3)
    engine.capture(pair["clean_prompt"], [f"L{l}.post_block" for l in range(engine.info.num_layers)], "all_prompt",
                   keep_as="doomed-run", return_values=False)
    body = pair_body(pair, clean_prompt=None, source_run="doomed-run", clean_baseline=0.0, metric="logprob",
                     max_concurrency=1, noise_floor_samples=1, stream=True)
    def drop_after_two_cells(evs: list[dict]) -> None:
        if evs[-1]["type"] == "cell" and sum(e["type"] == "cell" for e in evs) == 2:
            assert engine.drop_source("doomed-run")  # even though the sweep holds a lease

    events = stream_sweep(http, body, drop_after_two_cells)
    cells = [e for e in events if e["type"] == "cell"]
    summary = events[-1]
    assert summary["type"] == "summary" and not summary["cancelled"]
    voided = [c for c in cells if c["value"] is None]
    assert voided and all("doomed-run" in c["error"] or "source" in c["error"] for c in voided)
    assert summary["cells_voided"] == len(voided)
    assert {(s["layer"], s["position"]) for s in summary["skipped"] if "layer" in s} == {(c["layer"], c["position"]) for c in voided}
    # a voided cell is null in the grid, never the unpatched corrupt value
    grid = np.array(summary["grid"], dtype=float)
    for c in voided:
        assert np.isnan(grid[summary["layers"].index(c["layer"]), summary["positions"].index(c["position"])])
    assert_store_clean(engine)


def test_evicted_source_runs_are_reported_and_recaptured(http, engine, tasks):
    pair = equal_pair(tasks, 4)
    first = sweep(http, **pair_body(pair, metric="logprob", layers=[1, 2], keep_source=True))
    run_id = first["captured_source_run"]
    assert first["source_kept"] and engine.has_source(run_id)
    # fill the (2 MiB) store with other runs until the kept one is evicted (LRU, unleased)
    long_prompt = " ".join([pair["clean_prompt"]] * 20)
    sites = [f"L{l}.post_block" for l in range(engine.info.num_layers)]
    k = 0
    while engine.has_source(run_id):
        engine.capture(long_prompt, sites, "all_prompt", keep_as=f"filler-{k}", return_values=False)
        k += 1
        assert k < 20
    r = http.post("/v1/patch_sweep", json=pair_body(pair, clean_prompt=None, source_run=run_id, metric="logprob"))
    assert r.status_code == 404 and r.json()["field"] == "source_run" and "evicted" in r.json()["error"]
    again = sweep(http, **pair_body(pair, source_run=run_id, metric="logprob", layers=[1, 2]))
    assert again["auto_captured"] is True and np.allclose(np.array(again["grid"], dtype=float), np.array(first["grid"], dtype=float), atol=1e-5)
    for j in range(k):
        engine.drop_source(f"filler-{j}")
    assert_store_clean(engine)


def test_zoom_reuses_the_stored_source_run(http, engine, tasks):
    pair = equal_pair(tasks, 5)
    coarse = sweep(http, **pair_body(pair, metric="recovered", keep_source=True))
    run_id = coarse["captured_source_run"]
    zoom = sweep(http, **pair_body(pair, metric="recovered", source_run=run_id, layers=[0, 1], positions=[1, 2]))
    assert zoom["auto_captured"] is False and zoom["source"] == {"kind": "run", "run_id": run_id}
    g = np.array(coarse["grid"], dtype=float)
    assert np.allclose(np.array(zoom["grid"], dtype=float), g[0:2, 1:3], atol=1e-5)
    assert engine.has_source(run_id)  # a stored run given by the client is not dropped
    assert engine.drop_source(run_id)
    assert_store_clean(engine)


def test_concurrent_sweeps_equal_their_solo_runs(server_url, tasks):
    a, b = pair_body(equal_pair(tasks, 6), metric="logprob"), pair_body(unequal_pair(tasks, 1), metric="logprob", hooks=["post_attn", "post_block"])

    async def run(bodies):
        async with httpx.AsyncClient(base_url=server_url, timeout=120) as c:
            rs = await asyncio.gather(*(c.post("/v1/patch_sweep", json=bd) for bd in bodies))
        return [r.json() for r in rs]

    solo_a, = asyncio.run(run([a]))
    solo_b, = asyncio.run(run([b]))
    both = asyncio.run(run([a, b, a]))
    for solo, conc in ((solo_a, both[0]), (solo_b, both[1]), (solo_a, both[2])):
        floor = max(solo["noise_floor"], conc["noise_floor"], 1e-6)
        for h in solo["hooks"]:
            gs = np.array(next(g for g in (solo["hook_grids"] or [solo]) if g.get("hook", solo["hook"]) == h)["grid"], dtype=float)
            gc = np.array(next(g for g in (conc["hook_grids"] or [conc]) if g.get("hook", conc["hook"]) == h)["grid"], dtype=float)
            assert np.array_equal(np.isnan(gs), np.isnan(gc))
            # a different batch may round differently: allow the floor plus a few float32 ulps
            ulps = 4 * float(np.spacing(np.float32(np.nanmax(np.abs(gs)))))
            assert np.nanmax(np.abs(gs - gc)) <= floor + 1e-6 + ulps, (h, np.nanmax(np.abs(gs - gc)), floor, ulps)


def test_replay_after_last_event_id(http, tasks):
    res = sweep(http, **pair_body(equal_pair(tasks), metric="logprob", layers=[0]))
    sid = res["sweep_id"]
    full = sse_events(http.get(f"/v1/patch_sweep/{sid}/events").text)
    tail = sse_events(http.get(f"/v1/patch_sweep/{sid}/events", headers={"Last-Event-ID": "2"}).text)
    assert [e for e, _ in full[:-1]] == list(range(len(full) - 1))
    assert tail == full[3:]
    assert full[-2][1]["type"] == "summary" and full[-2][1]["grid"] == res["grid"]
    assert http.get("/v1/patch_sweep/sw-nope/events").status_code == 404
    assert math.isclose(http.get(f"/v1/patch_sweep/{sid}").json()["corrupt"], res["corrupt"])


def test_store_pressure_during_a_sweep_evicts_other_runs_not_the_leased_source(http, engine, tasks):
    """Under a tiny store budget, captures made while a sweep runs evict unleased runs; the
    sweep's leased source survives and no cell is voided or left unpatched."""
    pair = equal_pair(tasks, 7)
    engine.capture(pair["clean_prompt"], [f"L{l}.post_block" for l in range(engine.info.num_layers)], "all_prompt",
                   keep_as="pressured-src", return_values=False)
    reps = (engine.info.max_model_len - 8) // len(engine.tokenize(pair["clean_prompt"]))
    long_prompt = " ".join([pair["clean_prompt"]] * reps)
    fillers = []
    body = pair_body(pair, clean_prompt=None, source_run="pressured-src", clean_baseline=0.0, metric="logprob",
                     max_concurrency=1, noise_floor_samples=1, stream=True)
    def capture_a_filler(evs: list[dict]) -> None:
        if evs[-1]["type"] == "cell" and len(fillers) < 3:
            name = f"pressure-{len(fillers)}"
            engine.capture(long_prompt, [f"L{l}.post_block" for l in range(engine.info.num_layers)], "all_prompt",
                           keep_as=name, return_values=False)  # > 1 MiB each: the 2 MiB store must evict
            fillers.append(name)
            assert engine.has_source("pressured-src")

    events = stream_sweep(http, body, capture_a_filler)
    summary = events[-1]
    assert len(fillers) == 3 and not engine.has_source("pressure-0")  # pressure really evicted something
    assert summary["cells_voided"] == 0 and summary["cells_done"] == summary["cells_total"]
    ref = sweep(http, **pair_body(pair, metric="logprob"))  # same cells from a fresh capture
    assert np.allclose(np.array(summary["grid"], dtype=float), np.array(ref["grid"], dtype=float), atol=1e-5)
    for name in fillers + ["pressured-src"]:
        engine.drop_source(name)
    assert_store_clean(engine)
