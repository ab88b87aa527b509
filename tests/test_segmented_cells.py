"""Cells packed as the segments of one request (`Engine.agenerate_cells`, `engine_ext.engine.cells`,
`engine_ext.worker.segments`; docs/segmented-cells.md), on the real CPU engine (vLLM's V1
runner): every cell's scores equal those of the same cell as a request of its own, bit for bit;
far fewer requests reach vLLM; a window of a segmented request that starts or ends inside a
segment (chunked prefill) changes nothing; no KV block a segmented request wrote is ever reused by
another request; a cell that cannot be packed runs alone; an engine that cannot segment says so.
The split of vLLM's attention metadata itself is checked without an engine at the end."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from engine_ext import GenerationParams
from engine_ext.errors import SpecError
from engine_ext.specs import Interventions, Noise, Patch, RunSource

from tests.conftest import model_path

SCORE_IDS = (5, 17)
HOOKS = ("pre_attn", "post_attn", "post_block")


@pytest.fixture(scope="module")
def prompts(engine, tasks):
    pair = next(p for p in tasks["pairs"] if p["equal_length"] and len(engine.tokenize(p["clean_prompt"])) >= 6)
    clean, corrupt = engine.tokenize(pair["clean_prompt"]), engine.tokenize(pair["corrupt_prompt"])
    assert len(clean) == len(corrupt)
    L = engine.info.num_layers
    engine.capture(clean, [f"L{layer}.{h}" for layer in range(L) for h in HOOKS], "all_prompt", keep_as="seg-clean",
                   return_values=False)
    yield clean, corrupt
    engine.drop_source("seg-clean")


def cells_for(engine, n: int, count: int) -> list:
    """`count` cells: a baseline first and last, patched cells of every layer and hook between."""
    patched = [Interventions(patch=(Patch.make(f"L{layer}.{h}", [p], RunSource("seg-clean")),))
               for layer in range(engine.info.num_layers) for h in HOOKS for p in range(n)]
    return [None] + patched[: count - 2] + [None]


def run(engine, prompt, cells, **kw) -> dict:
    async def go():
        out = {}
        async for i, res in engine.agenerate_cells(prompt, cells, SCORE_IDS, **kw):
            assert i not in out, f"cell {i} yielded twice"
            out[i] = res
        return out
    return asyncio.run(go())


def count_requests(engine, monkeypatch) -> list[int]:
    sizes: list[int] = []
    loop = engine._loop
    orig = loop.submit_many

    def submit_many(requests):
        sizes.append(len(requests))
        return orig(requests)
    monkeypatch.setattr(loop, "submit_many", submit_many)
    return sizes


def test_segmented_cells_equal_cells_run_alone_with_fewer_requests(engine, prompts, monkeypatch):
    clean, corrupt = prompts
    cells = cells_for(engine, len(corrupt), 40)
    sizes = count_requests(engine, monkeypatch)
    packed = run(engine, corrupt, cells, segmented=True)
    alone = run(engine, corrupt, cells, segmented=False)
    assert sorted(packed) == sorted(alone) == list(range(len(cells)))
    for i in range(len(cells)):
        a, b = packed[i], alone[i]
        assert not isinstance(a, Exception) and not isinstance(b, Exception), (a, b)
        assert a.scores[0] == b.scores[0], (i, a.scores, b.scores)  # bit for bit
        assert a.intervention is None or not a.intervention.voided
    # the patches took effect: cells that patch where the prompts differ (or after) move the scores
    base = alone[0].scores[0]
    assert sum(alone[i].scores[0] != base for i in range(len(cells))) >= 5
    assert sizes[1] == len(cells) and sizes[0] < len(cells) // 2, sizes  # requests submitted: packed, then alone
    assert engine.in_flight == 0


def test_a_window_that_cuts_a_segment_changes_nothing(prompts, monkeypatch):
    """An engine whose step holds 40 tokens computes a request of three 32-token segments over three
    steps, two of them ending inside a segment (chunked prefill): the cells' scores are those of the
    cells run alone."""
    from engine_ext import Engine
    from engine_ext.engine import cells as packing

    clean, corrupt = prompts
    monkeypatch.setattr(packing, "segments_per_request", lambda n, bs, ctx, step: (-(-n // bs) * bs, 3))
    # a second engine in this process: its engine core in a process of its own (EngineConfig.multiprocess)
    with Engine(model=str(model_path()), device="cpu", multiprocess=True,
                engine_kwargs={"max_num_batched_tokens": 40}) as eng:
        eng.capture(clean, [f"L{layer}.{h}" for layer in range(eng.info.num_layers) for h in HOOKS], "all_prompt",
                    keep_as="seg-clean", return_values=False)
        cells = cells_for(eng, len(corrupt), 9)
        packed = run(eng, corrupt, cells, segmented=True)
        alone = run(eng, corrupt, cells, segmented=False)
    assert all(packed[i].scores[0] == alone[i].scores[0] for i in range(len(cells)))


def test_no_other_request_reuses_a_segmented_requests_kv(engine, prompts):
    """A segmented request's blocks hold keys and values at segment-local positions: a request
    whose prompt is the same tokens (the padded prompt twice) must compute its own."""
    clean, corrupt = prompts
    run(engine, corrupt, cells_for(engine, len(corrupt), 4), segmented=True)
    seg = -(-len(corrupt) // engine._segments_block) * engine._segments_block
    same_tokens = (corrupt + [corrupt[-1]] * (seg - len(corrupt))) * 2
    gen = engine.generate(same_tokens, GenerationParams(max_tokens=1), Interventions(score_token_ids=SCORE_IDS))
    assert gen.num_cached_tokens == 0
    fresh = engine.generate(same_tokens, GenerationParams(max_tokens=1, cache_salt="seg-fresh"),
                            Interventions(score_token_ids=SCORE_IDS))
    assert gen.scores == fresh.scores


def test_cells_that_cannot_be_packed_run_alone_and_bad_cells_get_their_own_error(engine, prompts, monkeypatch):
    clean, corrupt = prompts
    noisy = Interventions(noise=Noise.make([1, 2], scale=3.0, seed=4))
    bad = Interventions(patch=(Patch.make("L0.post_block", [len(corrupt) + 5], RunSource("seg-clean")),))
    cells = cells_for(engine, len(corrupt), 6) + [noisy, bad]
    sizes = count_requests(engine, monkeypatch)
    out = run(engine, corrupt, cells, segmented=True)
    alone = run(engine, corrupt, cells, segmented=False)
    assert isinstance(out[7], SpecError) and "positions" in out[7].field, out[7]
    assert isinstance(alone[7], SpecError)
    for i in range(7):
        assert out[i].scores[0] == alone[i].scores[0], i
    # the bad cell made the packing fall back: every cell ran alone and reported its own result
    assert sizes[0] == len(cells) - 1, sizes
    empty = run(engine, [], cells[:3])  # an empty prompt: each cell's error names it, the engine serves on
    assert all(isinstance(empty[i], SpecError) and empty[i].field == "prompt" for i in range(3)), empty


def test_a_missing_source_voids_the_cells_of_its_request(engine, prompts):
    """The worker voids a request whose patch source is gone: every cell packed in it reports the
    error (none is silently scored without its patch)."""
    clean, corrupt = prompts
    gone = [Interventions(patch=(Patch.make("L1.post_block", [1], RunSource("seg-never-stored")),)) for _ in range(3)]
    out = run(engine, corrupt, gone, segmented=True)
    for i in range(3):
        assert out[i].intervention.voided and "seg-never-stored" in out[i].intervention.errors[0]


def test_an_engine_that_cannot_segment_says_so_and_runs_cells_alone(engine, prompts, monkeypatch):
    clean, corrupt = prompts
    monkeypatch.setattr(engine, "_segments_ok", False)
    with pytest.raises(SpecError) as e:
        run(engine, corrupt, cells_for(engine, len(corrupt), 4), segmented=True)
    assert e.value.field == "segmented"
    sizes = count_requests(engine, monkeypatch)
    out = run(engine, corrupt, cells_for(engine, len(corrupt), 4))
    assert sizes == [4] and all(not isinstance(r, Exception) for r in out.values())


def test_the_attention_split_of_a_window_inside_segments():
    """`split_segments` on vLLM's metadata: a plain request, and a 3-segment request (S = 32,
    blocks of 16) whose window covers positions 40..79: segment 1 from its position 8, segment 2
    whole; block tables start at each segment's first block."""
    import torch
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from engine_ext.worker.segments import split_segments

    qsl = torch.tensor([0, 5, 45], dtype=torch.int32)
    seq = torch.tensor([9, 80], dtype=torch.int32)
    bt = torch.arange(2 * 8, dtype=torch.int32).reshape(2, 8) + 100
    cm = CommonAttentionMetadata(query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq, num_reqs=2,
                                 num_actual_tokens=45, max_query_len=40, max_seq_len=80, block_table_tensor=bt,
                                 slot_mapping=torch.zeros(45, dtype=torch.int64), _seq_lens_cpu=seq)
    out = split_segments(cm, {1: 32}, 16)
    assert out.num_reqs == 3
    assert out.query_start_loc_cpu.tolist() == [0, 5, 29, 45]
    assert out.seq_lens.tolist() == [9, 32, 16]
    assert out._num_computed_tokens_cpu.tolist() == [4, 8, 0]
    assert out.max_query_len == 24 and out.max_seq_len == 32 and out.num_actual_tokens == 45
    assert out.block_table_tensor[0].tolist() == bt[0].tolist()
    assert out.block_table_tensor[1, :6].tolist() == bt[1, 2:].tolist() and out.block_table_tensor[1, 6:].tolist() == [0, 0]
    assert out.block_table_tensor[2, :4].tolist() == bt[1, 4:].tolist()
    assert np.array_equal(out.slot_mapping.numpy(), cm.slot_mapping.numpy())


