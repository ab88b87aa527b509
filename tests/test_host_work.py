"""The per-request host work of captures and request preparation (issue 13): the step's captured
rows summed once and sliced per request give exactly the values (and order) of a per-request sum,
the client reads a capture block without copying a writable buffer, and every prepared request
lets vLLM skip its deep copy of the parameters."""

import numpy as np
import pytest
import torch

from engine_ext.engine.outputs import _intervention_result
from engine_ext.program import WorkerProgram
from engine_ext.sites import SitePosition, site_from_index
from engine_ext.worker.planner import StepCaptures
from engine_ext.worker.state import CapturedBlock, RequestState


def _reference_values(blocks: list[CapturedBlock]) -> dict:
    """What the worker returned before: per (site, position), the latest block's x.float() + r.float()."""
    latest = {}
    for blk in blocks:
        for i, pos in enumerate(blk.positions.tolist()):
            for j, site in enumerate(blk.sites.tolist()):
                latest[(site, pos)] = (blk.xs[i, j].float() + blk.rs[i, j].float()).numpy()
    keys = sorted(latest)
    return {"keys": [list(k) for k in keys], "data": np.stack([latest[k] for k in keys]).astype("<f4").tobytes() if keys else b""}


def _blocks(dtype, layout: list[tuple[list[int], list[int]]], hidden: int = 8, seed: int = 0) -> list[CapturedBlock]:
    """Blocks filed the way `StepPlanner.file_captures` files them: all blocks of one step share
    its `StepCaptures`, each at its own base row."""
    g = torch.Generator().manual_seed(seed)
    k = sum(len(p) * len(s) for p, s in layout)
    xs = torch.randn(k, hidden, generator=g).to(dtype)
    rs = torch.randn(k, hidden, generator=g).to(dtype)
    step = StepCaptures(xs, rs)
    out, base = [], 0
    for positions, sites in layout:
        n = len(positions) * len(sites)
        shape = (len(positions), len(sites), hidden)
        out.append(CapturedBlock(np.asarray(positions, np.int64), np.asarray(sites, np.int32),
                                 xs[base: base + n].view(shape), rs[base: base + n].view(shape), step, base))
        base += n
    return out


def _state(blocks: list[CapturedBlock]) -> RequestState:
    st = RequestState("r", WorkerProgram(key="k", n_prompt=4, max_pos=4, hash="h"))
    st.captures = blocks
    return st


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("layout", [
    [([3], [2, 5, 9])],                          # one position (last_prompt): a contiguous slice
    [([0, 1, 3], [2, 5, 9])],                     # several positions: the block transposed
    [([0, 1], [9, 2])],                           # sites out of order: the general path
    [([0, 1], [2, 5]), ([1, 2], [5, 7])],         # two blocks (preemption): the later one wins
])
def test_capture_values_equal_a_per_request_sum(dtype, layout):
    blocks = _blocks(dtype, layout)
    xs_before = [b.xs.clone() for b in blocks]
    got = _state(blocks).capture_values()
    want = _reference_values(blocks)
    assert got["keys"] == want["keys"]
    assert bytes(got["data"]) == want["data"]  # bit for bit
    assert isinstance(got["data"], bytearray)
    # the step's stored (x, r) pairs are untouched (for an fp32 model too)
    assert all(torch.equal(b.xs, x) for b, x in zip(blocks, xs_before))


@pytest.mark.parametrize("layout", [[([3], [2, 5, 9])], [([0, 1, 3], [2, 5, 9])], [([0, 1], [9, 2])]])
def test_shared_read_only_tables_give_the_same_results_with_their_key_list_computed_once(layout):
    """Blocks whose site and position tables are the read-only arrays capture-only plans share
    (`RequestPlan._capture_only`) give what blocks with tables of their own give, and their key
    list is computed once (`state._block_layout`); tables that can change are never cached."""
    from engine_ext.worker import state as worker_state

    worker_state._LAYOUTS.clear()
    (positions, sites), = layout
    shared_pos, shared_sites = np.asarray(positions, np.int64), np.asarray(sites, np.int32)
    shared_pos.flags.writeable = shared_sites.flags.writeable = False
    results = []
    for seed in (0, 1):
        (own,) = _blocks(torch.bfloat16, layout, seed=seed)
        (shared,) = _blocks(torch.bfloat16, layout, seed=seed)
        shared.positions, shared.sites = shared_pos, shared_sites
        got, want = _state([shared]).capture_values(), _state([own]).capture_values()
        assert got["keys"] == want["keys"] and bytes(got["data"]) == bytes(want["data"])
        results.append(got)
    assert len(worker_state._LAYOUTS) == 1  # the shared tables only
    if layout[0][1] == sorted(layout[0][1]):
        assert results[0]["keys"] is results[1]["keys"]  # computed once
    view = shared_pos[:]  # read-only, but a view: not cached
    (blk,) = _blocks(torch.bfloat16, layout)
    blk.positions, blk.sites = view, shared_sites
    _state([blk]).capture_values()
    assert len(worker_state._LAYOUTS) == 1


