"""Tensor and pipeline parallelism on CPU (real vLLM, bundled model, fp32): the same requests on a
TP=2 and on a PP=2 engine against the session's one-rank engine.

Each topology starts ONE engine for the module (`ranked`, two worker processes, one core each;
~30-60 s), torn down before the next. Run these alone with `scripts/run_tests.sh -m multirank`.

Tolerances (fp32). With TP=2 each rank computes half of every row-parallel matmul (attention's
`o_proj`, the MLP's `down_proj`) and the halves are added by an all-reduce: the sums run in another
order than one rank's single GEMM, which moves the last bits of the residual stream (observed
here: ~1e-6 relative). With PP=2 each stage runs its layers on one core instead of two, so GEMMs
may block differently. Neither is a semantic difference, so the bounds are set well above rounding
and far below any intervention's effect (a steer of norm 4 moves logprobs by >0.1):
captures within CAPTURE_ATOL + CAPTURE_RTOL * |value|, logprobs within LOGPROB_ATOL, and sweep
cells within the larger of the two sweeps' measured noise floors (plus LOGPROB_ATOL, since the
cells are normalised differences of such logprobs). Token ids must be equal.
"""

from __future__ import annotations


import httpx
import numpy as np
import pytest

from engine_ext import GenerationParams
from engine_ext.sites import HOOKS
from engine_ext.specs import Capture, Clamp, Interventions, Noise, Patch, Steer
from tests.conftest import (capture_until_evicted, drop_captures_until_evicted, free_port, model_path, serve_in_thread,
                            wait_healthy)

pytestmark = pytest.mark.multirank

CAPTURE_ATOL, CAPTURE_RTOL = 1e-4, 1e-4
LOGPROB_ATOL = 1e-3
TOPOLOGIES = {"tp2": {"tensor_parallel_size": 2}, "pp2": {"pipeline_parallel_size": 2}}


@pytest.fixture(scope="module", params=list(TOPOLOGIES))
def ranked(request):
    """A two-rank engine (TP=2 or PP=2) with the session engine's settings."""
    from engine_ext import Engine

    eng = Engine(model=str(model_path()), device="cpu", source_store_bytes=2 * 1024 * 1024,
                 **TOPOLOGIES[request.param]).start()
    eng.name = request.param
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def ranked_http(ranked):
    """A real HTTP server on the two-rank engine."""
    from app.api.app import create_app

    with serve_in_thread(create_app(ranked), "server on the multi-rank engine") as url:
        with httpx.Client(base_url=url, timeout=300) as client:
            yield client


def _vec(engine, seed: int, norm: float = 4.0) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(engine.info.hidden_size).astype(np.float32)
    return v * (norm / np.linalg.norm(v))


def _assert_logprobs_close(got, want, what: str) -> None:
    assert got.token_ids == want.token_ids, what
    diff = np.max(np.abs(np.asarray(got.logprobs) - np.asarray(want.logprobs)))
    assert diff <= LOGPROB_ATOL, f"{what}: logprobs differ by {diff:.3g}"


def _stages_layers(engine) -> list[tuple[int, int]]:
    return [tuple(s["layers"]) for s in engine.info.topology["stages"]]