def test_the_attention_split_of_v2_metadata_keeps_other_rows_device_lengths():
    """V2's runner builds the metadata without an exact host copy of the sequence lengths (only an
    upper bound): the carrier's lengths come from the bound (a prefill's is exact), every other
    row keeps the length the device holds (here deliberately below its bound), and
    `is_prefilling` keeps other rows' values while segments are prefill."""
    import torch
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from engine_ext.worker.segments import split_segments

    qsl = torch.tensor([0, 1, 41], dtype=torch.int32)
    device_seq = torch.tensor([7, 80], dtype=torch.int32)  # row 0 (a decode): 7 on the device
    bound = torch.tensor([9, 80], dtype=torch.int32)  # its host bound: 9
    bt = torch.arange(2 * 8, dtype=torch.int32).reshape(2, 8) + 100
    cm = CommonAttentionMetadata(query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=device_seq, num_reqs=2,
                                 num_actual_tokens=41, max_query_len=40, max_seq_len=80, block_table_tensor=bt,
                                 slot_mapping=torch.zeros(41, dtype=torch.int64), seq_lens_cpu_upper_bound=bound,
                                 is_prefilling=torch.tensor([False, True]))
    out = split_segments(cm, {1: 32}, 16)
    assert out.num_reqs == 3 and out.query_start_loc_cpu.tolist() == [0, 1, 25, 41]
    assert out.seq_lens.tolist() == [7, 32, 16]  # the decode row's device length, the segments' own
    assert out._seq_lens_cpu is None and out._num_computed_tokens_cpu is None  # as V2 had them
    assert out.seq_lens_cpu_upper_bound.tolist() == [9, 32, 16]
    assert out.is_prefilling.tolist() == [False, True, True]
    assert out.block_table_tensor[1, :6].tolist() == bt[1, 2:].tolist() and out.block_table_tensor[2, :4].tolist() == bt[1, 4:].tolist()


