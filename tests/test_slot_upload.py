"""Fast tier (no engine): what `SlotTable.flush` writes to the device tables, and how a dynamic
action's payload is named (`_Policy.parts`). The tables are read back field by field, so an upload
mistake (a field written to another slot, `a` cast instead of copied, a `c` row missing) fails
here rather than as a wrong activation."""

from __future__ import annotations

import zlib

import numpy as np
import torch

from engine_ext.dynamic.worker import _Policy, payload
from engine_ext.worker.intervention_op import SiteBuffers, SlotMode
from engine_ext.worker.slots import SlotTable, SlotValue

H = 8


def _buffers(max_slots: int = 16) -> SiteBuffers:
    return SiteBuffers(num_sites=2, max_rows=4, max_slots=max_slots, max_capture_rows=4, hidden=H,
                       device=torch.device("cpu"), dtype=torch.float32, max_gate_rows=2, max_clamp_rows=2,
                       max_dim_rows=2)


def test_flush_writes_every_field_of_every_new_slot():
    rng = np.random.default_rng(0)
    b = _buffers()
    slots = SlotTable(b)
    c1 = rng.standard_normal(H).astype(np.float32)
    avec = rng.standard_normal(H).astype(np.float32)
    dirs = np.eye(H, dtype=np.float32)[:2]
    probe, term = rng.standard_normal(H).astype(np.float32), rng.standard_normal(H).astype(np.float32)
    values = {
        "plain": SlotValue(SlotMode.AFFINE, a=0.3125, c=c1),
        "no-c": SlotValue(SlotMode.AFFINE, a=-2.5),
        "masked": SlotValue(SlotMode.AFFINE, a=1.0, c=-c1, a_vec=avec, a_key="m"),
        "clamped": SlotValue(SlotMode.AFFINE, a=1.0, c=2 * c1, clamp_dirs=dirs, clamp_lo=np.zeros(2, np.float32),
                             clamp_hi=np.ones(2, np.float32), clamp_st=np.ones(2, np.float32), clamp_key="k"),
        "gated": SlotValue(SlotMode.AFFINE, a=1.0, c=3 * c1, gate_probe=probe, gate_threshold=0.5,
                           gate_sharpness=4.0, gate_term=term, gate_key="g"),
    }
    got = {name: slots.acquire(name, lambda v=v: v) for name, v in values.items()}
    b.slot_c.fill_(99.0)
    slots.flush()
    for name, v in values.items():
        s = got[name]
        assert int(b.slot_mode[s]) == int(v.mode), name
        assert float(b.slot_a[s]) == np.float32(v.a), name  # the fp32 bits, not an int cast
        want_c = np.zeros(H, np.float32) if v.c is None else v.c
        np.testing.assert_array_equal(b.slot_c[s].numpy(), want_c, err_msg=name)
        assert int(b.slot_adim[s]) == (slots._dim_of_slot[s] if v.a_vec is not None else -1) and \
            (int(b.slot_adim[s]) >= 0) == (v.a_vec is not None), name
        assert (int(b.slot_clamp[s]) >= 0) == (v.clamp_dirs is not None), name
        assert (int(b.slot_gate[s]) >= 0) == (v.gate_probe is not None), name
    np.testing.assert_array_equal(b.dim_a[int(b.slot_adim[got["masked"]])].numpy(), avec)
    np.testing.assert_array_equal(b.gate_probe[int(b.slot_gate[got["gated"]])].numpy(), probe)
    # slots never flushed keep their contents (the c rows of other slots untouched)
    untouched = [s for s in range(b.max_slots) if s not in got.values()]
    assert bool((b.slot_c[untouched] == 99.0).all())


def test_a_dynamic_payload_is_named_by_its_exact_fp32_value():
    rng = np.random.default_rng(1)
    vec = rng.standard_normal(64).astype(np.float32)
    pol = _Policy(None, "p", vec, [3, 5])
    (s1, v1, f1, crc1), (s2, _, f2, crc2) = pol.parts(0.1)
    assert (s1, s2) == (3, 5) and crc1 == crc2 and v1 is vec and f1 == np.float32(0.1)
    # the payload is vec * f32(scale) in fp32 (what the oracle adds)
    np.testing.assert_array_equal(payload(vec, f1), (vec * np.float32(0.1)).astype(np.float32))
    # scales with the same fp32 value: the same payload, the same name
    assert pol.parts(float(np.float32(0.1)))[0][3] == crc1
    # one ulp apart in fp32: another payload, another name
    nxt = float(np.nextafter(np.float32(0.1), np.float32(1.0)))
    assert pol.parts(nxt)[0][3] != crc1
    assert not np.array_equal(payload(vec, np.float32(nxt)), payload(vec, f1))
    # a vector differing in one bit: another name at the same scale
    other = vec.copy()
    other.view(np.int32)[7] ^= 1
    assert _Policy(None, "q", other, [3]).parts(0.1)[0][3] != crc1
    # the name is the crc32 of f32(scale)'s bytes continued from the vector's crc32
    assert crc1 == zlib.crc32(np.float32(0.1).tobytes(), zlib.crc32(vec.tobytes()))
