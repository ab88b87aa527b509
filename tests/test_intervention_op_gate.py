"""The intervention op's row gate (the reference fork's `this_token` probe gate, see
`engine_ext/worker/intervention_op.py`) against a hand computation, on CPU: the torch path and the
branch-free torch path the CUDA build falls back to (run here on CPU tensors), at a pair site
(`x + r`, written back as the two-term split) and a single-tensor site (`x`).

Hand rule, per gated row: `s` = the row's value before the edit (fp32), `score = s . probe`,
`g = 1 / (1 + exp(-(sharpness * (score - threshold))))`, `new = a * s + c + (g - 1) * term`; the
op records `(score, g)` in `gate_out[row]`. Tolerance: the hand computation runs in float64, the op
in float32 (1e-5 relative on values of order 10).
"""

from __future__ import annotations

import numpy as np
import torch

from engine_ext.worker import intervention_op as op
from engine_ext.worker.intervention_op import SiteBuffers, SlotMode
from engine_ext.worker.slots import SlotTable, SlotValue

H, ROWS = 16, 5


def _gated(value: SlotValue, probe, thr: float, sharp: float, term) -> SlotValue:
    import dataclasses

    key = ("gate", probe.tobytes(), thr, sharp, term.tobytes())
    return dataclasses.replace(value, gate_probe=probe, gate_threshold=thr, gate_sharpness=sharp, gate_term=term,
                               gate_key=key)


def _hand(s: np.ndarray, a: float, c: np.ndarray, probe, thr, sharp, term) -> tuple[np.ndarray, float, float]:
    s = s.astype(np.float64)
    score = float(s @ probe.astype(np.float64))
    g = 1.0 / (1.0 + np.exp(-(sharp * (score - thr))))
    return a * s + c + (g - 1.0) * term, score, g


def _setup():
    rng = np.random.default_rng(3)
    b = SiteBuffers(num_sites=2, max_rows=ROWS, max_slots=8, max_capture_rows=4, hidden=H,
                    device=torch.device("cpu"), dtype=torch.float32, max_gate_rows=2)
    slots = SlotTable(b)
    probe = (rng.standard_normal(H) / 4).astype(np.float32)
    term = rng.standard_normal(H).astype(np.float32) * 3
    c = (term + rng.standard_normal(H).astype(np.float32)).astype(np.float32)  # the term plus an ungated part
    return rng, b, slots, probe, term, c


