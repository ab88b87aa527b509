"""The reference fork's own patching client (`PatchStudy`, RhizoNymph/vllm `feat/integration`,
`vllm/entrypoints/serve/patch/client.py`) driven unchanged against causalboard's server.

Nothing of the fork is copied into this repository: the tests load its client modules at run
time from a checkout named by `CAUSALBOARD_FORK_CHECKOUT` (a directory holding
`vllm/entrypoints/serve/patch/{client,alignment,spans}.py`, e.g. `git worktree add <dir>
feat/integration` of the fork) and skip, saying so, when it is not given. The client needs only
`openai`, `httpx` and `pybase64`, not vLLM: its two sibling modules are loaded by path under their
own names for the duration of the import, then removed again, so the installed (stock) vLLM's
namespace is never touched.

Every `PatchStudy` method runs: `capture_clean`, per-cell and server-side sweeps with every
position form (indices, `Span`, "all_prompt"), streaming (`on_cell`), `zoom`, multi-hook,
`ablation_sweep` with each source kind (zeros, a steering module, `source_inline` +
`pack_vectors`), `positions_for`, `drop_run`; the per-cell and server-side paths agree within
the sweep's noise floor.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

ENV = "CAUSALBOARD_FORK_CHECKOUT"
PATCH_DIR = Path("vllm/entrypoints/serve/patch")
PKG = "vllm.entrypoints.serve.patch"
#: the name the fork's client module is loaded under (outside vLLM's namespace)
CLIENT = "causalboard_fork_patch_client"
#: per-cell vs server-side: within the noise floor, plus float32 rounding of two separate runs
EXTRA_ATOL = 1e-4


def load_fork_client():
    """The fork's `client` module, loaded by path (its siblings `alignment` and `spans` are put
    under their own dotted names in sys.modules only while it imports)."""
    root = os.environ.get(ENV)
    if not root:
        pytest.skip(f"{ENV} is not set: point it at a checkout of the reference fork (RhizoNymph/vllm, branch "
                    "feat/integration) to run the contract tests")
    folder = Path(root) / PATCH_DIR
    if not (folder / "client.py").is_file():
        pytest.skip(f"{ENV}={root} holds no {PATCH_DIR}/client.py (not a checkout of the fork's feat/integration)")
    pytest.importorskip("openai", reason="the fork's client needs the openai package")
    pytest.importorskip("pybase64", reason="the fork's client needs pybase64")
    pytest.importorskip("truststore", reason="the openai client's transport (httpx2) needs truststore (requirements/cpu.txt)")
    names = [f"{PKG}.alignment", f"{PKG}.spans"]
    saved = {n: sys.modules.get(n) for n in names}
    try:
        for n in names:
            spec = importlib.util.spec_from_file_location(n, folder / f"{n.rsplit('.', 1)[1]}.py")
            mod = importlib.util.module_from_spec(spec)
            sys.modules[n] = mod
            spec.loader.exec_module(mod)
        spec = importlib.util.spec_from_file_location(CLIENT, folder / "client.py")
        client = importlib.util.module_from_spec(spec)
        sys.modules[CLIENT] = client  # dataclasses look their module up while the class is built
        spec.loader.exec_module(client)
        return client
    finally:
        for n, old in saved.items():
            if old is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = old


@pytest.fixture(scope="module")
def fork():
    return load_fork_client()


@pytest.fixture(scope="module")
def study(fork, server_url):
    models = httpx.get(f"{server_url}/v1/models").json()  # as a fork user finds the model name
    return fork.PatchStudy(model=models["data"][0]["id"], base_url=f"{server_url}/v1", concurrency=8)


def one_token_pair(engine, tasks, equal: bool = True) -> dict:
    """A pair whose answer and foil display strings tokenize back to exactly their ids (the fork's
    client grades by token string)."""
    for p in tasks["pairs"]:
        if p["equal_length"] != equal:
            continue
        ans, foil = engine.token_strings([p["answer_id"]])[0], engine.token_strings([p["foil_id"]])[0]
        if (engine.tokenize(ans, add_special_tokens=False) == [p["answer_id"]]
                and engine.tokenize(foil, add_special_tokens=False) == [p["foil_id"]]):
            return {**p, "answer_str": ans, "foil_str": foil}
    pytest.fail("no pair with single-token answer and foil strings")


def grid(result) -> np.ndarray:
    return np.array(result.grid, dtype=float)


def assert_same(per_cell, server, what: str) -> None:
    assert per_cell.layers == server.layers and per_cell.positions == server.positions, what
    floor = server.noise_floor or 0.0
    diff = np.nanmax(np.abs(grid(per_cell) - grid(server)))
    assert diff <= floor + EXTRA_ATOL, f"{what}: per-cell vs server-side differ by {diff} (noise floor {floor})"


def test_capture_then_per_cell_and_server_side_sweeps_agree(study, fork, engine, tasks, http):
    p = one_token_pair(engine, tasks)
    n = len(engine.tokenize(p["corrupt_prompt"]))
    clean = study.capture_clean(p["clean_prompt"], run="fork-clean", answer_token=p["answer_str"], foil_token=p["foil_str"])
    assert clean.num_prompt_tokens == len(engine.tokenize(p["clean_prompt"]))
    exact = engine.score(p["clean_prompt"], [p["answer_id"], p["foil_id"]])
    assert abs(clean.clean_logprob - exact[p["answer_id"]]) < 1e-4
    assert abs(clean.clean_logit_diff - (exact[p["answer_id"]] - exact[p["foil_id"]])) < 1e-4

    layers = [0, 2, engine.info.num_layers - 1]
    for positions in ("all_prompt", [1, n - 1], [fork.Span(p["subject_corrupt"])], [0, fork.Span("by")]):
        kw = dict(run="fork-clean", layers=layers, positions=positions, answer_token=p["answer_str"], clean=clean)
        per_cell = asyncio.run(study.sweep_layers_positions(p["corrupt_prompt"], metric="recovered", **kw))
        server = asyncio.run(study.sweep_layers_positions(p["corrupt_prompt"], metric="recovered", server_side=True, **kw))
        assert per_cell.metric_name == server.metric_name == "recovered"
        assert server.noise_floor is not None and not server.auto_captured
        assert_same(per_cell, server, f"positions={positions!r}")
        if positions == "all_prompt":
            assert server.positions == list(range(n))
            # recovered is 1 where the whole clean residual goes in: the last position after the last layer
            assert abs(grid(server)[-1, -1] - 1.0) < 1e-5
    assert server.positions == [0] + engine.resolve_positions(p["corrupt_prompt"], [{"span": "by"}])

    # logit_diff, per cell vs server
    kw = dict(run="fork-clean", layers=[1, 3], positions=[1, 2], answer_token=p["answer_str"], foil_token=p["foil_str"],
              clean=clean, metric="logit_diff")
    assert_same(asyncio.run(study.sweep_layers_positions(p["corrupt_prompt"], **kw)),
                asyncio.run(study.sweep_layers_positions(p["corrupt_prompt"], server_side=True, **kw)), "logit_diff")
    assert study.drop_run("fork-clean") is True
    assert study.drop_run("fork-clean") is False


def test_one_call_auto_capture_streaming_keep_source_zoom_and_drop(study, fork, engine, tasks):
    p = one_token_pair(engine, tasks)
    cells: list[dict] = []
    coarse = asyncio.run(study.sweep_layers_positions(
        p["corrupt_prompt"], clean_prompt=p["clean_prompt"], server_side=True, layers=list(range(8)), positions="all_prompt",
        answer_token=p["answer_str"], metric="recovered", keep_source=True, on_cell=cells.append))
    assert coarse.auto_captured and coarse.captured_source_run
    n = len(coarse.layers) * len(coarse.positions)
    assert len(cells) == n and {c["type"] for c in cells} == {"cell"}
    by_cell = {(c["layer"], c["position"]): c["value"] for c in cells}
    for i, layer in enumerate(coarse.layers):
        for j, pos in enumerate(coarse.positions):
            assert by_cell[(layer, pos)] == coarse.grid[i][j]
    run = coarse.captured_source_run
    # zoom around the peak from the kept run (per-cell path, the fork's zoom), against the coarse grid
    clean = study.capture_clean(p["clean_prompt"], run="fork-zoom-clean", answer_token=p["answer_str"])
    # (the fork's zoom does not clip its window to the prompt or the model: centre it inside both)
    zoom = asyncio.run(study.zoom(coarse, corrupt_prompt=p["corrupt_prompt"], run=run, answer_token=p["answer_str"],
                                  clean=clean, around=(3, 2), layer_radius=1, position_radius=1))
    assert zoom.layers == [2, 3, 4] and zoom.positions == [1, 2, 3]
    assert zoom.metric_name == "recovered" and zoom.layers and zoom.positions
    g, z = grid(coarse), grid(zoom)
    for i, layer in enumerate(zoom.layers):
        for j, pos in enumerate(zoom.positions):
            ref = g[coarse.layers.index(layer), coarse.positions.index(pos)]
            assert abs(z[i, j] - ref) <= (coarse.noise_floor or 0.0) + 1e-3, (layer, pos)
    assert study.drop_run(run) is True and study.drop_run("fork-zoom-clean") is True
    # without keep_source the auto-captured run is dropped by the server
    once = asyncio.run(study.sweep_layers_positions(p["corrupt_prompt"], clean_prompt=p["clean_prompt"], server_side=True,
                                                     layers=[0], positions=[1], answer_token=p["answer_str"]))
    assert once.auto_captured and study.drop_run(once.captured_source_run) is False


def test_multi_hook_and_single_hook_lists(study, engine, tasks):
    p = one_token_pair(engine, tasks)
    kw = dict(clean_prompt=p["clean_prompt"], server_side=True, layers=[1, 4], positions=[1, -1], answer_token=p["answer_str"])
    multi = asyncio.run(study.sweep_layers_positions(p["corrupt_prompt"], hooks=["post_block", "pre_attn", "post_attn"], **kw))
    assert isinstance(multi, dict) and set(multi) == {"post_block", "pre_attn", "post_attn"}
    one = asyncio.run(study.sweep_layers_positions(p["corrupt_prompt"], hooks=["post_attn"], **kw))
    assert isinstance(one, dict) and list(one) == ["post_attn"]  # one hook listed: still a dict per hook (fork)
    plain = asyncio.run(study.sweep_layers_positions(p["corrupt_prompt"], hook="post_attn", **kw))
    floor = max(plain.noise_floor or 0.0, one["post_attn"].noise_floor or 0.0)
    assert np.nanmax(np.abs(grid(plain) - grid(one["post_attn"]))) <= floor + EXTRA_ATOL
    assert np.nanmax(np.abs(grid(plain) - grid(multi["post_attn"]))) <= floor + (multi["post_attn"].noise_floor or 0) + EXTRA_ATOL
    # the per-cell path refuses hooks (the fork's own rule, client-side)
    with pytest.raises(ValueError):
        asyncio.run(study.sweep_layers_positions(p["corrupt_prompt"], run="x", hooks=["post_block"], layers=[0], positions=[0],
                                                 answer_token=p["answer_str"]))


def test_unequal_lengths_align_the_same_way_on_both_paths(study, engine, tasks):
    p = one_token_pair(engine, tasks, equal=False)
    clean = study.capture_clean(p["clean_prompt"], run="fork-unequal", answer_token=p["answer_str"])
    kw = dict(run="fork-unequal", layers=[0, 3], positions="all_prompt", answer_token=p["answer_str"], clean=clean)
    per_cell = asyncio.run(study.sweep_layers_positions(p["corrupt_prompt"], **kw))
    server = asyncio.run(study.sweep_layers_positions(p["corrupt_prompt"], server_side=True, **kw))
    n = len(engine.tokenize(p["corrupt_prompt"]))
    assert len(server.positions) < n  # the unaligned middle is left out of positions/grid, as in the fork
    assert_same(per_cell, server, "unequal lengths")
    assert any("skipped" in note for note in server.notes) and any("skipped" in note for note in per_cell.notes)
    assert study.drop_run("fork-unequal") is True


def test_ablation_sweeps_with_each_source_kind(study, fork, engine, tasks, hf_ref, http):
    from engine_ext.reference.hf import RefEdit

    f = tasks["facts"][5]
    answer = engine.token_strings([f["answer_id"]])[0]
    if engine.tokenize(answer, add_special_tokens=False) != [f["answer_id"]]:
        pytest.skip("fact answer is not one token as a string")
    ids = engine.tokenize(f["prompt"])
    last = len(ids) - 1
    zeros = asyncio.run(study.ablation_sweep(f["prompt"], layers=[2], positions=[last], hook="post_attn", answer_token=answer))
    ref = hf_ref.score(ids, [f["answer_id"]], edits=[RefEdit.zero((2, "post_attn"), [last])])
    assert abs(zeros.grid[0][0] - ref[f["answer_id"]]) <= 2e-3

    rng = np.random.default_rng(0)
    hidden = engine.info.hidden_size
    v2, v4 = rng.normal(size=hidden).astype(np.float32), rng.normal(size=hidden).astype(np.float32)
    r = http.post("/v1/steering/modules/register", json={"name": "fork-ablate", "vectors": {
        "post_block": {"2": v2.tolist(), "4": v4.tolist()}}})
    assert r.status_code == 200, r.text
    try:
        mod = asyncio.run(study.ablation_sweep(f["prompt"], source="fork-ablate", layers=[2, 4], positions=[1, last],
                                               answer_token=answer))
        for i, (layer, vec) in enumerate(((2, v2), (4, v4))):  # each cell takes the module's vector at its own layer
            for j, pos in enumerate((1, last)):
                want = hf_ref.score(ids, [f["answer_id"]], edits=[RefEdit.patch((layer, "post_block"), [pos], vec)])
                assert abs(mod.grid[i][j] - want[f["answer_id"]]) <= 2e-3, (layer, pos)
        # a module without a vector at a swept site is refused (the fork would run that cell unpatched)
        with pytest.raises(httpx.HTTPStatusError) as err:
            asyncio.run(study.ablation_sweep(f["prompt"], source="fork-ablate", layers=[3], positions=[1], answer_token=answer))
        assert err.value.response.status_code == 400 and err.value.response.json()["field"] == "source_module"
    finally:
        http.post("/v1/steering/modules/unregister", json={"name": "fork-ablate"})

    table = np.stack([v2, v4])
    for dtype in ("float32", "bfloat16"):
        inline = asyncio.run(study.ablation_sweep(f["prompt"], source_inline=1, patch_vectors=fork.PatchStudy.pack_vectors(table, dtype),
                                                  layers=[3], positions=[last], answer_token=answer))
        row = table[1] if dtype == "float32" else _bf16(table[1])
        want = hf_ref.score(ids, [f["answer_id"]], edits=[RefEdit.patch((3, "post_block"), [last], row)])
        assert abs(inline.grid[0][0] - want[f["answer_id"]]) <= 2e-3, dtype
    # a zero-ablation of some dimensions (the fork's mask example), and a graded inline mask row
    dims = [0, 1, 40]
    m = np.zeros(hidden, np.float32)
    m[dims] = 1.0
    masked = asyncio.run(study.ablation_sweep(f["prompt"], mask={"indices": dims}, layers=[1, 4], positions=[last], answer_token=answer))
    for i, layer in enumerate((1, 4)):
        want = hf_ref.score(ids, [f["answer_id"]], edits=[RefEdit.zero((layer, "post_block"), [last], mask=m)])
        assert abs(masked.grid[i][0] - want[f["answer_id"]]) <= 2e-3, layer
    w = np.linspace(0, 1, hidden, dtype=np.float32)
    graded = asyncio.run(study.ablation_sweep(f["prompt"], source_inline=0, mask={"inline": 1},
                                              patch_vectors=fork.PatchStudy.pack_vectors(np.stack([v4, w])),
                                              layers=[2], positions=[last], hook="mlp_out", answer_token=answer))
    want = hf_ref.score(ids, [f["answer_id"]], edits=[RefEdit.patch((2, "mlp_out"), [last], v4, mask=w)])
    assert abs(graded.grid[0][0] - want[f["answer_id"]]) <= 2e-3


def _bf16(v: np.ndarray) -> np.ndarray:
    import torch

    return torch.as_tensor(v).to(torch.bfloat16).to(torch.float32).numpy()


def test_positions_for_resolves_spans_like_the_server(study, engine, tasks):
    p = one_token_pair(engine, tasks)
    got = asyncio.run(study.positions_for(p["corrupt_prompt"], p["subject_corrupt"]))
    assert got == engine.resolve_positions(p["corrupt_prompt"], [{"span": p["subject_corrupt"]}])


def load_fork_reader():
    """The fork's filesystem-capture reader (`vllm/v1/capture/consumers/filesystem/reader.py`),
    loaded by path like the client (its `types` sibling only while it imports)."""
    root = os.environ.get(ENV)
    folder = Path(root or "") / "vllm/v1/capture/consumers/filesystem"
    if not root or not (folder / "reader.py").is_file():
        pytest.skip(f"{ENV} does not hold vllm/v1/capture/consumers/filesystem/reader.py")
    name = "vllm.v1.capture.consumers.filesystem.types"
    saved = sys.modules.get(name)
    try:
        spec = importlib.util.spec_from_file_location(name, folder / "types.py")
        types = importlib.util.module_from_spec(spec)
        sys.modules[name] = types
        spec.loader.exec_module(types)
        spec = importlib.util.spec_from_file_location("causalboard_fork_capture_reader", folder / "reader.py")
        reader = importlib.util.module_from_spec(spec)
        sys.modules["causalboard_fork_capture_reader"] = reader
        spec.loader.exec_module(reader)
        return reader
    finally:
        if saved is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = saved


def test_filesystem_captures_read_by_the_forks_reader(engine, tasks, tmp_path):
    from fastapi.testclient import TestClient

    from app.api.app import create_app

    reader = load_fork_reader()
    prompt = tasks["facts"][9]["prompt"]
    n = len(engine.tokenize(prompt))
    want = engine.capture(prompt, ["L2.post_attn", "L5.post_block"], "all_prompt").captures
    spec = {"request_id": "r1", "hooks": {"post_attn": [2], "post_block": [5]}, "positions": "all_prompt"}

    def check(got: dict, what: str) -> None:
        check_entries(got, want, n, engine.info.hidden_size, what)

    with TestClient(create_app(engine, capture_dir=str(tmp_path))) as client:
        for layout in ("per_file", "packed"):
            r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1,
                                                      "capture": {"filesystem": {**spec, "tag": layout, "layout": layout}}})
            assert r.status_code == 200, r.text
            got = reader.read_request(tmp_path / layout / "r1")
            check(got, layout)
        # sharded: requests share the tag's shard files; the reader groups them by request
        for rid in ("r1", "r2"):
            r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "capture": {
                "filesystem": {**spec, "request_id": rid, "tag": "sh", "layout": "sharded"}}})
            assert r.status_code == 200, r.text
        shards = reader.read_sharded(tmp_path / "sh")
        assert set(shards) == {"r1", "r2"}
        for rid, got in shards.items():
            check(got, rid)


def check_entries(got: dict, want: dict, n: int, hidden: int, what: str) -> None:
    assert set(got) == {(2, "post_attn"), (5, "post_block")}, what
    for (layer, hook), entry in got.items():
        assert entry.array.shape == (n, hidden) and entry.dtype == "float32", what
        np.testing.assert_array_equal(entry.array, np.stack([want[(layer, hook, p)] for p in range(n)]))