def test_requests_of_one_step_share_one_sum():
    a, b = _blocks(torch.bfloat16, [([3], [0, 1]), ([5], [0, 1])])
    assert a.step is b.step
    va, vb = a.values(), b.values()
    assert va.untyped_storage().data_ptr() == vb.untyped_storage().data_ptr()
    assert torch.equal(vb, b.xs.float() + b.rs.float())


def test_client_decodes_a_block_in_one_pass():
    blocks = _blocks(torch.bfloat16, [([2, 3], [1, 4])])
    res = {"status": "ok", "errors": [], "captures": _state(blocks).capture_values()}
    iv = _intervention_result(res, "h")
    want = _reference_values(blocks)
    values = np.frombuffer(want["data"], "<f4").reshape(len(want["keys"]), -1)
    assert list(iv.captures) == [SitePosition(site_from_index(s).layer, site_from_index(s).hook, p) for s, p in want["keys"]]
    for row, v in zip(values, iv.captures.values()):
        assert np.array_equal(row, v) and v.flags.writeable
    # a writable buffer (in-process worker) is read in place; read-only bytes are copied once
    first = next(iter(iv.captures.values()))
    assert np.shares_memory(first, np.frombuffer(res["captures"]["data"], np.uint8))
    ro = _intervention_result({**res, "captures": {**res["captures"], "data": bytes(res["captures"]["data"])}}, "h")
    assert all(v.flags.writeable for v in ro.captures.values())
    assert all(np.array_equal(a, b) for a, b in zip(ro.captures.values(), iv.captures.values()))


def test_request_ids_are_unique_random_and_hex():
    from engine_ext.engine.facade import _random_hex8

    ids = [_random_hex8() for _ in range(3000)]  # crosses several pool refills
    assert all(len(i) == 8 and int(i, 16) >= 0 for i in ids)
    assert len(set(ids)) > 2990  # 32 random bits: a collision or two at most


def test_prepared_requests_skip_vllms_deep_copy(engine):
    from engine_ext import GenerationParams
    from engine_ext.specs import Capture, Interventions

    spec = Interventions(capture=Capture.make(["L0.post_block"], "last_prompt"))
    for s in (None, spec):
        prep = engine._prepare([5, 6, 7], GenerationParams(max_tokens=1), s)
        assert prep.sampling.skip_clone
        clone = prep.sampling.clone()
        assert clone is not prep.sampling and clone.extra_args is prep.sampling.extra_args
    g = engine.generate([5, 6, 7], GenerationParams(max_tokens=1), spec)
    assert not g.intervention.voided and len(g.captures) == 1


def _specs():
    from engine_ext.specs import Capture, Clamp, Interventions, Noise, Patch, RunSource, Steer

    v = np.linspace(-1, 1, 8).astype(np.float32)
    return [
        Interventions(capture=Capture.make(["L0.post_block", "L3.pre_attn"], "last_prompt")),
        Interventions(capture=Capture.make(["L1.post_attn"], "all", keep_as="run-a", return_values=False)),
        Interventions(steer=(Steer.make(["L1.post_block", "L2.post_block"], v, scale=2.5),), score_token_ids=(3, 9)),
        Interventions(patch=(Patch.make("L2.pre_attn", [1, 2], RunSource("clean", (1, 2))),), noise=Noise.make([0, 1], seed=4)),
        Interventions(clamp=(Clamp.make(["L0.post_block"], v, max=0.5),), steer=(Steer.make(["L0.post_block"], v, positions=[3]),)),
    ]