# ---- the plain command -----------------------------------------------------------------------------
def test_serve_with_tensor_parallel_size_2_is_the_plain_command(tmp_path):
    """`causalboard serve --tensor-parallel-size 2` on CPU: no thread-binding variable to set by
    hand; it reports the topology, steers, and stops cleanly on SIGTERM with its ranks."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from tests.conftest import REPO

    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_OMP_THREADS_BIND"}
    env.update(HOST="127.0.0.1", PORT=str(port))
    log_path = tmp_path / "serve.log"
    with open(log_path, "w+") as log:
        proc = subprocess.Popen([str(Path(sys.executable).parent / "causalboard"), "serve", "--tensor-parallel-size", "2"],
                                env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        try:
            wait_healthy(f"http://127.0.0.1:{port}", proc, lambda: log_path.read_text()[-3000:], timeout=300, every=1)
            status = httpx.get(f"http://127.0.0.1:{port}/v1/status", timeout=30).json()
            assert status["topology"]["tensor_parallel_size"] == 2 and status["checksum"]["ranks"] == 2
            vec = [0.0] * status["hidden_size"]
            vec[0] = 4.0
            body = {"prompt": "The capital of", "max_tokens": 2,
                    "interventions": {"steer": [{"sites": ["L1.post_block"], "vector": vec}]}}
            r = httpx.post(f"http://127.0.0.1:{port}/v1/generate", json=body, timeout=120)
            assert r.status_code == 200 and len(r.json()["token_ids"]) == 2, r.text
            assert httpx.get(f"http://127.0.0.1:{port}/v1/status", timeout=30).json()["checksum"]["consistent"] is True
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=90) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
    assert "Application shutdown complete" in log_path.read_text()


# ---- topology ----------------------------------------------------------------------------------
def test_topology_is_reported_by_the_engine_and_the_api(ranked, ranked_http, engine):
    n = engine.info.num_layers
    topo = ranked.info.topology
    assert ranked.info.num_layers == n
    if ranked.name == "tp2":
        assert (topo["tensor_parallel_size"], topo["pipeline_parallel_size"]) == (2, 1)
        assert _stages_layers(ranked) == [(0, n - 1)] and topo["stages"][0]["tp_ranks"] == [0, 1]
    else:
        assert (topo["tensor_parallel_size"], topo["pipeline_parallel_size"]) == (1, 2)
        layers = _stages_layers(ranked)
        assert len(layers) == 2 and layers[0][0] == 0 and layers[1][1] == n - 1 and layers[1][0] == layers[0][1] + 1
    # the workers hand captures over through shared-memory rings; the client copies only the
    # values it merges: each stage leader's (TP: rank 0's; the other rank's slices are only
    # acknowledged, and the capture tests below check the values it does merge)
    assert ranked._loop.rings
    assert ranked._loop.capture_ranks == (frozenset({0}) if ranked.name == "tp2" else None)
    status = ranked_http.get("/v1/status").json()
    assert status["topology"] == topo
    assert engine.info.topology["tensor_parallel_size"] == 1 and engine.info.topology["pipeline_parallel_size"] == 1


# ---- captures ----------------------------------------------------------------------------------
def test_captures_at_every_hook_and_layer_equal_one_rank(ranked, engine, tasks):
    prompt = tasks["facts"][3]["prompt"]
    sites = [f"L{L}.{h}" for L in range(engine.info.num_layers) for h in HOOKS]
    got = ranked.capture(prompt, sites, "all_prompt").captures
    want = engine.capture(prompt, sites, "all_prompt").captures
    assert set(got) == set(want) and len(got) == len(sites) * len(engine.tokenize(prompt))
    worst = 0.0
    for key, w in want.items():
        excess = np.abs(got[key] - w) - (CAPTURE_ATOL + CAPTURE_RTOL * np.abs(w))
        worst = max(worst, float(np.max(np.abs(got[key] - w))))
        assert (excess <= 0).all(), f"{ranked.name} {key}: max excess {excess.max():.3g}"
    print(f"{ranked.name}: largest capture difference vs one rank {worst:.3g}")


def test_captures_of_generated_tokens_on_every_stage(ranked, engine, tasks):
    prompt = tasks["facts"][5]["prompt"]
    n = engine.info.num_layers
    params = GenerationParams(max_tokens=4, ignore_eos=True, logprobs=0)
    spec = Interventions(capture=Capture.make(["L0.post_block", f"L{n - 1}.pre_attn"], "all_generated"))
    got, want = ranked.generate(prompt, params, spec), engine.generate(prompt, params, spec)
    _assert_logprobs_close(got, want, "capture run")
    assert set(got.captures) == set(want.captures) and len(got.captures) == 2 * 3
    for key, w in want.captures.items():
        assert np.allclose(got.captures[key], w, atol=CAPTURE_ATOL, rtol=CAPTURE_RTOL), key


# ---- steering, noise, scoring, patching ----------------------------------------------------------
def test_steering_noise_and_scores_equal_one_rank_on_every_stage(ranked, engine, tasks):
    prompt = tasks["facts"][8]["prompt"]
    n = engine.info.num_layers
    params = GenerationParams(max_tokens=6, ignore_eos=True, logprobs=0)
    cases = {
        "steer first and last layer": Interventions(steer=(
            Steer.make(["L1.pre_attn"], _vec(engine, 1), scale=2.0),
            Steer.make([f"L{n - 1}.post_attn"], _vec(engine, 2), scale=1.5, positions="all_prompt"))),
        "noise": Interventions(noise=Noise.make([1, 2], scale=3.0, seed=4)),
        "steer + noise + score": Interventions(steer=(Steer.make([f"L{n // 2}.post_block"], _vec(engine, 3)),),
                                               noise=Noise.make([0], seed=9), score_token_ids=(5, 7)),
    }
    plain = engine.generate(prompt, params)
    for what, spec in cases.items():
        got, want = ranked.generate(prompt, params, spec), engine.generate(prompt, params, spec)
        assert got.intervention.status == want.intervention.status == "ok", (what, got.intervention.errors)
        _assert_logprobs_close(got, want, f"{ranked.name} {what}")
        assert got.logprobs != plain.logprobs, f"{what} had no effect"
    ids = [tasks["facts"][8]["answer_id"], 5]
    got, want = ranked.score(prompt, ids), engine.score(prompt, ids)
    assert all(abs(got[t] - want[t]) <= LOGPROB_ATOL for t in ids)


def test_patches_from_a_run_stored_across_stages_equal_one_rank(ranked, engine, tasks):
    pair = [p for p in tasks["pairs"] if p["equal_length"]][0]
    n = engine.info.num_layers
    sites = [f"L{L}.{h}" for L in range(n) for h in HOOKS]
    params = GenerationParams(max_tokens=3, ignore_eos=True, logprobs=0)
    for eng in (ranked, engine):
        g = eng.capture(pair["clean_prompt"], sites, "all_prompt", keep_as="mr-clean", return_values=False)
        assert g.intervention.stored_as == "mr-clean"
    info = ranked.source_info("mr-clean")
    assert info is not None and info["sites"] == engine.source_info("mr-clean")["sites"]
    assert info["positions"] == engine.source_info("mr-clean")["positions"]
    last = len(engine.tokenize(pair["corrupt_prompt"])) - 1
    spec = Interventions(patch=(
        Patch.make("L0.post_block", [1], {"run": "mr-clean"}),
        Patch.make(f"L{n - 1}.post_attn", [last], {"run": "mr-clean"}, alpha=0.5),
        Patch.make(f"L{n // 2}.pre_attn", "all_prompt", {"run": "mr-clean"})))
    corrupt = engine.generate(pair["corrupt_prompt"], params)
    try:
        got, want = ranked.generate(pair["corrupt_prompt"], params, spec), engine.generate(pair["corrupt_prompt"], params, spec)
        assert got.intervention.status == want.intervention.status == "ok", got.intervention.errors
        _assert_logprobs_close(got, want, f"{ranked.name} patched")
        assert got.logprobs != corrupt.logprobs
        # patching a layer with its own stored values is exact on every stage
        self_spec = Interventions(patch=tuple(Patch.make(s, "all_prompt", {"run": "mr-clean"}) for s in sites[::5]))
        clean = ranked.generate(pair["clean_prompt"], params)
        same = ranked.generate(pair["clean_prompt"], params, self_spec)
        assert same.token_ids == clean.token_ids and same.logprobs == clean.logprobs  # bit-exact
    finally:
        ranked.drop_source("mr-clean")
        engine.drop_source("mr-clean")
    assert ranked.source_info("mr-clean") is None


def test_a_run_captured_in_one_stages_layers_is_stored_and_patches(ranked, engine, tasks):
    """A source run whose sites all lie in one pipeline stage (PP: the other stage stores an empty
    share, charged as the whole run) is stored on every worker, patches like one rank's, and a
    sweep over the first stage's layers only runs (its clean run is such a capture)."""
    pair = [p for p in tasks["pairs"] if p["equal_length"]][0]
    params = GenerationParams(max_tokens=2, ignore_eos=True, logprobs=0)
    last = len(engine.tokenize(pair["corrupt_prompt"])) - 1
    n = ranked.info.num_layers
    try:
        for layer in (0, n - 1):  # in the first stage only, then in the last stage only
            run = f"mr-one-stage-{layer}"
            for eng in (ranked, engine):
                g = eng.capture(pair["clean_prompt"], [f"L{layer}.post_attn"], "all_prompt", keep_as=run, return_values=False)
                assert g.intervention.stored_as == run, g.intervention.errors
            assert all(i is not None for i in ranked._rpc("cb_store", "info", run))
            info = ranked.source_info(run)
            assert info is not None and info["sites"] == engine.source_info(run)["sites"]
            spec = Interventions(patch=(Patch.make(f"L{layer}.post_attn", [last], {"run": run}),))
            got, want = ranked.generate(pair["corrupt_prompt"], params, spec), engine.generate(pair["corrupt_prompt"], params, spec)
            assert got.intervention.status == "ok", got.intervention.errors
            _assert_logprobs_close(got, want, f"{ranked.name} patched from a one-stage run at L{layer}")
    finally:
        for layer in (0, n - 1):
            ranked.drop_source(f"mr-one-stage-{layer}")
            engine.drop_source(f"mr-one-stage-{layer}")


