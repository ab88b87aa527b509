"""A multiprocess engine (vLLM's engine core in its own process, as on every GPU) hands a batch of
requests to the core in one `cb_add_requests` message (`seam.add_requests_batched`): the same
outputs as one ADD message per request, and a batch the core does not take fails its requests
with that error while the engine keeps serving. Control calls to the workers (`Engine._rpc`) are
sent the same way, without the loop thread waiting for their replies."""

from __future__ import annotations

import time

import pytest

from engine_ext import GenerationParams
from engine_ext.specs import Interventions, Patch, RunSource
from tests.conftest import model_path

pytestmark = pytest.mark.engine

PROMPTS = ["The capital of France is", "One two three four five six", "A batch in one message", "Seven eight"]


@pytest.fixture(scope="module")
def mp_engine():
    from engine_ext import Engine

    eng = Engine(model=str(model_path()), device="cpu", multiprocess=True).start()
    yield eng
    eng.close()


def _run(eng, batched: bool):
    eng._loop._batch_adds = batched
    try:
        plain = eng.generate(PROMPTS, GenerationParams(max_tokens=4), Interventions(score_token_ids=(5, 9)))
        eng.capture(PROMPTS[0], ["L1.post_block"], "all_prompt", keep_as="batched-clean", return_values=False)
        cells = [Interventions(patch=(Patch.make("L1.post_block", [p], RunSource("batched-clean", (p,))),),
                               score_token_ids=(5, 9)) for p in range(3)]
        patched = eng.generate([PROMPTS[0]] * len(cells), GenerationParams(max_tokens=1), cells)
    finally:
        eng._loop._batch_adds = True
    return plain, patched


def test_a_batch_in_one_message_gives_what_one_message_per_request_gives(mp_engine, engine):
    assert mp_engine._loop._batch_adds, "the engine core answers cb_add_requests"
    assert not engine._loop._batch_adds, "an in-process engine adds requests directly"
    assert mp_engine._loop._wakeable and not engine._loop._wakeable, "only a waiting SyncMPClient is woken"
    for (plain_a, patched_a), (plain_b, patched_b) in [(_run(mp_engine, True), _run(mp_engine, False))]:
        assert [g.token_ids for g in plain_a] == [g.token_ids for g in plain_b]
        assert [g.scores for g in plain_a] == [g.scores for g in plain_b]
        assert [g.scores for g in patched_a] == [g.scores for g in patched_b]
        assert all(g.intervention.status == "ok" for g in patched_a + patched_b)
    # and what the in-process engine computes
    want = engine.generate(PROMPTS, GenerationParams(max_tokens=4), Interventions(score_token_ids=(5, 9)))
    assert [g.token_ids for g in plain_a] == [g.token_ids for g in want]


@pytest.mark.timeout(240)  # a batch nobody fails would leave generate waiting
def test_a_batch_the_core_refuses_fails_its_requests_and_the_engine_serves_on(mp_engine, monkeypatch):
    from engine_ext.worker import seam

    monkeypatch.setattr(seam, "ADD_REQUESTS_UTILITY", "cb_no_such_utility")  # the core answers with a failure
    with pytest.raises(RuntimeError, match="did not add the request"):
        mp_engine.generate(PROMPTS, GenerationParams(max_tokens=2))
    assert mp_engine._loop.in_flight == 0
    monkeypatch.undo()
    gens = mp_engine.generate(PROMPTS, GenerationParams(max_tokens=2))
    assert all(len(g.token_ids) == 2 for g in gens)
    assert not mp_engine._loop.engine.has_unfinished_requests(), "the refused requests left vLLM's client state"