@pytest.mark.parametrize("k", range(5))
def test_a_program_template_gives_the_text_of_a_program_compiled_per_key(k):
    from engine_ext.program import (TEMPLATE_KEY, ModelDims, ProgramTemplate, PromptInfo, compile_program,
                                    program_to_extra_args)

    dims = ModelDims(num_layers=4, hidden_size=8, vocab_size=100, embedding_std=1.0)
    spec, prompt = _specs()[k], PromptInfo(list(range(5)), max_tokens=3)
    template = ProgramTemplate(compile_program(spec, prompt, dims, key=TEMPLATE_KEY, named_vector_dims=lambda n: None))
    # the engine's plain keys (spliced in quotes as they are) and keys JSON must escape
    for key in ("cb-0-0123abcd", "cb-17-ffffffff", 'a"b', "back\\slash", "caf\u00e9", "tab\there", ""):
        want = program_to_extra_args(compile_program(spec, prompt, dims, key=key, named_vector_dims=lambda n: None),
                                     kv_salt=f"cb-{template.hash}-{key}")
        assert template.extra_args(key, kv_salt=f"cb-{template.hash}-{key}") == want


def test_a_template_needs_the_template_key():
    from engine_ext.program import ModelDims, ProgramTemplate, PromptInfo, compile_program

    dims = ModelDims(num_layers=4, hidden_size=8, vocab_size=100, embedding_std=1.0)
    with pytest.raises(ValueError):
        ProgramTemplate(compile_program(_specs()[0], PromptInfo([1, 2]), dims, key="cb-1-x", named_vector_dims=lambda n: None))


def test_one_spec_on_a_batch_compiles_once_per_prompt_length(engine, monkeypatch):
    import engine_ext.engine.facade as facade
    from engine_ext import GenerationParams
    from engine_ext.specs import Capture, Interventions

    calls = []
    real = facade.compile_program
    monkeypatch.setattr(facade, "compile_program", lambda *a, **kw: calls.append(a[1].n) or real(*a, **kw))
    spec = Interventions(capture=Capture.make(["L0.post_block", "L1.post_block"], "last_prompt"))
    prompts = [[5, 6, 7], [8, 9, 10], [11, 12, 13, 14], [15, 16, 17]]
    gens = engine.generate(prompts, GenerationParams(max_tokens=1), spec)
    assert sorted(calls) == [3, 4]
    keys = {g.request_id for g in gens}
    assert len(keys) == 4  # each request its own key (and so its own result)
    for p, g in zip(prompts, gens):
        assert not g.intervention.voided
        assert sorted(k.position for k in g.captures) == [len(p) - 1, len(p) - 1]
        solo = engine.generate(p, GenerationParams(max_tokens=1), spec)
        assert all(np.allclose(g.captures[k], solo.captures[k], rtol=1e-4, atol=1e-4) for k in solo.captures)


def test_a_template_whose_key_cannot_be_spliced_serialises_each_request():
    from engine_ext.program import (TEMPLATE_KEY, ModelDims, ProgramTemplate, PromptInfo, compile_program,
                                    program_to_extra_args)

    dims = ModelDims(num_layers=4, hidden_size=8, vocab_size=100, embedding_std=1.0)
    program = compile_program(_specs()[0], PromptInfo([1, 2, 3]), dims, key=TEMPLATE_KEY, named_vector_dims=lambda n: None)
    program["capture"]["extra"] = {"key": TEMPLATE_KEY}  # a second `"key":<template key>` in the text
    template = ProgramTemplate(program)
    assert template.text is None
    want = program_to_extra_args({**program, "key": "cb-3-abcdef01"}, kv_salt="s")
    assert template.extra_args("cb-3-abcdef01", kv_salt="s") == want
    assert want["causalboard"].count("cb-3-abcdef01") == 1