def test_a_step_with_a_segmented_request_never_takes_a_full_cuda_graph():
    """Both runners pick a step's CUDA-graph mode from whether it is a uniform decode batch; a full
    graph replays captured attention metadata, which the split would not reach. While a step
    schedules a segmented request (`segments.carriers_scheduled`), V1 is told the batch is not a
    uniform decode one and V2's dispatch gets no uniform token count; other steps are untouched."""
    import types

    from engine_ext.worker import seam, segments

    seen = []

    class V1:
        def _determine_batch_execution_and_padding(self, num_tokens, num_reqs, force_uniform_decode=None, **kw):
            seen.append(("v1", force_uniform_decode))

    seam._wrap_v1_batch_execution(V1)
    mod = types.SimpleNamespace(dispatch_cg_and_sync_dp=lambda mgr, n_reqs, n_tok, uniform, *a, **k: seen.append(("v2", uniform)))
    seam._wrap_v2_dispatch(mod)
    try:
        for scheduled in (False, True):
            segments.set_carriers_scheduled(scheduled)
            V1()._determine_batch_execution_and_padding(num_tokens=8, num_reqs=8)
            V1()._determine_batch_execution_and_padding(num_tokens=8, num_reqs=8, force_uniform_decode=True)  # capture
            mod.dispatch_cg_and_sync_dp(None, 8, 8, 1, 1, 0)
    finally:
        segments.set_carriers_scheduled(False)
    assert seen == [("v1", None), ("v1", True), ("v2", 1), ("v1", False), ("v1", True), ("v2", None)]


