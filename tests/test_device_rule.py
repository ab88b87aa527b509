"""Fast tier: the policies' decision rule as tensor operations (`engine_ext/dynamic/device_rule.py`)
equals `PolicyState.decide` bit for bit, state and returned scale, on every step of random and
adversarial score sequences (NaN, infinities, signed zeros, scores exactly at the thresholds,
fp32-rounded scores), for threshold policies of every latch and hold and for proportional
control, many instances updated at once."""

from __future__ import annotations

import math
import random

import numpy as np
import torch

from engine_ext.dynamic.device_rule import PolicyTable
from engine_ext.dynamic.policy import PolicyState
from engine_ext.dynamic.specs import Policy

H = 8


def _policies(rng: random.Random, n: int) -> list[Policy]:
    out = []
    v = np.ones(H, np.float32)
    for _ in range(n):
        if rng.random() < 0.6:
            on = rng.choice([0.0, 0.5, -1.0, 0.1, rng.uniform(-2, 2)])
            off = rng.choice([None, on, on - abs(rng.uniform(0, 2))])
            out.append(Policy.make(probe="p", sites=["L1.post_attn"], vector=v, on=on, off=off,
                                   min_hold=rng.choice([0, 1, 3]), scale=rng.choice([1.0, 0.25, -2.0]),
                                   latch=rng.choice(["none", "request", "conversation"])))
        else:
            lo = rng.uniform(-3, 0)
            out.append(Policy.make(probe="p", sites=["L1.post_attn"], vector=v, mode="proportional",
                                   target=rng.uniform(-1, 1), gain=rng.choice([0.1, 0.5, 1.0 / 3.0, 2.0]),
                                   min_scale=lo, max_scale=lo + rng.uniform(0.5, 4),
                                   initial_scale=rng.uniform(lo, lo + 0.5)))
    return out


def _score(rng: random.Random, pol: Policy) -> float:
    special = [math.nan, math.inf, -math.inf, 0.0, -0.0, pol.on, pol.release_at, pol.target,
               float(np.float32(pol.on)), float(np.nextafter(np.float32(pol.on), np.float32(-np.inf)))]
    if rng.random() < 0.2:
        return rng.choice(special)
    return float(np.float32(rng.gauss(0.0, 1.5)))  # the probe's scores are fp32


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1.0, a) == math.copysign(1.0, b))


def test_the_tensor_rule_equals_policy_state_bit_for_bit():
    rng = random.Random(7)
    pols = _policies(rng, 64)
    ref = [PolicyState.start(p, latched=rng.random() < 0.1) for p in pols]
    table = PolicyTable(80)
    slots = list(range(3, 3 + len(pols)))  # not starting at 0: slots index the table
    for s, st in zip(slots, ref):
        table.load(s, st)
    for step in range(200):
        active = [i for i in range(len(pols)) if rng.random() < 0.8]  # requests not scheduled this step
        scores = [_score(rng, pols[i]) for i in active]
        got = table.decide(torch.tensor([slots[i] for i in active]), torch.tensor(scores, dtype=torch.float64))
        for k, i in enumerate(active):
            want = ref[i].decide(scores[k])
            assert _same(float(got[k]), want), (step, i, pols[i].mode, scores[k], float(got[k]), want)
        for i, st in enumerate(ref):
            e, h, la, sc = table.state(slots[i])
            assert (e, h, la) == (st.engaged, st.held, st.latched) and _same(sc, st.scale), (step, i)


def test_fp32_scores_give_the_same_decisions_as_their_float64_values():
    """The probe's scores arrive as fp32: deciding on the fp32 tensor equals deciding on the same
    values as Python floats (thresholds that are not fp32 values included)."""
    pol = Policy.make(probe="p", sites=["L1.post_attn"], vector=np.ones(H, np.float32), on=0.1, off=0.1)
    below = float(np.nextafter(np.float32(0.1), np.float32(-1)))
    for x in (float(np.float32(0.1)), below):
        st, table = PolicyState.start(pol), PolicyTable(1)
        table.load(0, st)
        got = table.decide(torch.tensor([0]), torch.tensor([x], dtype=torch.float32))
        assert float(got[0]) == st.decide(x)