@pytest.mark.parametrize("capture", [([4, 9, 14], [3], False), ([9, 4], [0, 2, 2, 1], False), ([4], [1], True), ([4], [7], False)])
def test_capture_only_plans_equal_the_general_composition(capture, monkeypatch):
    """The shared tables of capture-only plans (`RequestPlan._capture_only`) are what the general
    composition gives, the digest (with the request key) included."""
    from engine_ext.worker import planner
    from engine_ext.worker.planner import RequestPlan

    sites, pos, gen = capture
    prog = WorkerProgram(key="k", n_prompt=5, max_pos=8, hash="h", capture_sites=sites,
                         capture_pos=np.asarray(pos, np.int64), capture_gen=gen)
    planner._CAPTURE_PLANS.clear()
    planner._CAPTURE_PROTOS.clear()
    twin = WorkerProgram(key="k2", n_prompt=5, max_pos=8, hash="h", capture_sites=list(sites),
                         capture_pos=np.asarray(pos, np.int64), capture_gen=gen)  # equal, other objects
    # the first builds, the others share (by the program's objects, or by shape for the twin)
    for i, (key, program) in enumerate((("cb-1-aaaa0000", prog), ("cb-2-bbbb1111", prog), ("cb-1-aaaa0000", twin),
                                        ("cb-3-cccc2222", prog))):
        fast = RequestPlan.build(key, 5, program, [], None, 3 + i)
        monkeypatch.setattr(planner, "SHARE_CAPTURE_PLANS", False)
        general = RequestPlan.build(key, 5, program, [], None, 3 + i)
        monkeypatch.setattr(planner, "SHARE_CAPTURE_PLANS", True)
        for f in ("prompt_sites", "prompt_slots", "gen_sites", "gen_slots", "ex_pos", "ex_site", "ex_slot", "cap_sites", "cap_pos"):
            a, b = getattr(fast, f), getattr(general, f)
            assert a.dtype == b.dtype and np.array_equal(a, b), f
        for f in ("key", "n_prompt", "cap_gen", "held", "digest", "global_version", "gen_template_only", "gen_group",
                  "cap_need", "ex_single"):
            assert getattr(fast, f) == getattr(general, f), f
        fast.held.append(99)  # a plan's own list: the next plan of this shape starts empty
    assert len(planner._CAPTURE_PLANS) == 1 and len(planner._CAPTURE_PROTOS) == 2
    assert not fast.cap_pos.flags.writeable  # shared: nobody may write them


@pytest.mark.parametrize("replaces", [
    {(7, 3): "pair"},                                   # a sweep cell
    {(7, 3): "pair", (2, 5): "pair", (7, 1): "pair"},   # several sites and positions, out of order
    {(4, 2): "zero", (4, 9): "vec"},                    # an affine replace, a generated position
    {(5, 1): "half-pair"},                              # alpha < 1 from a stored pair: affine
    {(3, 5): "pair"},                                   # one entry (a sweep's cell): `ex_single`
    {(2, 9): "vec"},                                    # one entry at a generated position
])
def test_patch_only_plans_equal_the_general_composition(replaces, monkeypatch):
    """`RequestPlan._replaces_only` (programs of patches alone) gives the general composition's
    tables, slots, digest and flags."""
    import torch

    from engine_ext.worker import planner
    from engine_ext.worker.intervention_op import SiteBuffers
    from engine_ext.worker.planner import RequestPlan
    from engine_ext.worker.slots import SlotTable
    from engine_ext.worker.source_store import SourceRun, StoredPair

    H = 4
    run = SourceRun("clean", {(s, p): (torch.full((H,), float(s)), torch.full((H,), float(p))) for s in range(8) for p in range(6)})
    kinds = {"pair": lambda s, p: (1.0, StoredPair(run, run.row_of[(s, p % 6)]), None),
             "half-pair": lambda s, p: (0.5, StoredPair(run, run.row_of[(s, p % 6)]), None),
             "zero": lambda s, p: (1.0, None, None),
             "vec": lambda s, p: (0.75, np.arange(H, dtype=np.float32), None)}
    prog = WorkerProgram(key="k", n_prompt=8, max_pos=12, hash="h")
    prog.replaces = {sp: kinds[k](*sp) for sp, k in replaces.items()}
    plans = {}
    for fast in (True, False):
        monkeypatch.setattr(planner, "FAST_REPLACE_PLANS", fast)
        slots = SlotTable(SiteBuffers(num_sites=8, max_rows=4, max_slots=16, max_capture_rows=4, hidden=H,
                                      device=torch.device("cpu"), dtype=torch.float32))
        plans[fast] = (RequestPlan.build("cb-7-0123abcd", 8, prog, [], slots, 2), slots)
    (fast, fslots), (general, gslots) = plans[True], plans[False]
    for f in ("prompt_sites", "prompt_slots", "gen_sites", "gen_slots", "ex_pos", "ex_site", "ex_slot", "cap_sites", "cap_pos"):
        a, b = getattr(fast, f), getattr(general, f)
        assert a.dtype == b.dtype and np.array_equal(a, b), f
    for f in ("key", "n_prompt", "cap_gen", "cap_need", "held", "digest", "global_version", "gen_template_only", "gen_group",
              "ex_single"):
        assert getattr(fast, f) == getattr(general, f), f
    assert (fast.ex_single is not None) == (len(replaces) == 1)
    for slot in fast.held:
        assert fslots.key_of(slot) == gslots.key_of(slot)
        fv, gv = fslots.value_of(slot), gslots.value_of(slot)
        assert fv.mode == gv.mode and fv.a == gv.a and fv.pair == gv.pair
        assert (fv.c is None and gv.c is None) or np.array_equal(fv.c, gv.c)