def test_a_large_batch_goes_in_several_messages_with_the_same_outputs(mp_engine, monkeypatch):
    """A batch larger than the first message (`seam.BATCH_CHUNKS`) leaves in several messages, the
    first as soon as its requests are processed: the outputs equal one message per request."""
    from engine_ext.worker import seam

    sent = []
    start = seam._start_utility

    def counting(core, method, args):
        if method == seam.ADD_REQUESTS_UTILITY and args[0]:
            sent.append(len(args[0]))
        return start(core, method, args)

    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(40)]
    params = GenerationParams(max_tokens=2)
    monkeypatch.setattr(seam, "_start_utility", counting)
    monkeypatch.setattr(seam, "BATCH_CHUNKS", (4, 8, 16))
    chunked = mp_engine.generate(prompts, params, Interventions(score_token_ids=(5, 9)))
    assert sent == [4, 8, 16, 12]
    mp_engine._loop._batch_adds = False
    try:
        single = mp_engine.generate(prompts, params, Interventions(score_token_ids=(5, 9)))
    finally:
        mp_engine._loop._batch_adds = True
    assert [g.token_ids for g in chunked] == [g.token_ids for g in single]
    assert [g.scores for g in chunked] == [g.scores for g in single]


@pytest.mark.timeout(240)
def test_a_refused_message_fails_only_its_own_requests(mp_engine, monkeypatch):
    """The core refuses the second message of a batch: its requests fail with the error, those of
    the other messages finish, and the engine serves on."""
    from engine_ext.worker import seam

    calls = []
    start = seam._start_utility

    def second_refused(core, method, args):
        if method == seam.ADD_REQUESTS_UTILITY and args[0]:
            calls.append(len(args[0]))
            if len(calls) == 2:
                return start(core, "cb_no_such_utility", args)
        return start(core, method, args)

    monkeypatch.setattr(seam, "_start_utility", second_refused)
    monkeypatch.setattr(seam, "BATCH_CHUNKS", (2, 3))
    import asyncio

    async def run():
        out = {}
        async for i, res in mp_engine.agenerate_many(PROMPTS * 2, GenerationParams(max_tokens=2)):
            out[i] = res
        return out

    results = asyncio.run(run())
    assert calls == [2, 3, 3]
    failed = sorted(i for i, r in results.items() if isinstance(r, Exception))
    assert failed == [2, 3, 4], results
    assert all("did not add the request" in str(results[i]) for i in failed)
    assert all(len(results[i].token_ids) == 2 for i in results if i not in failed)
    assert mp_engine._loop.in_flight == 0
    monkeypatch.undo()
    assert len(mp_engine.generate(PROMPTS[0], GenerationParams(max_tokens=2)).token_ids) == 2
    assert not mp_engine._loop.engine.has_unfinished_requests()


@pytest.mark.timeout(240)
def test_single_requests_queued_together_reach_the_core_as_one_batch(mp_engine, monkeypatch):
    """`EngineLoop.submit` (one request: each HTTP completion) queued while the loop thread is
    busy: the loop thread gathers them into one `add_requests_batched` call when it drains its
    commands; outputs as the batch's own."""
    import asyncio
    import threading

    from engine_ext.worker import seam

    calls: list[int] = []
    batched = seam.add_requests_batched
    monkeypatch.setattr(seam, "add_requests_batched", lambda engine, items, **kw: (calls.append(len(items)), batched(engine, items, **kw))[1])
    params = GenerationParams(max_tokens=4)
    want = mp_engine.generate(PROMPTS, params)
    calls.clear()
    gate, busy = threading.Event(), threading.Event()
    mp_engine._loop._queue(lambda: (busy.set(), gate.wait(30)))  # the loop thread busy meanwhile

    async def singles():
        tasks = [asyncio.create_task(mp_engine.agenerate(p, params)) for p in PROMPTS]
        await asyncio.sleep(0.2)  # every task has prepared and queued its request
        gate.set()
        return await asyncio.gather(*tasks)

    assert busy.wait(30)
    got = asyncio.run(singles())
    assert calls == [len(PROMPTS)], calls
    assert [g.token_ids for g in got] == [g.token_ids for g in want]