def test_the_v2_runner_enters_a_step_inside_its_forward_context(monkeypatch):
    """V2 `execute_model` calls `set_forward_context` (as its module names it) around the forward,
    without the runner: the wrapped one enters the step at `segments.step_entry` (`_entered_at`,
    with the runner the wrapped `prepare_attn` saw) inside vLLM's context, after it is set, and only
    when the step has an entry layer."""
    import contextlib
    import types

    from engine_ext.worker import seam, segments

    seen = []

    @contextlib.contextmanager
    def vllm_context(*args, **kwargs):
        seen.append(("enter", kwargs.get("skip_compiled")))
        yield "ctx"
        seen.append(("exit",))

    @contextlib.contextmanager
    def entered_at(runner, layer):
        seen.append(("entered", runner, layer))
        yield

    monkeypatch.setattr(seam, "_entered_at", entered_at)
    mod = types.SimpleNamespace(set_forward_context=vllm_context)
    seam._wrap_v2_forward_context(mod)
    seam._wrap_v2_forward_context(mod)  # installed once
    try:
        seam._V2_STEP.runner = "runner"
        for entry in (0, 3):
            segments._STEP.entry = entry
            with mod.set_forward_context(None, None, skip_compiled=False) as ctx:
                seen.append(("forward", ctx))
    finally:
        segments.clear_step()
        seam._V2_STEP.runner = None
    assert seen == [("enter", False), ("forward", "ctx"), ("exit",),
                    ("enter", False), ("entered", "runner", 3), ("forward", "ctx"), ("exit",)]


