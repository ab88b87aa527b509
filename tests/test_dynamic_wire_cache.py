"""Fast tier (no engine): the worker parses a dynamic wire text once for every request that
brings it (`DynamicWorker._parsed_wire`), and what it shares is only what the text fixes: a named
vector registered again between two requests steers the second with the new vector, a probe
deleted in between voids the second's policy, each request keeps its own policy states, and a
result names its policies by their index in the wire (`policy_index`) when it travels as columns."""

from __future__ import annotations

import numpy as np
import torch

from engine_ext.dynamic.specs import DYNAMIC_ARGS_KEY, DynamicRequest, Policy, Probe
from engine_ext.program import ModelDims, PromptInfo, compile_program, program_to_extra_args
from engine_ext.specs import Interventions, canonical_json
from engine_ext.worker.state import WorkerConfig, WorkerState

L, H, PROMPT = 4, 32, 6


def _state() -> WorkerState:
    st = WorkerState(L, H, 256, torch.device("cpu"), torch.float32, WorkerConfig(max_capture_rows=64))
    st.dynamic.set_probe(Probe.make("p", "L2.post_block", direction=np.ones(H, np.float32)).to_json())
    st.dynamic.set_probe(Probe.make("q", "L2.post_block", direction=-np.ones(H, np.float32)).to_json())
    return st


def _register(st: WorkerState, rid: str, text: str) -> None:
    prog = compile_program(Interventions(), PromptInfo(list(range(PROMPT)), None, None, 64), ModelDims(L, H, 100, 0.02),
                           key=f"k-{rid}", named_vector_dims=lambda n: H)
    extra = program_to_extra_args(prog)
    extra[DYNAMIC_ARGS_KEY] = text
    st.register(rid, extra)


def _wire(*policies: Policy) -> str:
    return canonical_json(DynamicRequest.make(list(policies)).wire(()))


def test_one_parse_per_wire_text_and_shared_policies():
    st = _state()
    text = _wire(Policy.make(probe="p", sites=["L1.post_attn"], vector=np.full(H, 0.5, np.float32), on=0.3, scale=2.0))
    for rid in ("a", "b", "c"):
        _register(st, rid, text)
    a, b, c = (st.dynamic.requests[r] for r in "abc")
    assert len(st.dynamic._wires) == 1
    assert a.policies[0] is b.policies[0] is c.policies[0]  # made once, shared
    assert a.states[0] is not b.states[0]  # each request its own state
    a.states[0].engaged = True
    assert not b.states[0].engaged
    assert st.dynamic.result("a", columns=True)["policy_index"] == [0]
    assert st.dynamic.result("a")["policies"][0]["probe"] == "p"


def test_a_named_vector_registered_again_is_used_by_the_next_request():
    st = _state()
    st.named["v"] = np.full(H, 1.0, np.float32)
    text = _wire(Policy.make(probe="p", sites=["L1.post_attn"], vector_name="v", on=0.3))
    _register(st, "a", text)
    st.named["v"] = np.full(H, 2.0, np.float32)  # `cb_register_vector` stores a new array
    _register(st, "b", text)
    a, b = st.dynamic.requests["a"], st.dynamic.requests["b"]
    assert a.policies[0] is not b.policies[0]
    assert float(a.policies[0].vec[0]) == 1.0 and float(b.policies[0].vec[0]) == 2.0


def test_a_probe_deleted_between_two_requests_voids_the_second_only():
    st = _state()
    vec = np.full(H, 0.5, np.float32)
    text = _wire(Policy.make(probe="p", sites=["L1.post_attn"], vector=vec, on=0.3),
                 Policy.make(probe="q", sites=["L1.post_attn"], vector=vec, on=0.3))
    _register(st, "a", text)
    st.dynamic.delete_probe("p")
    _register(st, "b", text)
    assert len(st.dynamic.requests["a"].policies) == 2
    rb = st.dynamic.result("b", columns=True)
    assert rb["policy_index"] == [1]  # policy 0 left out: its probe is gone
    assert any("probe 'p' is no longer registered" in e for e in st.requests["b"].program.errors)
    assert not st.requests["a"].program.errors