def test_a_control_call_in_flight_leaves_the_loop_thread_free(mp_engine, monkeypatch):
    """While a worker call's reply is outstanding (held back here), the engine loop's thread
    serves other calls and requests; the held call then returns its reply."""
    import threading
    from concurrent.futures import Future

    from engine_ext.worker import seam

    sent, release = threading.Event(), threading.Event()
    real = seam._start_utility

    def held(core, method, args):
        fut = real(core, method, args)
        if method != "collective_rpc" or args[0] != "cb_status":
            return fut
        out: Future = Future()
        fut.add_done_callback(lambda f: threading.Thread(target=lambda: (release.wait(30), out.set_result(f.result()))).start())
        sent.set()
        return out

    monkeypatch.setattr(seam, "_start_utility", held)
    replies: list = []
    caller = threading.Thread(target=lambda: replies.append(mp_engine.intervention_status()))
    caller.start()
    try:
        assert sent.wait(30), "the status call was not sent"
        assert mp_engine._loop.call(lambda e: 42).result(timeout=30) == 42, "the loop thread waited for the reply"
        gens = mp_engine.generate(PROMPTS[:2], GenerationParams(max_tokens=2))
        assert all(len(g.token_ids) == 2 for g in gens) and not replies
    finally:
        release.set()
        caller.join(30)
    assert replies and replies[0]["determinism"]["consistent"] is True


def test_an_async_control_call_is_queued_at_once_and_gives_the_sync_reply(mp_engine, monkeypatch):
    """`aintervention_status` (`Engine._arpc`) queues its worker call before the coroutine first
    yields, so a caller that then holds its event loop busy does not delay the call; its reply is
    the synchronous call's."""
    import asyncio

    from engine_ext.worker import seam

    sent: list[str] = []
    real = seam._start_utility
    monkeypatch.setattr(seam, "_start_utility", lambda core, method, args: (sent.append(args[0]), real(core, method, args))[1])
    want = mp_engine.intervention_status()
    sent.clear()

    async def call_then_hog():
        task = asyncio.ensure_future(mp_engine.aintervention_status())
        await asyncio.sleep(0)  # the coroutine's first step: the call is queued for the loop thread
        deadline = time.monotonic() + 5
        while "cb_status" not in sent and time.monotonic() < deadline:
            time.sleep(0.005)  # this event loop stays busy: the call must get out without it
        on_time = "cb_status" in sent
        return on_time, await task

    on_time, got = asyncio.run(call_then_hog())
    assert on_time, "the worker call waited for the caller's event loop"
    assert got["determinism"] == want["determinism"]
    assert [w["action_checksum"] for w in got["workers"]] == [w["action_checksum"] for w in want["workers"]]


def test_handed_over_waits_until_the_requests_before_it_reached_the_core(mp_engine, monkeypatch):
    """`Engine.handed_over` resolves only after the loop thread has sent every request submitted
    before it (held back here behind a busy loop thread)."""
    import asyncio
    import threading

    from engine_ext.worker import seam

    added: list[int] = []
    batched = seam.add_requests_batched
    monkeypatch.setattr(seam, "add_requests_batched", lambda engine, items, **kw: (added.append(len(items)), batched(engine, items, **kw))[1])
    gate, busy = threading.Event(), threading.Event()
    mp_engine._loop._queue(lambda: (busy.set(), gate.wait(30)))
    assert busy.wait(30)

    async def submit_then_wait():
        tasks = [asyncio.create_task(mp_engine.agenerate(p, GenerationParams(max_tokens=2))) for p in PROMPTS[:2]]
        await asyncio.sleep(0)  # both prepared and queued
        waiter = asyncio.ensure_future(mp_engine.handed_over())
        await asyncio.sleep(0.2)
        early = waiter.done()
        gate.set()
        await waiter
        sent_when_done = sum(added)
        await asyncio.gather(*tasks)
        return early, sent_when_done

    early, sent_when_done = asyncio.run(submit_then_wait())
    assert not early, "handed_over returned while the loop thread had not sent the requests"
    assert sent_when_done == 2, added