def _planner_over(programs: dict, num_sites: int, hidden: int, max_slots: int, max_capture_rows: int,
                  fast_path: str | None):
    """A `StepPlanner` on CPU tables and the plans of `programs` (8-token prompts); `fast_path`:
    a `RequestPlan` field (`ex_single`, `cap_single`) cleared on every plan, so that `plan_step`
    takes the per-plan path instead of the batched one. Returns (planner, plans, checksum)."""
    import copy

    import torch

    from engine_ext.worker.checksum import ActionChecksum
    from engine_ext.worker.intervention_op import SiteBuffers
    from engine_ext.worker.planner import RequestPlan, StepPlanner
    from engine_ext.worker.slots import SlotTable

    buffers = SiteBuffers(num_sites=num_sites, max_rows=32, max_slots=max_slots, max_capture_rows=max_capture_rows,
                          hidden=hidden, device=torch.device("cpu"), dtype=torch.float32)
    slots, checksum = SlotTable(buffers), ActionChecksum()
    plans = {rid: RequestPlan.build(p.key, 8, p, [], slots, 0) for rid, p in programs.items()}
    if fast_path is not None:
        plans = {rid: copy.copy(p) for rid, p in plans.items()}
        for p in plans.values():
            setattr(p, fast_path, None)
    return StepPlanner(buffers, slots, checksum, sink=None), plans, checksum


def _plan_window(planner, step: list[tuple[str, int, int]], plans: dict, on_overflow=None) -> int:
    """`plan_step` over one step of (request, first position, rows) windows; returns its rows."""
    qsl = np.cumsum([0] + [n for *_, n in step]).astype(np.int32)
    planner.plan_step([rid for rid, *_ in step], qsl, np.asarray([p0 for _, p0, _ in step], np.int32), plans,
                      on_overflow=on_overflow)
    return int(qsl[-1])


def test_single_entry_plans_are_written_as_the_per_plan_path_writes_them():
    """`plan_step` writes the one entry of every single-entry plan of a step at once
    (`RequestPlan.ex_single`, a sweep's cells): the tables, the applied actions and the checksum
    equal those of the per-plan path, for windows that hold the entry, windows before and after it
    (chunked prefill), decode steps, and plans of other shapes in the same step."""
    import torch

    from engine_ext.worker.source_store import SourceRun, StoredPair

    H, S = 4, 6
    run = SourceRun("clean", {(s, p): (torch.full((H,), float(s)), torch.full((H,), float(p))) for s in range(S) for p in range(8)})

    def prog(key, replaces, adds=()):
        p = WorkerProgram(key=key, n_prompt=8, max_pos=12, hash="h")
        p.replaces = {sp: (1.0, StoredPair(run, run.row_of[(sp[0], sp[1] % 8)]), None) for sp in replaces}
        return p

    programs = {"single-a": prog("a", [(2, 5)]), "single-b": prog("b", [(4, 0)]), "single-c": prog("c", [(1, 7)]),
                "single-gen": prog("g", [(3, 9)]), "two": prog("t", [(0, 1), (5, 6)]), "single-d": prog("d", [(2, 3)])}
    # (request, first position of the window, rows): whole prompts, windows before / after / around
    # the entry, and decode rows
    steps = [[("single-a", 0, 8), ("two", 0, 8), ("single-b", 0, 8)],
             [("single-c", 0, 4), ("single-d", 0, 3), ("single-gen", 0, 8)],
             [("single-c", 4, 4), ("single-d", 3, 5), ("single-gen", 8, 1), ("single-a", 8, 1)],
             [("single-a", 9, 1), ("single-gen", 9, 1), ("two", 8, 1)]]

    def run_steps(batched: bool):
        planner, plans, checksum = _planner_over(programs, S, H, 32, 4, None if batched else "ex_single")
        tables, counts = [], []
        for step in steps:
            rows = _plan_window(planner, step, plans)
            tables.append(planner.hs[:rows].copy())
            counts.append(checksum.count)
        return tables, counts, checksum.value, sum(p.ex_single is not None for p in plans.values())

    fast, per_plan = run_steps(True), run_steps(False)
    assert fast[3] == 5 and per_plan[3] == 0  # the fast path was taken for the five single-entry plans
    for a, b in zip(fast[0], per_plan[0]):
        assert np.array_equal(a, b)
    assert fast[1:3] == per_plan[1:3]
    # the entries in their windows only: step 1 all four, step 2 none (each window ends before its
    # entry), step 3 the two whose windows reach theirs, step 4 the generated position's
    assert [int((t >= 0).sum()) for t in fast[0]] == [4, 0, 2, 1]