def test_a_short_prompts_sweep_runs_its_cells_in_segments_with_the_grid_of_cells_run_alone(http, engine, tasks, monkeypatch):
    """The sweep service's default for a prompt shorter than two KV blocks, where padding it to a
    whole block is cheap (`cells.MAX_PADDING`): cells as segments (`segmented: true` in the
    summary, far fewer requests); `prefix_reuse: false` keeps them segmented; `prefix_reuse: true`
    runs one request per cell. All three grids are equal; the segmented sweep submits all its
    cells in one group (`service.SEGMENTED_GROUP_MAX`), built (`Engine.prepare_cells`) while the
    clean run and the baselines are in the engine, and run as built (`Engine.arun_cells`), skipping
    the layers below each cell's (the corrupt baseline's run stored for it and dropped at the end;
    `layer_entry: true` in the summary; docs/segmented-cells.md, "Layer skipping"). (The bundled pair's few tokens in a 32-token block
    are too much padding for the default: the test allows any.)"""
    from engine_ext.engine import cells as packing

    pair = [p for p in tasks["pairs"] if p["equal_length"]][0]
    body = {"prompt": pair["corrupt_prompt"], "clean_prompt": pair["clean_prompt"], "answer_token_id": pair["answer_id"],
            "foil_token_id": pair["foil_id"], "metric": "logprob", "hooks": ["pre_attn", "post_block"]}
    r = http.post("/v1/patch_sweep", json=body)
    assert r.status_code == 200 and r.json()["segmented"] is False  # too much padding by default
    monkeypatch.setattr(packing, "MAX_PADDING", 100.0)
    sizes = count_requests(engine, monkeypatch)
    groups: list[tuple[int, int]] = []  # per `prepare_cells` call: cells, requests in flight meanwhile
    ran: list = []  # what `arun_cells` ran
    prepare, run_cells = engine.prepare_cells, engine.arun_cells
    monkeypatch.setattr(engine, "prepare_cells", lambda prompt, cells, *a, **k: (
        groups.append((len(cells), engine.in_flight)), prepare(prompt, cells, *a, **k))[1])
    monkeypatch.setattr(engine, "arun_cells", lambda prepared: (ran.append(prepared), run_cells(prepared))[1])
    runs = {}
    for name, extra in (("default", {}), ("no_reuse", {"prefix_reuse": False}), ("reuse", {"prefix_reuse": True}),
                        ("roomy_limit", {"max_concurrency": 4096}), ("tight_limit", {"max_concurrency": 16})):
        sizes.clear()
        groups.clear()
        ran.clear()
        entered = _worker_counts(engine)[0]
        r = http.post("/v1/patch_sweep", json={**body, **extra})
        assert r.status_code == 200, r.text
        runs[name] = (r.json(), sum(sizes))
        if name in ("default", "no_reuse", "roomy_limit"):  # one group: its cells skip the layers below theirs
            assert engine.layer_entry_offered and _worker_counts(engine)[0] > entered, name
            assert r.json()["layer_entry"] is True, name
        else:  # several groups (tight limit) or one request per cell (reuse): every layer runs
            assert r.json()["layer_entry"] is False and _worker_counts(engine)[0] == entered, name
        runs_left = [run["run_id"] for w in engine.intervention_status()["workers"] for run in w["store"]["runs"]]
        assert not any(run.endswith("-entry") for run in runs_left), runs_left  # dropped at the sweep's end
        if name == "default":  # a segmented sweep submits all its jobs (cells, baselines, repeats) as one group,
            # prepared while the clean run and the corrupt baseline(s) computed
            assert len(groups) == 1 and groups[0][0] > r.json()["cells_total"] and groups[0][1] >= 2, groups
            assert len(ran) == 1 and ran[0].submitted
        if name == "roomy_limit":  # a limit that allows every job at once: one group too
            assert len(groups) == 1 and groups[0][0] > r.json()["cells_total"] and len(ran) == 1, groups
        if name == "tight_limit":  # at most 16 jobs in flight: groups of 4 (GROUPS_PER_WINDOW), each built when fed
            assert len(groups) > 1 and all(n <= 4 for n, _ in groups) and r.json()["segmented"] is True, groups
    (default, n_default), (no_reuse, _), (reuse, n_reuse) = runs["default"], runs["no_reuse"], runs["reuse"]
    for other in (runs["roomy_limit"][0], runs["tight_limit"][0]):
        for a, b in zip(default["hook_grids"], other["hook_grids"]):
            assert a["grid"] == b["grid"], (a["hook"], a["grid"], b["grid"])
    assert default["segmented"] is True and default["prefix_reuse"] is False
    assert no_reuse["segmented"] is True and reuse["segmented"] is False and reuse["prefix_reuse"] is True
    cells = default["cells_total"]
    assert n_reuse >= cells and n_default < cells // 2, (n_default, n_reuse, cells)
    for other in (no_reuse, reuse):
        for a, b in zip(default["hook_grids"], other["hook_grids"]):
            assert a["grid"] == b["grid"], (a["hook"], a["grid"], b["grid"])
    assert default["noise_floor"] == 0.0


