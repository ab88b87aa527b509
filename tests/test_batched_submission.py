"""A multiprocess engine (vLLM's engine core in its own process, as on every GPU) hands a batch of
requests to the core in one `cb_add_requests` message (`seam.add_requests_batched`): the same
outputs as one ADD message per request, and a batch the core does not take fails its requests
with that error while the engine keeps serving."""

from __future__ import annotations

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