def test_single_position_capture_plans_are_written_as_the_per_plan_path_writes_them():
    """`plan_step` writes the capture rows of every capture-only plan with one prompt position
    (`RequestPlan.cap_single`: P3's every layer at the last prompt token) at once: the capture
    table, the blocks handed to `after_forward` (owner, position, sites, base row), the applied
    actions, the checksum and an overflowing request's refusal equal those of the per-plan path,
    for windows that hold the position, windows before and after it (chunked prefill), decode
    steps, two site tables in one step and plans of other shapes among them."""
    H, S = 4, 8

    def prog(key, sites, pos, gen=False):
        return WorkerProgram(key=key, n_prompt=8, max_pos=12, hash="h", capture_sites=sites,
                             capture_pos=np.asarray(pos, np.int64), capture_gen=gen)

    programs = {"last-a": prog("a", [1, 3, 5], [7]), "last-b": prog("b", [1, 3, 5], [7]),
                "mid-c": prog("c", [0, 6], [2]), "two-pos": prog("t", [2], [1, 6]), "gen": prog("g", [4], [7], gen=True),
                "last-d": prog("d", [1, 3, 5], [7]), "big": prog("e", list(range(S)), [7])}
    steps = [[("last-a", 0, 8), ("two-pos", 0, 8), ("mid-c", 0, 8), ("last-b", 0, 8), ("big", 0, 8)],  # "big" overflows
             [("last-d", 0, 4), ("gen", 0, 8)],
             [("last-d", 4, 4), ("last-a", 8, 1), ("gen", 8, 1)],
             [("last-a", 9, 1), ("mid-c", 8, 1)]]

    def run_steps(batched: bool):
        planner, plans, checksum = _planner_over(programs, S, H, 8, 12, None if batched else "cap_single")
        tables, blocks, counts, refused = [], [], [], []
        for step in steps:
            rows = _plan_window(planner, step, plans, on_overflow=lambda rid, msg: refused.append((rid, msg)))
            tables.append(planner.hc[:rows].copy())
            blocks.append([(b.owner, b.positions.tolist(), b.sites.tolist(), b.base, b.need) for b in planner._blocks])
            planner._blocks = []
            counts.append(checksum.count)
        return tables, blocks, counts, checksum.value, refused, sum(p.cap_single is not None for p in plans.values())

    fast, per_plan = run_steps(True), run_steps(False)
    assert fast[5] == 5 and per_plan[5] == 0  # the fast path was taken for the five one-position plans
    for a, b in zip(fast[0], per_plan[0]):
        assert np.array_equal(a, b)
    assert fast[1:5] == per_plan[1:5]
    assert [len(b) for b in fast[1]] == [4, 1, 2, 0] and [rid for rid, _ in fast[4]] == ["big"]
    # step 1: 3 + 2 + 2 (two-pos: position 1 and 6) + 3 rows, ids 0..9 (the step's 12 rows refuse big's 8)
    assert sorted(fast[0][0][fast[0][0] >= 0].tolist()) == list(range(10))