def test_cells_are_packed_evenly_with_their_patches_moved_to_their_segment():
    """`cells.pack`: as few requests as the limit allows, sizes within one of each other; cell j of
    a request has its patch at `j*S + p` reading the stored run at `p` (given or implied), and its
    score at `j*S + n - 1`; the prompt padded to S and repeated."""
    from engine_ext.engine.cells import pack
    from engine_ext.specs import InlineSource, ZeroSource

    prompt = [7, 8, 9]
    vec = np.ones(4, np.float32)
    cells = [Interventions(patch=(Patch.make("L1.post_block", [i % 3], RunSource("r")),)) for i in range(8)]
    cells[1] = None
    cells[2] = Interventions(patch=(Patch.make("L0.pre_attn", "last_prompt", RunSource("r", (0,))),))
    cells[3] = Interventions(patch=(Patch.make("L2.mlp_out", [0, 2], ZeroSource()),
                                    Patch.make("L2.post_attn", [1], InlineSource((vec,)), alpha=0.5)))
    carriers = pack(prompt, cells, (5, 6), 16, 3, 0)
    assert [len(c.cells) for c in carriers] == [3, 3, 2]
    first = carriers[0]
    assert first.ids == (prompt + [0] * 13) * 3 and first.segments == {"len": 16, "score_pos": [2, 18, 34], "ids": [5, 6]}
    (p0,), (p2,) = [p for p in first.spec.patch if p.site.layer == 1], [p for p in first.spec.patch if p.site.layer == 0]
    assert p0.positions == (0,) and p0.source == RunSource("r", (0,))   # cell 0 in segment 0
    assert p2.positions == (2 * 16 + 2,) and p2.source == RunSource("r", (0,))  # cell 2: last_prompt, given source
    second = carriers[1]
    assert second.cells == [3, 4, 5]
    moved = {(p.site.hook, p.positions) for p in second.spec.patch}
    assert ("mlp_out", (0, 2)) in moved and ("post_attn", (1,)) in moved  # cell 3 in segment 0 of the second
    assert ("post_block", (16 + 1,)) in moved and ("post_block", (32 + 2,)) in moved  # cells 4 and 5
    assert [p.alpha for p in second.spec.patch if p.site.hook == "post_attn"] == [0.5]


def test_global_steering_keeps_cells_out_of_segments(engine, prompts, monkeypatch):
    """Global steering at a fixed position applies at each request's own positions: in a
    segmented request only the first segment would get it. While any is set, cells run alone by
    default (the same scores as `segmented=False`) and `segmented=True` is refused naming the field."""
    from engine_ext.engine import cells as packing
    from engine_ext.specs import Steer

    clean, corrupt = prompts
    monkeypatch.setattr(packing, "MAX_PADDING", 100.0)  # segments by default on this short prompt
    cells = cells_for(engine, len(corrupt), 6)
    v = np.random.default_rng(3).standard_normal(engine.info.hidden_size).astype(np.float32)
    before = engine.global_steer
    engine.set_global_steer([Steer.make(["L1.post_block"], v, scale=4.0, positions=[1])])
    try:
        sizes = count_requests(engine, monkeypatch)
        steered = run(engine, corrupt, cells)
        alone = run(engine, corrupt, cells, segmented=False)
        with pytest.raises(SpecError) as e:
            run(engine, corrupt, cells, segmented=True)
        assert e.value.field == "segmented" and "global steering" in str(e.value)
    finally:
        engine.set_global_steer(before)
    assert sizes[:2] == [len(cells), len(cells)]
    assert all(steered[i].scores[0] == alone[i].scores[0] for i in range(len(cells)))
    unsteered = run(engine, corrupt, cells, segmented=False)
    assert unsteered[0].scores[0] != steered[0].scores[0]  # the global steering took effect


def test_segments_are_offered_on_vllms_runners_unless_opted_out(engine, monkeypatch):
    """`extension.segments_offered`: a runner with the seam's hooks offers segments (both of vLLM's
    runners since the V2 scores are computed exactly as V2's sampler computes them), unless
    CAUSALBOARD_SEGMENTS=0 (the opt-out for A/B runs) or a FULL CUDA graph runs mixed batches."""
    from types import SimpleNamespace

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1Runner

    from engine_ext.worker.extension import segments_offered

    assert engine.segment_block is not None  # the engine fixture installed the seam in this process
    runner = object.__new__(V1Runner)  # the attributes it reads, nothing else
    monkeypatch.delenv("CAUSALBOARD_SEGMENTS", raising=False)
    assert segments_offered(runner) is True
    monkeypatch.setenv("CAUSALBOARD_SEGMENTS", "0")
    assert segments_offered(runner) is False
    monkeypatch.setenv("CAUSALBOARD_SEGMENTS", "1")

    class FullMixed:  # a CUDAGraphMode whose mixed batches replay a FULL graph
        FULL = "FULL"

        def mixed_mode(self):
            return "FULL"
    runner.compilation_config = SimpleNamespace(cudagraph_mode=FullMixed())
    assert segments_offered(runner) is False