def test_a_sweep_over_one_stages_layers(ranked_http, ranked, tasks):
    pair = [p for p in tasks["pairs"] if p["equal_length"]][0]
    body = {"prompt": pair["corrupt_prompt"], "clean_prompt": pair["clean_prompt"], "answer_token_id": pair["answer_id"],
            "foil_token_id": pair["foil_id"], "layers": [0], "positions": [1], "metric": "logprob"}
    r = ranked_http.post("/v1/patch_sweep", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["cells_done"] == 1 and ranked.in_flight == 0


def test_an_evicted_source_voids_the_patch_on_every_stage(ranked, tasks):
    prompt = tasks["facts"][32]["prompt"]
    n = ranked.info.num_layers
    # the run spans both stages (PP): its first and last layer
    ranked.capture(prompt, ["L0.pre_attn", f"L{n - 1}.post_block"], "all_prompt", keep_as="mr-evict-0", return_values=False)
    assert all(i is not None for i in ranked._rpc("cb_store", "info", "mr-evict-0"))
    all_sites = [f"L{L}.{h}" for L in range(n) for h in HOOKS]
    evicted = capture_until_evicted(ranked, prompt, all_sites, "mr-evict-0", "mr-evict-")
    try:
        assert "mr-evict-0" in evicted
        # every worker evicted it: no stage holds half a run
        assert all(i is None for i in ranked._rpc("cb_store", "info", "mr-evict-0"))
        usage = ranked.source_store_usage()
        assert usage["used_bytes"] <= usage["budget_bytes"] == 2 * 1024 * 1024
        held = [set(r["run_id"] for r in u["runs"]) for u in ranked._rpc("cb_store", "usage")]
        assert all(h == held[0] for h in held), "the stages' stores hold different runs"
        spec = Interventions(patch=(Patch.make(f"L{n - 1}.post_block", "all_prompt", {"run": "mr-evict-0"}),
                                    Patch.make("L0.pre_attn", "all_prompt", {"run": "mr-evict-0"})))
        gen = ranked.generate(prompt, GenerationParams(max_tokens=1, logprobs=0), spec)
        assert gen.intervention.voided and "mr-evict-0" in " ".join(gen.intervention.errors)
    finally:
        ranked.drop_source("mr-evict-0")
        drop_captures_until_evicted(ranked, "mr-evict-")


def test_mixed_batch_keeps_each_request_to_its_own_interventions(ranked, tasks):
    prompts = [tasks["facts"][i]["prompt"] for i in (20, 21, 22, 23)]
    n = ranked.info.num_layers
    ranked.capture(prompts[2], ["L1.post_attn", f"L{n - 1}.pre_attn"], "all_prompt", keep_as="mr-nb", return_values=False)
    params = GenerationParams(max_tokens=5, ignore_eos=True, logprobs=0)
    specs = [None,
             Interventions(steer=(Steer.make(["L1.pre_attn", f"L{n - 1}.post_block"], _vec(ranked, 4), scale=2.0),)),
             Interventions(patch=(Patch.make("L1.post_attn", "all_prompt", {"run": "mr-nb"}),
                                  Patch.make(f"L{n - 1}.pre_attn", "all_prompt", {"run": "mr-nb"}))),
             Interventions(capture=Capture.make(["L0.post_block", f"L{n - 1}.pre_attn"], "all"))]
    try:
        ranked.reset_prefix_cache()
        together = ranked.generate(prompts, params, specs)
        ranked.reset_prefix_cache()
        plain = ranked.generate(prompts, params, [None] * 4)
        assert together[0].token_ids == plain[0].token_ids and together[0].logprobs == plain[0].logprobs  # bit-exact
        assert together[1].logprobs != plain[1].logprobs
        assert all(g.intervention.status == "ok" for g in together[1:])
        ranked.reset_prefix_cache()
        for prompt, spec, g in zip(prompts[1:], specs[1:], together[1:]):
            solo = ranked.generate(prompt, params, spec)
            _assert_logprobs_close(g, solo, f"{ranked.name} batched vs solo")
        assert len(together[3].captures) == 2 * (len(together[3].prompt_token_ids) + 4)
    finally:
        ranked.drop_source("mr-nb")


# ---- sweeps ------------------------------------------------------------------------------------
def test_patch_sweep_grid_equals_one_rank_within_the_noise_floor(ranked, ranked_http, http, tasks):
    pair = [p for p in tasks["pairs"] if p["equal_length"]][1]
    body = {"prompt": pair["corrupt_prompt"], "clean_prompt": pair["clean_prompt"], "answer_token_id": pair["answer_id"],
            "foil_token_id": pair["foil_id"], "hooks": list(HOOKS)}
    results = []
    for client, extra in ((ranked_http, {"keep_source": True}), (http, {})):
        r = client.post("/v1/patch_sweep", json={**body, **extra})
        assert r.status_code == 200, r.text
        results.append(r.json())
    got, want = results
    assert got["layers"] == want["layers"] and got["positions"] == want["positions"]
    floor = max(got["noise_floor"], want["noise_floor"]) + LOGPROB_ATOL
    grids = [{g["hook"]: g["grid"] for g in res["hook_grids"]} for res in results]
    for hook in HOOKS:
        a, b = np.array(grids[0][hook], dtype=float), np.array(grids[1][hook], dtype=float)
        assert a.shape == b.shape and np.isnan(a).sum() == np.isnan(b).sum() == 0
        assert np.max(np.abs(a - b)) <= floor, f"{ranked.name} {hook}: {np.max(np.abs(a - b)):.3g} > {floor:.3g}"
    assert got["checksum"]["consistent"] is True and got["checksum"]["ranks"] == 2
    # zoom: a follow-up sweep of a few cells from the kept source run equals the full grid's cells
    run = got["captured_source_run"]
    assert got["source_kept"] and run
    layers, positions = [1, ranked.info.num_layers - 1], got["positions"][-2:]
    try:
        r = ranked_http.post("/v1/patch_sweep", json={**body, "clean_prompt": None, "source_run": run, "hooks": ["post_block"],
                                                      "layers": layers, "positions": positions})
        assert r.status_code == 200, r.text
        zoom = r.json()
        full = np.array(grids[0]["post_block"], dtype=float)
        for i, layer in enumerate(layers):
            for j, pos in enumerate(positions):
                cell = zoom["hook_grids"][0]["grid"][i][j] if zoom.get("hook_grids") else zoom["grid"][i][j]
                want_cell = full[got["layers"].index(layer), got["positions"].index(pos)]
                assert abs(cell - want_cell) <= max(floor, zoom["noise_floor"] + LOGPROB_ATOL), (layer, pos, cell, want_cell)
    finally:
        ranked.drop_source(run)


def test_a_source_dropped_mid_sweep_voids_cells_on_every_stage(ranked, ranked_http, tasks):
    """The stored source disappears (on every stage at once) after two cells: the remaining cells
    are voided (null), never reported with unpatched values."""
    import json

    pair = [p for p in tasks["pairs"] if p["equal_length"]][3]
    n = ranked.info.num_layers
    ranked.capture(pair["clean_prompt"], [f"L{L}.post_block" for L in range(n)], "all_prompt", keep_as="mr-doomed",
                   return_values=False)
    body = {"prompt": pair["corrupt_prompt"], "source_run": "mr-doomed", "answer_token_id": pair["answer_id"],
            "clean_baseline": 0.0, "metric": "logprob", "max_concurrency": 1, "noise_floor_samples": 1, "stream": True}
    events: list[dict] = []
    with ranked_http.stream("POST", "/v1/patch_sweep", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                if events[-1]["type"] == "cell" and sum(e["type"] == "cell" for e in events) == 2:
                    assert ranked.drop_source("mr-doomed")
    summary = events[-1]
    assert summary["type"] == "summary" and not summary["cancelled"]
    voided = [c for c in events if c["type"] == "cell" and c["value"] is None]
    assert voided and summary["cells_voided"] == len(voided)
    grid = np.array(summary["grid"], dtype=float)
    for c in voided:
        assert np.isnan(grid[summary["layers"].index(c["layer"]), summary["positions"].index(c["position"])])
    assert all(i is None for i in ranked._rpc("cb_store", "info", "mr-doomed"))


# ---- checksum ----------------------------------------------------------------------------------
def test_checksum_is_consistent_then_detects_a_fault_on_one_rank(ranked, ranked_http, tasks):
    """Runs last in the module: the injected fault leaves the ranks' rolling checksums apart."""
    status = ranked.intervention_status()
    assert status["determinism"]["consistent"] is True, status["determinism"]
    assert status["determinism"]["ranks"] == 2 and status["determinism"]["action_count"] > 0
    assert {(w["tp_rank"], w["pp_rank"]) for w in status["workers"]} == (
        {(0, 0), (1, 0)} if ranked.name == "tp2" else {(0, 0), (0, 1)})
    assert ranked_http.get("/v1/status").json()["checksum"]["consistent"] is True
    assert ranked_http.get("/v1/status").json()["kv_isolation"] == "blocks"  # the plugin entry point is installed
    prompt = tasks["facts"][40]["prompt"]
    steer = Interventions(steer=(Steer.make(["L0.pre_attn"], _vec(ranked, 7)),))
    if ranked.name == "pp2":
        # one rank per stage: nothing to compare it with (stages apply different actions by design)
        assert ranked.inject_fault("skip_action", tp_rank=0, pp_rank=0)
        ranked.generate(prompt, GenerationParams(max_tokens=2, logprobs=0), steer)
        assert ranked.intervention_status()["determinism"]["consistent"] is True
        return
    assert ranked.inject_fault("skip_action", tp_rank=1, pp_rank=0)
    ranked.generate(prompt, GenerationParams(max_tokens=2, logprobs=0), steer)
    det = ranked.intervention_status()["determinism"]
    assert det["consistent"] is False
    sums = {w["tp_rank"]: w["action_checksum"] for w in ranked.intervention_status()["workers"]}
    assert det["checksums"] == {"tp0/pp0": sums[0], "tp1/pp0": sums[1]} and sums[0] != sums[1]
    assert set(det["mismatches"]["pp0"]) == {"tp0/pp0", "tp1/pp0"}
    assert ranked_http.get("/v1/status").json()["checksum"]["consistent"] is False
    # the mismatch never fails a request
    assert ranked.generate(prompt, GenerationParams(max_tokens=2, logprobs=0)).token_ids


def test_without_the_plugin_entry_point_whole_requests_are_salted(monkeypatch, tasks):
    """Several ranks, and vLLM told not to load causalboard's plugin (as when the source tree is
    on PYTHONPATH without `pip install -e .`): the engine core hosts no worker, so the scheduler
    cannot salt single KV blocks. The engine says so (`kv_isolation: requests`) and salts whole
    intervened requests: an unintervened rerun after a steered run equals a fresh run. Control:
    with per-block salting forced on, the steered run's KV leaks into the rerun (what a two-GPU
    run from a source tree showed before this fallback existed: docs/distributed.md)."""
    from engine_ext import Engine

    monkeypatch.setenv("VLLM_PLUGINS", "")
    # spawned, the engine core does not inherit this process's patched vLLM modules (a forked one
    # does, which would hide the control below; GPU hosts spawn once CUDA is initialised)
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    prompt = " ".join(tasks["facts"][i]["prompt"] for i in range(44, 54))  # more than one 32-token KV block
    params = GenerationParams(max_tokens=3, ignore_eos=True, logprobs=0)
    with Engine(model=str(model_path()), device="cpu", tensor_parallel_size=2) as eng:
        assert eng.info.kv_isolation == "requests"
        steer = Interventions(steer=(Steer.make(["L0.pre_attn"], _vec(eng, 11, 8.0), positions="all_prompt"),))
        eng.reset_prefix_cache()
        fresh = eng.generate(prompt, params)
        eng.reset_prefix_cache()
        steered = eng.generate(prompt, params, steer)
        rerun = eng.generate(prompt, params)
        assert steered.logprobs != fresh.logprobs
        assert rerun.token_ids == fresh.token_ids and rerun.logprobs == fresh.logprobs
        assert eng.generate(prompt, params).num_cached_tokens >= 32  # the cache is in play
        eng._block_salting = True  # the control: what the scheduler does with no salt of ours
        eng.reset_prefix_cache()
        eng.generate(prompt, params, steer)
        leaked = eng.generate(prompt, params)
        assert leaked.logprobs != fresh.logprobs, "the control did not reuse the steered run's KV blocks"


def test_a_segment_left_by_an_ended_engine_on_the_drawn_port_does_not_fail_the_start(monkeypatch, tasks):
    """vLLM's CPU communicator names its shared-memory segments after the distributed-init port and
    creates them exclusively; a rank that was killed leaves its segment behind, and an engine that
    later draws the same port failed to start (`create shm in SHMManager failed. errno: 17`; the
    likely cause of CI's failed TP=2 starts on 2026-11-27). Here such segments wait on the port the
    engine will draw (`VLLM_PORT` makes vLLM try it first): the engine removes them as stale
    (engine_ext.engine.cpu_shm), starts, and generates. On a host whose vLLM build has no
    shared-memory communicator (AVX2: `cpu_shm.communicator_available`) the ranks create no
    segments, so there the test checks only that the planted files neither stop the start nor
    outlive the engine."""
    from pathlib import Path

    from engine_ext import Engine
    from engine_ext.engine.cpu_shm import communicator_available

    shm = communicator_available()

    port = free_port()
    planted = [Path(f"/dev/shm/{port}-tp:0-[0-1]-cpushm_{rank}") for rank in (0, 1)]
    for path in planted:
        path.write_bytes(b"\xff" * 4096)  # what a killed rank leaves: its name, stale contents
    monkeypatch.setenv("VLLM_PORT", str(port))
    try:
        with Engine(model=str(model_path()), device="cpu", tensor_parallel_size=2) as eng:
            if shm:
                assert all(p.exists() and p.stat().st_size > 4096 for p in planted), "the engine drew another port"
            gen = eng.generate(tasks["facts"][0]["prompt"], GenerationParams(max_tokens=2))
            assert len(gen.token_ids) == 2
        assert not any(p.exists() for p in planted), "the closed engine left its segments"
    finally:
        for path in planted:
            path.unlink(missing_ok=True)


# ---- segmented cells ---------------------------------------------------------------------------------
def test_segmented_cells_on_two_ranks_equal_cells_run_alone(ranked, engine, tasks):
    """Cells as the segments of one request (`Engine.agenerate_cells`, docs/segmented-cells.md) at
    TP=2 (every rank rewrites the same positions and splits the same way; the logits of the
    segment ends gathered as for any request) and PP=2 (positions and split on both stages, the
    scores on the last): the scores of the cells run alone on the same engine, and those of one rank."""
    import asyncio

    from engine_ext.specs import Interventions, Patch, RunSource

    pair = [p for p in tasks["pairs"] if p["equal_length"]][0]
    L = ranked.info.num_layers
    scores = (pair["answer_id"], pair["foil_id"])

    def run(eng, cells, segmented):
        async def go():
            return {i: r async for i, r in eng.agenerate_cells(eng.tokenize(pair["corrupt_prompt"]), cells, scores,
                                                              segmented=segmented)}
        return asyncio.run(go())

    def run_entering(eng, cells):  # layer skipping: the corrupt prompt's own run as the entry
        async def go():
            return {i: r async for i, r in eng.agenerate_cells(eng.tokenize(pair["corrupt_prompt"]), cells, scores,
                                                              segmented=True, entry_run="mr-seg-corrupt")}
        return asyncio.run(go())

    def entered(eng) -> list[int]:
        return [w["entered_steps"] for w in eng.intervention_status()["workers"]]

    out = {}
    for name, eng in (("ranked", ranked), ("one", engine)):
        eng.capture(pair["clean_prompt"], [f"L{layer}.post_block" for layer in range(L)], "all_prompt",
                    keep_as="mr-seg-clean", return_values=False)
        n = len(eng.tokenize(pair["corrupt_prompt"]))
        cells = [None] + [Interventions(patch=(Patch.make(f"L{layer}.post_block", [p], RunSource("mr-seg-clean")),))
                          for layer in range(L) for p in range(n)]
        try:
            if name == "ranked":
                eng.capture(pair["corrupt_prompt"], [f"L{layer}.pre_attn" for layer in range(L)], "all_prompt",
                            keep_as="mr-seg-corrupt", return_values=False)
                before = entered(eng)
                entering = run_entering(eng, cells)
                steps = [b - a for a, b in zip(before, entered(eng))]
            out[name] = (run(eng, cells, True), run(eng, cells, False) if name == "ranked" else None)
        finally:
            eng.drop_source("mr-seg-clean")
            eng.drop_source("mr-seg-corrupt")
    (seg, alone), (one, _) = out["ranked"], out["one"]
    assert sorted(seg) == sorted(alone) == sorted(one) == sorted(entering)
    for i in seg:
        assert not isinstance(seg[i], Exception), seg[i]
        assert seg[i].scores[0] == alone[i].scores[0], (ranked.name, i, seg[i].scores, alone[i].scores)
        assert entering[i].scores[0] == alone[i].scores[0], (ranked.name, i, entering[i].scores, alone[i].scores)
        diff = max(abs(seg[i].scores[0][t] - one[i].scores[0][t]) for t in scores)
        assert diff <= LOGPROB_ATOL, (ranked.name, i, diff)
    # TP=2: both ranks skip the same steps; PP=2: skipping needs one stage, every layer runs
    if ranked.name == "tp2":
        assert len(steps) == 2 and steps[0] == steps[1] > 0, steps
    else:
        assert steps and all(s == 0 for s in steps), steps


def test_clamps_equal_one_rank_on_every_stage(ranked, engine, tasks):
    """Request and global clamps (tests/test_clamps.py) on a TP=2 and a PP=2 engine (layers on both
    stages) against the one-rank engine. Here, not in test_clamps.py, so that it shares this
    module's two-rank engines instead of starting its own (~1 min of CI)."""
    from tests.test_clamps import GEN4, _proj, _unit
    from tests.test_interventions import fact

    prompt = fact(tasks, 23)["prompt"]
    u = _unit(engine, 57)
    last = engine.info.num_layers - 1
    sites = ["L0.post_block", f"L{last}.post_attn"]
    spec = Interventions(clamp=(Clamp.make(["L0.post_block", f"L{last}.mlp_in"], u, max=0.0),
                                Clamp.make(f"L{last}.post_attn", u, value=0.0, phase="decode")),
                         capture=Capture.make(sites, "all"))
    one, two = (e.generate(prompt, GEN4, spec) for e in (engine, ranked))
    assert two.intervention.status == "ok", two.intervention.errors
    assert two.token_ids == one.token_ids and np.allclose(two.logprobs, one.logprobs, atol=LOGPROB_ATOL)
    assert one.captures.keys() == two.captures.keys()
    for key, v in one.captures.items():
        assert np.all(np.abs(two.captures[key] - v) <= CAPTURE_ATOL + CAPTURE_RTOL * np.abs(v)), key
    assert abs(_proj(two.captures, (last, "post_attn"), u)[len(two.prompt_token_ids) + 1]) < 1e-4  # decode: ablated
    plain = ranked.generate(prompt, GEN4)
    try:
        for e in (engine, ranked):
            e.set_global_steer([], [Clamp.make(f"L{last}.post_block", u, value=0.0)])
        a, b = (e.generate(prompt, GEN4) for e in (engine, ranked))
    finally:
        for e in (engine, ranked):
            e.clear_global_steer()
    assert b.token_ids == a.token_ids and np.allclose(b.logprobs, a.logprobs, atol=LOGPROB_ATOL)
    assert b.logprobs != plain.logprobs
