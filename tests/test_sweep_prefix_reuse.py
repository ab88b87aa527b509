"""Sweeps that reuse the corrupt prompt's prefix cache (`prefix_reuse`, issue #13's P1c): a cell
patched at position p changes nothing before p, so it reads the KV blocks below its first
modified position from the cache instead of computing them. On the real CPU engine (32-token KV
blocks, bundled model): every cell of a reusing sweep is bit-identical to the same cell computed
from scratch, the reuse really happened (`reused_prompt_tokens`), and no KV written under a patch
is read by a request that would compute it differently."""

from __future__ import annotations

import asyncio

import pytest

from engine_ext.generation import GenerationParams
from engine_ext.specs import Interventions

pytestmark = pytest.mark.engine

BLOCK = 32  # the CPU engine's KV block (engine_ext.engine.runtime.RuntimeDefaults.block_size)


def long_pair(tasks) -> tuple[str, str, dict]:
    """The first equal-length pair after ~70 tokens of other facts: cells from position ~70 on
    can reuse two 32-token blocks, cells in the filler one or none."""
    pair = next(p for p in tasks["pairs"] if p["equal_length"])
    filler = " ".join(f["prompt"] + " " + f["answer"] + "." for f in tasks["facts"][:10])
    return f"{filler} {pair['clean_prompt']}", f"{filler} {pair['corrupt_prompt']}", pair


def sweep(http, **body) -> dict:
    r = http.post("/v1/patch_sweep", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def grids(summary: dict) -> dict[str, list]:
    return {g["hook"]: g["grid"] for g in summary["hook_grids"]}


def test_cells_read_the_prefix_cache_and_equal_the_cells_computed_from_scratch(http, engine, tasks):
    clean, corrupt, pair = long_pair(tasks)
    n = http.post("/v1/tokenize", json={"prompt": corrupt}).json()["count"]
    assert 3 * BLOCK > n > 2 * BLOCK + 8, n  # cells at the subject can reuse two blocks
    body = dict(prompt=corrupt, clean_prompt=clean, answer_token_id=pair["answer_id"], foil_token_id=pair["foil_id"],
                metric="logit_diff", hooks=["post_attn", "post_block"], layers=[0, 3, 7])
    fresh = sweep(http, **body, prefix_reuse=False)
    reused = sweep(http, **body, prefix_reuse=True)
    default = sweep(http, **body)  # the CPU engine's default: on

    assert fresh["prefix_reuse"] is False and fresh["reused_prompt_tokens"] == 0
    assert reused["prefix_reuse"] is True and default["prefix_reuse"] is True
    # every cell patched at p >= 32 reads at least the blocks below p (the baselines read more)
    positions = reused["positions"]
    floor = sum(BLOCK * (p // BLOCK) for p in positions) * 2 * 3
    assert reused["reused_prompt_tokens"] >= floor > 0, (reused["reused_prompt_tokens"], floor)
    # bit-identical: the same floats, not merely close
    assert grids(reused) == grids(fresh) == grids(default)
    assert reused["corrupt"] == fresh["corrupt"] and reused["clean"] == fresh["clean"]
    # the patches have an effect, so equality is not that of an all-zero grid
    assert max(abs(v) for grid in grids(reused).values() for row in grid for v in row if v is not None) > 0.5

    # isolation: the unpatched corrupt prompt, read from the cache the sweeps filled, scores as
    # computed from scratch (no block written under a patch was shared with it)
    ids = engine.tokenize(corrupt)
    spec = Interventions(score_token_ids=(pair["answer_id"], pair["foil_id"]))

    async def both():
        scratch = await engine.agenerate(ids, GenerationParams(max_tokens=1), spec, fresh=True)
        cached = await engine.agenerate(ids, GenerationParams(max_tokens=1), spec)
        return scratch, cached

    scratch, cached = asyncio.run(both())
    assert cached.num_cached_tokens >= 2 * BLOCK
    assert cached.scores == scratch.scores


def test_a_noise_sweep_reuses_the_blocks_before_the_noise(http, tasks):
    clean, _corrupt, pair = long_pair(tasks)
    subject = pair["subject_clean"]
    body = dict(prompt=clean, answer_token_id=pair["answer_id"], metric="recovered",
                noise={"span": subject, "scale": 3.0, "seed": 1, "samples": 2}, layers=[0, 5], hooks=["post_block"])
    fresh = sweep(http, **body, prefix_reuse=False)
    reused = sweep(http, **body, prefix_reuse=True)
    noised = reused["noise"]["positions"]
    assert min(noised) >= 2 * BLOCK  # the noise is on the late subject: two clean blocks before it
    assert fresh["reused_prompt_tokens"] == 0
    # a cell reads the blocks below min(its position, the noise's first position); x 2 layers x 2 samples
    floor = sum(BLOCK * (min(p, min(noised)) // BLOCK) for p in reused["positions"]) * 2 * 2
    assert reused["reused_prompt_tokens"] >= floor > 0
    assert grids(reused) == grids(fresh)
    assert reused["corrupt"] == fresh["corrupt"] and reused["noise_floor"] == fresh["noise_floor"]