def _worker_counts(engine) -> tuple[int, int]:
    workers = engine.intervention_status()["workers"]
    return sum(w["entered_steps"] for w in workers), sum(w["layers_skipped"] for w in workers)


def test_cells_entering_at_their_layer_skip_the_layers_below_with_the_same_scores(engine, prompts):
    """Layer skipping (`agenerate_cells(entry_run=...)`; docs/segmented-cells.md): cells that patch
    only layer s and above, given the corrupt prompt's own run stored with `pre_attn` at every
    layer, enter the forward at s; their scores equal the cells run alone bit for bit, and the
    worker counts the steps that skipped layers. Entering from another prompt's run changes the
    scores (the stored values are what the skipped layers' output is replaced by), and a missing
    entry run voids the cells instead of scoring them wrongly."""
    clean, corrupt = prompts
    n, L = len(corrupt), engine.info.num_layers
    engine.capture(corrupt, [f"L{layer}.pre_attn" for layer in range(L)], "all_prompt", keep_as="seg-corrupt",
                   return_values=False)
    engine.capture(clean, [f"L{layer}.pre_attn" for layer in range(L)], "all_prompt", keep_as="seg-clean-entry",
                   return_values=False)
    try:
        s = L // 2
        cells = [Interventions(patch=(Patch.make(f"L{s}.{h}", [p], RunSource("seg-clean")),))
                 for h in HOOKS for p in range(n)]
        alone = run(engine, corrupt, cells, segmented=False)
        steps0, skipped0 = _worker_counts(engine)
        entered = run(engine, corrupt, cells, segmented=True, entry_run="seg-corrupt")
        steps1, skipped1 = _worker_counts(engine)
        for i in range(len(cells)):
            assert not isinstance(entered[i], Exception), entered[i]
            assert not entered[i].intervention.voided, entered[i].intervention.errors
            assert entered[i].scores[0] == alone[i].scores[0], (i, entered[i].scores, alone[i].scores)  # bit for bit
        assert steps1 > steps0 and skipped1 - skipped0 >= s * len(cells) * n, (steps0, steps1, skipped0, skipped1)
        # the patches took effect (not every cell scores like the first)
        assert len({tuple(alone[i].scores[0].values()) for i in range(len(cells))}) > 1

        # cells of several layers in one call: the scheduler keeps each step to one entry layer
        # (layer 0's cells enter nowhere), so layers 1 and L-1 both skip; the same scores again
        mixed = [c for layer in (0, 1, L - 1) for c in
                 (Interventions(patch=(Patch.make(f"L{layer}.{h}", [p], RunSource("seg-clean")),))
                  for h in HOOKS for p in range(n))]
        a = run(engine, corrupt, mixed, segmented=False)
        steps1, skipped1 = _worker_counts(engine)
        b = run(engine, corrupt, mixed, segmented=True, entry_run="seg-corrupt")
        steps2, skipped2 = _worker_counts(engine)
        assert all(a[i].scores[0] == b[i].scores[0] for i in range(len(mixed)))
        assert steps2 - steps1 >= 2 and skipped2 - skipped1 >= (1 + (L - 1)) * len(HOOKS) * n * n, (steps1, steps2)
        # bands of two layers: layer L-1's cells enter at L-2 (one layer more to compute), same scores
        c = run(engine, corrupt, mixed, segmented=True, entry_run="seg-corrupt", entry_band=2)
        assert all(a[i].scores[0] == c[i].scores[0] for i in range(len(mixed)))
        with pytest.raises(SpecError) as e:
            run(engine, corrupt, mixed[:2], segmented=True, entry_run="seg-corrupt", entry_band=0)
        assert e.value.field == "entry_band"

        # entering from the clean prompt's run: what lies below layer s is that run's, so scores move
        wrong = run(engine, corrupt, cells, segmented=True, entry_run="seg-clean-entry")
        assert any(wrong[i].scores[0] != alone[i].scores[0] for i in range(len(cells)))
        # a missing entry run voids every cell that needed it
        gone = run(engine, corrupt, cells[:4], segmented=True, entry_run="no-such-run")
        assert all(g.intervention.voided and "no-such-run" in g.intervention.errors[0] for g in gone.values()), gone
    finally:
        engine.drop_source("seg-corrupt")
        engine.drop_source("seg-clean-entry")
    assert engine.in_flight == 0


