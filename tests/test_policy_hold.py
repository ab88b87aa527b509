"""Fast tier: a threshold policy's `holds` / `hold` (the decision the worker's plan takes ahead of
its score and checks after it) agree exactly with `decide` on every state and score: where
`holds(score)`, `decide(score)` leaves the same state and scale as `hold()`; elsewhere the policy
flips."""

from __future__ import annotations

import copy
import itertools

import numpy as np

from engine_ext.dynamic.policy import PolicyState
from engine_ext.dynamic.specs import Policy

V = np.ones(4, np.float32)


def _states():
    for on, off, min_hold, latch in itertools.product((0.5,), (0.5, -0.25), (0, 1, 3), ("none", "request", "conversation")):
        pol = Policy.make(probe="p", sites=["L0.post_block"], vector=V, on=on, off=off, min_hold=min_hold, latch=latch,
                          scale=2.0)
        for engaged, held, latched in itertools.product((False, True), (0, 1, 2, 5), (False, True)):
            if not engaged and (held or latched):
                continue
            st = PolicyState.start(pol)
            st.engaged, st.held, st.latched = engaged, held, latched
            yield st


def _fields(st: PolicyState) -> tuple:
    return st.engaged, st.held, st.scale, st.latched


SCORES = [float("-inf"), -1.0, -0.25, -0.2500001, 0.0, 0.4999999, 0.5, 0.5000001, 1.0, float("inf"), float("nan")]


def test_hold_is_decide_inside_the_interval_and_decide_flips_outside():
    n_in = n_out = 0
    for st in _states():
        for score in SCORES:
            a, b = copy.deepcopy(st), copy.deepcopy(st)
            before = _fields(st)
            holds = st.holds(score)
            assert _fields(st) == before  # asking changes nothing
            got = a.decide(score)
            if holds:
                n_in += 1
                assert (b.hold(), _fields(b)) == (got, _fields(a)), (_fields(st), score)
            else:
                n_out += 1
                assert a.engaged != st.engaged, (_fields(st), score)
    assert n_in > 50 and n_out > 50


def test_proportional_control_never_holds():
    pol = Policy.make(probe="p", mode="proportional", sites=["L0.post_block"], vector=V, target=0.0, gain=0.1)
    assert not PolicyState.start(pol).holds(0.0)
