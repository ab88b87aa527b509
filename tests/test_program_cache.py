"""Fast tier (no engine): the worker parses one template's program texts once
(`program.ProgramCache`): a request whose text differs from an earlier one only in its key gets
a copy of that parse with its own key and errors, equal to parsing its text afresh; a parse that
read the worker's state (a named vector, a stored run) is never reused, so a vector registered
again or a run stored since is what the next request gets."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine_ext.program import (EXTRA_ARGS_KEY, TEMPLATE_KEY, ModelDims, ProgramCache, ProgramTemplate, PromptInfo,
                                WorkerProgram, compile_program, key_split)
from engine_ext.specs import Capture, Interventions, Patch, Steer

L, H = 4, 8
DIMS = ModelDims(L, H, 100, 0.02)
V = np.linspace(-1.0, 1.0, H).astype(np.float32)


def _texts(spec: Interventions, keys: list[str], named_dims=lambda n: H) -> list[str]:
    prog = compile_program(spec, PromptInfo(list(range(6)), None, None, 16), DIMS, key=TEMPLATE_KEY,
                           named_vector_dims=named_dims)
    tpl = ProgramTemplate(prog)
    return [tpl.extra_args(k)[EXTRA_ARGS_KEY] for k in keys]


def _state(named: dict | None = None, runs: dict | None = None) -> dict:
    named = {} if named is None else named
    runs = {} if runs is None else runs
    return dict(named_vector=named.get, source_value=lambda run, site, pos: runs.get((run, site, pos)),
                source_mean=lambda run, site: None, owns_site=lambda s: True)


def _fields(p: WorkerProgram) -> tuple:
    return (p.key, p.n_prompt, p.max_pos, p.hash, [(a.site, a.pos.tolist(), a.gen, a.phase, a.vec.tobytes(), a.scale) for a in p.adds],
            p.capture_sites, p.capture_pos.tolist(), p.capture_gen, p.errors, sorted(p.sources))


def test_one_parse_per_template_each_request_its_own_key_and_errors():
    spec = Interventions(steer=(Steer.make(["L1.post_block", "L2.post_block"], V, positions="all_generated"),),
                         capture=Capture.make(["L3.post_block"], "last_prompt"))
    texts = _texts(spec, ["cb-1-aa", "cb-2-bb", "cb-3-cc"])
    cache = ProgramCache()
    progs = [cache.parse(t, **_state()) for t in texts]
    assert cache.hits == 2
    for t, p in zip(texts, progs):  # each equals its own text parsed afresh
        assert _fields(p) == _fields(WorkerProgram.parse(json.loads(t), **_state()))
    assert [p.key for p in progs] == ["cb-1-aa", "cb-2-bb", "cb-3-cc"]
    progs[1].errors.append("slot capacity")  # a request's errors are its own
    assert not progs[0].errors and not progs[2].errors and not progs[1].adds[0] is None
    assert cache.parse(texts[0], **_state()).errors == []


def test_a_parse_that_read_a_named_vector_is_not_reused():
    named = {"v": V}
    texts = _texts(Interventions(steer=(Steer.make(["L1.post_block"], name="v"),)), ["k1", "k2"])
    cache = ProgramCache()
    first = cache.parse(texts[0], **_state(named))
    named["v"] = 2 * V  # registered again
    second = cache.parse(texts[1], **_state(named))
    assert cache.hits == 0
    assert np.array_equal(first.adds[0].vec, V) and np.array_equal(second.adds[0].vec, 2 * V)


def test_a_parse_that_read_a_stored_run_is_not_reused():
    texts = _texts(Interventions(patch=(Patch.make("L1.post_block", [2], {"run": "clean"}),)), ["k1", "k2"])
    cache = ProgramCache()
    reads = []
    state = {**_state(), "source_value": lambda run, site, pos: reads.append(run) or np.ones(H, np.float32)}
    first, second = (cache.parse(t, **state) for t in texts)
    assert cache.hits == 0 and reads == ["clean", "clean"]  # each request read the store itself
    assert first.sources == second.sources == {"clean"} and second.key == "k2"


@pytest.mark.parametrize("text", ['{"a":{"key":"x"},"key":"y"}', '{"key":"a\\\\"b"}', '{"nokey":1}'])
def test_texts_whose_key_cannot_be_told_apart_are_not_split(text):
    assert key_split(text) is None


def test_key_split_removes_only_the_key():
    assert key_split('{"hash":"h","key":"cb-1-ab","n_prompt":3}') == ('{"hash":"h","key":"","n_prompt":3}', "cb-1-ab")