def test_layer_skipping_is_offered_where_the_forward_is_eager_and_ignored_elsewhere(engine, prompts, monkeypatch):
    """`Engine.layer_entry_offered`: one pipeline stage, segments, an eager forward (a compiled
    graph fixes the layers it runs), and by default the CPU only (on an H200 skipping was slower;
    `CAUSALBOARD_LAYER_ENTRY=1` offers it on an eager GPU engine, `0` nowhere). Where it is not
    offered, `prepare_cells` ignores `entry_run`: no entry patches, no entry layer for the
    scheduler, every layer runs, the same scores."""
    import types

    from engine_ext import Engine

    def offered(device="cpu", eager=True, stages=1, block=32, switch=None):
        if switch is None:
            monkeypatch.delenv("CAUSALBOARD_LAYER_ENTRY", raising=False)
        else:
            monkeypatch.setenv("CAUSALBOARD_LAYER_ENTRY", switch)
        fake = types.SimpleNamespace(segment_block=block, enforce_eager=eager, info=types.SimpleNamespace(device=device),
                                     config=types.SimpleNamespace(pipeline_parallel_size=stages))
        return Engine.layer_entry_offered.fget(fake)

    assert offered() and offered(switch="1") and not offered(switch="0")
    assert not offered(device="cuda") and offered(device="cuda", switch="1")
    assert not offered(device="cuda", eager=False, switch="1") and not offered(eager=False)
    assert not offered(stages=2) and not offered(block=None)
    monkeypatch.delenv("CAUSALBOARD_LAYER_ENTRY", raising=False)

    clean, corrupt = prompts
    n, L = len(corrupt), engine.info.num_layers
    cells = [Interventions(patch=(Patch.make(f"L{L - 1}.{h}", [p], RunSource("seg-clean")),)) for h in HOOKS for p in range(n)]

    def entry_patches(prepared) -> tuple[int, int, bool]:
        """(carriers, patches beyond the cells' own, whether any carrier enters at a layer)"""
        carriers = [what for _, _, what, _ in prepared.requests if hasattr(what, "segments")]
        return (len(carriers), sum(len(c.spec.patch) for c in carriers) - len(cells),
                any("entry" in c.segments for c in carriers))

    assert engine.layer_entry_offered
    carriers, extra, enters = entry_patches(engine.prepare_cells(corrupt, cells, SCORE_IDS, segmented=True,
                                                                 entry_run="no-such-run"))
    assert carriers >= 2 and extra == carriers and enters  # one entry patch per carrier
    monkeypatch.setenv("CAUSALBOARD_LAYER_ENTRY", "0")
    assert not engine.layer_entry_offered
    assert entry_patches(engine.prepare_cells(corrupt, cells, SCORE_IDS, segmented=True,
                                              entry_run="no-such-run")) == (carriers, 0, False)
    steps = _worker_counts(engine)[0]
    ignored = run(engine, corrupt, cells, segmented=True, entry_run="no-such-run")  # a missing run voids nothing here
    assert _worker_counts(engine)[0] == steps
    plain = run(engine, corrupt, cells, segmented=True)
    assert all(not ignored[i].intervention.voided and ignored[i].scores[0] == plain[i].scores[0] for i in range(len(cells)))
