"""`Engine.agenerate_many` on the real engine (bundled model, CPU): every index once, results
equal to per-item `agenerate`, a bad item's own error without breaking the others, a voided item
as a normal result, and leaving early (task cancelled, `aclose`) aborting every unfinished item."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import numpy as np
import pytest

from engine_ext import GenerationParams
from engine_ext.engine.outputs import BatchSink
from engine_ext.errors import SpecError
from engine_ext.specs import Interventions, Patch, Steer

ONE = GenerationParams(max_tokens=1)
SCORE_IDS = (10, 20)


def fact(tasks, k=0):
    return tasks["facts"][k]


def wait_idle(engine, before: int, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while engine.in_flight != before and time.time() < deadline:
        time.sleep(0.05)
    assert engine.in_flight == before


async def collect(engine, prompts, params, specs, **kw) -> dict:
    out: dict = {}
    async for i, res in engine.agenerate_many(prompts, params, specs, **kw):
        assert i not in out, f"index {i} yielded twice"
        out[i] = res
    return out


@pytest.fixture(scope="module")
def clean_run(engine, tasks):
    """A stored clean run to patch from (dropped at the end)."""
    prompt = fact(tasks, 3)["prompt"]
    ids = engine.tokenize(prompt)
    engine.capture(ids, [f"L{l}.post_block" for l in range(engine.info.num_layers)], "all_prompt",
                   keep_as="batch-api-clean", return_values=False)
    yield ids
    engine.drop_source("batch-api-clean")


def patched_cells(engine, ids) -> list[Interventions]:
    return [Interventions(patch=(Patch.make(f"L{l}.post_block", [p], {"run": "batch-api-clean"}),), score_token_ids=SCORE_IDS)
            for l in range(engine.info.num_layers) for p in (1, len(ids) - 1)]


def test_batch_matches_per_item_agenerate_and_yields_every_index_once(engine, tasks, clean_run):
    ids = clean_run
    corrupt = list(ids)
    corrupt[1] = (corrupt[1] + 7) % engine.info.vocab_size
    specs = patched_cells(engine, ids) + [None, Interventions(score_token_ids=SCORE_IDS)]
    before = engine.in_flight

    async def both():
        batch = await collect(engine, [corrupt] * len(specs), ONE, specs, fresh=True)
        solo = [await engine.agenerate(corrupt, ONE, s, fresh=True) for s in specs]
        return batch, solo

    batch, solo = asyncio.run(both())
    assert sorted(batch) == list(range(len(specs)))
    for i, s in enumerate(solo):
        b = batch[i]
        assert b.token_ids == s.token_ids and b.prompt_token_ids == s.prompt_token_ids == corrupt
        assert len(b.scores) == len(s.scores)
        for bs, ss in zip(b.scores, s.scores):
            assert bs.keys() == ss.keys()
            assert np.allclose([bs[k] for k in bs], [ss[k] for k in ss], atol=1e-5), (i, bs, ss)
        if specs[i] is not None and specs[i].patch:
            assert b.intervention is not None and not b.intervention.voided, b.intervention
    # the patches changed something (so the comparison above is not between identical unpatched runs)
    assert len({round(batch[i].scores[0][SCORE_IDS[0]], 4) for i in range(len(specs) - 2)}) > 1
    wait_idle(engine, before)


def test_one_spec_for_many_prompts_and_multi_token_generation(engine, tasks):
    prompts = [fact(tasks, k)["prompt"] for k in range(4)]
    v = np.full(engine.info.hidden_size, 0.5, dtype=np.float32)
    spec = Interventions(steer=(Steer.make(["L2.post_block"], v),))
    params = GenerationParams(max_tokens=5, ignore_eos=True)

    async def run():
        return await collect(engine, prompts, params, spec)

    batch = asyncio.run(run())
    solo = engine.generate(prompts, params, spec)
    assert [batch[i].token_ids for i in range(len(prompts))] == [g.token_ids for g in solo]
    assert all(len(batch[i].token_ids) == 5 for i in batch)


def test_a_bad_item_gets_its_own_error_and_the_others_run(engine, tasks, clean_run):
    ids = clean_run
    vocab = engine.info.vocab_size
    good = Interventions(score_token_ids=SCORE_IDS)
    void = Interventions(patch=(Patch.make("L1.post_block", [1], {"run": "never-stored-batch"}),), score_token_ids=SCORE_IDS)
    bad_params = GenerationParams(max_tokens=0)  # one parameters object for two items: each gets the error
    prompts = [ids, [vocab + 5], ids, ids, ids, ids, ids]
    specs = [good, good, Interventions(score_token_ids=(vocab + 1,)), void, good, good, good]
    params = [ONE, ONE, ONE, ONE, ONE, bad_params, bad_params]
    before = engine.in_flight

    out = asyncio.run(collect(engine, prompts, params, specs))
    assert sorted(out) == list(range(7))
    assert all(isinstance(out[i], SpecError) and out[i].field == "max_tokens" for i in (5, 6)), out
    assert isinstance(out[1], SpecError) and out[1].field == "prompt"
    assert isinstance(out[2], SpecError) and "score_token_ids" in out[2].field
    assert out[3].intervention.voided and "never-stored-batch" in out[3].intervention.errors[0]
    ref = engine.generate(ids, ONE, good)
    for i in (0, 4):
        assert np.allclose([out[i].scores[0][t] for t in SCORE_IDS], [ref.scores[0][t] for t in SCORE_IDS], atol=1e-5)
    wait_idle(engine, before)
    # the engine stays up
    assert engine.generate(ids, ONE).token_ids


def test_mismatched_spec_count_is_refused_before_anything_runs(engine, tasks):
    async def run():
        return await collect(engine, ["a b", "c d"], ONE, [None])

    with pytest.raises(SpecError) as e:
        asyncio.run(run())
    assert e.value.field == "interventions"


def spy_aborts(engine, monkeypatch) -> list[list[str]]:
    """Record every `abort_many` of the engine loop (each still aborts for real)."""
    aborted: list[list[str]] = []
    real_abort_many = engine._loop.abort_many

    def spy(ids):
        aborted.append(list(ids))
        real_abort_many(ids)

    monkeypatch.setattr(engine._loop, "abort_many", spy)
    return aborted


def test_cancelling_the_consumer_aborts_every_unfinished_item(engine, tasks, monkeypatch):
    prompts = [fact(tasks, k)["prompt"] for k in range(8)]
    long = GenerationParams(max_tokens=100, ignore_eos=True)
    before = engine.in_flight
    seen_in_flight = []
    aborted = spy_aborts(engine, monkeypatch)

    async def consume(first: asyncio.Event):
        async for _, res in engine.agenerate_many(prompts, long):
            assert not isinstance(res, Exception), res
            first.set()

    async def run():
        first = asyncio.Event()
        task = asyncio.create_task(consume(first))
        for _ in range(400):  # until the engine has them all
            await asyncio.sleep(0.01)
            if engine.in_flight >= before + len(prompts):
                break
        seen_in_flight.append(engine.in_flight)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return first.is_set()

    finished = asyncio.run(run())
    assert not finished, "the 100-token generations finished before the cancel; the test proves nothing"
    assert seen_in_flight[0] >= before + len(prompts)
    assert len(aborted) == 1 and len(aborted[0]) == len(prompts)
    wait_idle(engine, before)


def test_leaving_the_iterator_early_aborts_the_rest(engine, tasks, monkeypatch):
    prompts = [fact(tasks, k)["prompt"] for k in range(6)]
    # item 0 finishes after one token; the others would run for 100 (the bundled model's context is 128)
    params = [GenerationParams(max_tokens=1)] + [GenerationParams(max_tokens=100, ignore_eos=True)] * 5
    before = engine.in_flight
    aborted = spy_aborts(engine, monkeypatch)

    async def run():
        got = []
        async with contextlib.aclosing(engine.agenerate_many(prompts, params)) as it:
            async for i, res in it:
                got.append((i, res))
                break
        return got

    got = asyncio.run(run())
    assert [i for i, _ in got] == [0] and not isinstance(got[0][1], Exception) and len(got[0][1].token_ids) == 1
    assert len(aborted) == 1 and len(aborted[0]) == 5  # the five unfinished items, in one command
    wait_idle(engine, before, timeout=10.0)


def test_per_item_params_count_is_checked(engine):
    async def run():
        return await collect(engine, ["a b", "c d"], [ONE], None)

    with pytest.raises(SpecError) as e:
        asyncio.run(run())
    assert e.value.field == "params"


def test_batch_sink_wakes_the_caller_once_per_burst():
    """Items posted from another thread in one burst come back from one `get` (one wake-up)."""
    wakes = []

    async def run():
        loop = asyncio.get_running_loop()
        sink = BatchSink(loop)
        orig = loop.call_soon_threadsafe

        def counting(cb, *args):
            wakes.append(cb)
            return orig(cb, *args)

        loop.call_soon_threadsafe = counting
        members = [sink.member(i, lambda out, res: out) for i in range(50)]
        t = threading.Thread(target=lambda: [m.on_output(f"d{i}") for i, m in enumerate(members)])
        t.start()
        t.join()
        first = await sink.get()
        await asyncio.sleep(0.01)  # the pending wake-up runs
        members[7].on_error(ValueError("x"))
        second = await sink.get()
        return first, second

    first, second = asyncio.run(run())
    assert first == [(i, f"d{i}") for i in range(50)]
    assert len(second) == 1 and second[0][0] == 7 and isinstance(second[0][1], ValueError)
    assert len(wakes) == 2