def test_row_gate_matches_the_hand_rule_at_pair_and_single_tensor_sites():
    rng, b, slots, probe, term, c = _setup()
    x = torch.from_numpy(rng.standard_normal((ROWS, H)).astype(np.float32))
    r = torch.from_numpy(rng.standard_normal((ROWS, H)).astype(np.float32))
    s = (x + r).numpy()
    scores = s @ probe
    thr, sharp = float(np.median(scores)), 2.0
    gated = slots.acquire("g", lambda: _gated(SlotValue(SlotMode.AFFINE, a=1.0, c=c), probe, thr, sharp, term))
    half = slots.acquire("g-half", lambda: _gated(SlotValue(SlotMode.AFFINE, a=0.5, c=c), probe, thr, sharp, term))
    plain = slots.acquire("plain", lambda: SlotValue(SlotMode.AFFINE, a=1.0, c=c))
    # the two gated slots share one gate row (content-addressed); the plain slot has none
    assert slots._gate_of_slot[gated] == slots._gate_of_slot[half] >= 0 and slots._gate_of_slot[plain] == -1
    slots.flush()
    b.row_slot[:ROWS, 0] = torch.tensor([gated, -1, plain, half, gated], dtype=torch.int32)
    b.row_slot[:ROWS, 1] = torch.tensor([half, gated, -1, -1, plain], dtype=torch.int32)
    b.active[:] = [True, True]
    for apply in (op._apply_torch, op._apply_torch_cuda):
        b.gate_out.fill_(-7.0)
        # pair site 0: s = x + r
        xx, rr = x.clone(), r.clone()
        apply(b, xx, rr, 0)
        got = (xx.double() + rr.double()).numpy()
        for row, (a, gate) in enumerate([(1.0, True), (None, None), (1.0, False), (0.5, True), (1.0, True)]):
            if a is None:
                assert torch.equal(xx[row], x[row]) and torch.equal(rr[row], r[row])  # no slot: bit-identical
                assert b.gate_out[row].tolist() == [-7.0, -7.0]
                continue
            want, score, g = _hand(s[row], a, c, probe, thr, sharp, term if gate else np.zeros(H))
            if not gate:
                want = a * s[row].astype(np.float64) + c
                assert b.gate_out[row].tolist() == [-7.0, -7.0]
            else:
                assert np.allclose(b.gate_out[row].numpy(), [score, g], rtol=1e-5, atol=1e-6), (apply, row)
            assert np.allclose(got[row], want, rtol=1e-5, atol=1e-5), (apply, row)
        assert 0.0 < float(b.gate_out[0, 1]) < 1.0 or 0.0 < float(b.gate_out[3, 1]) < 1.0  # a soft gate somewhere
        # single-tensor site 1: s = x, written back as x
        b.gate_out.fill_(-7.0)
        xs = x.clone()
        apply(b, xs, None, 1)
        sx = x.numpy()
        for row, (a, gate) in enumerate([(0.5, True), (1.0, True), (None, None), (None, None), (1.0, False)]):
            if a is None:
                assert torch.equal(xs[row], x[row])
                continue
            want, score, g = _hand(sx[row], a, c, probe, thr, sharp, term if gate else np.zeros(H))
            if gate:
                assert np.allclose(b.gate_out[row].numpy(), [score, g], rtol=1e-5, atol=1e-6), (apply, row)
            assert np.allclose(xs[row].double().numpy(), want, rtol=1e-5, atol=1e-5), (apply, row)
    slots.release([gated, half, plain])
    assert len(slots._gates.free) == 2 and not slots._gates.by_key


def test_a_saturated_gate_leaves_the_ungated_value_and_a_closed_one_removes_the_term():
    rng, b, slots, probe, term, c = _setup()
    x = torch.from_numpy(rng.standard_normal((ROWS, H)).astype(np.float32))
    r = torch.from_numpy(rng.standard_normal((ROWS, H)).astype(np.float32))
    open_ = slots.acquire("open", lambda: _gated(SlotValue(SlotMode.AFFINE, a=1.0, c=c), probe, -1e30, 1.0, term))
    shut = slots.acquire("shut", lambda: _gated(SlotValue(SlotMode.AFFINE, a=1.0, c=c), probe, 1e30, 1.0, term))
    plain = slots.acquire("plain", lambda: SlotValue(SlotMode.AFFINE, a=1.0, c=c))
    slots.flush()
    b.row_slot[:ROWS, 0] = torch.tensor([open_, shut, plain, -1, -1], dtype=torch.int32)
    b.active[:] = [True, False]
    for apply in (op._apply_torch, op._apply_torch_cuda):
        xx, rr = x.clone(), r.clone()
        apply(b, xx, rr, 0)
        assert b.gate_out[0, 1] == 1.0 and b.gate_out[1, 1] == 0.0
        # g == 1: bit-identical to the same slot without a gate
        assert torch.equal(xx[0] + rr[0], (x[0] + r[0]) + torch.from_numpy(c))
        assert torch.equal(xx[2] + rr[2], (x[2] + r[2]) + torch.from_numpy(c))
        # g == 0: the gated term is gone (c - term left, to fp32 rounding)
        want = (x[1] + r[1]).double().numpy() + (c.astype(np.float64) - term)
        assert np.allclose((xx[1].double() + rr[1].double()).numpy(), want, atol=1e-5)
