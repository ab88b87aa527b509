"""Fast tier (no engine): the GPU's path of the planner — host tables uploaded to the op's tables,
an unchanged table not sent again, and a steady decode step whose tables the device holds already
writing, comparing and sending nothing (`StepPlanner._held`) — simulated on the CPU: the op's
tables stay CPU tensors, but the planner keeps its own host tables and uploads them as it does to a
GPU. After every step of `test_steady_plan`'s scripts (requests joining and leaving, a prefill
among decode steps, the global steering recomposing every plan, an injected fault, a new order),
plus a capture among the steps, the op's tables and the checksum equal planning request by
request with every table sent."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_ext.dynamic.specs import DYNAMIC_ARGS_KEY, DynamicRequest, Policy, Probe
from engine_ext.program import PromptInfo, compile_program, program_to_extra_args
from engine_ext.specs import Capture, Interventions, canonical_json
from engine_ext.worker import planner as planner_mod
from tests.test_steady_plan import DIMS, H, PROMPT, _register, _script, _script_templates_only, _spec, _state
from tests.test_steady_plan import _play as play  # the scripts' player


class _Done:
    def synchronize(self) -> None:
        pass


def _as_device(st) -> None:
    """Make `st`'s planner take the GPU's path: its own host tables, staged uploads into the
    op's tables (CPU tensors here), the upload of an unchanged table skipped."""
    pl = st.planner
    shape = (pl.b.max_rows, pl.b.num_sites)
    pl.on_host = False
    pl.hs = np.full(shape, -1, np.int32)
    pl.hc = np.full(shape, -1, np.int32)
    pl._stage = [(torch.empty(shape, dtype=torch.int32), torch.empty(shape, dtype=torch.int32), _Done())
                 for _ in range(3)]
    pl._sent_s = np.full(shape, -1, np.int32)
    pl._sent_c = np.full(shape, -1, np.int32)
    pl._sent_rows = pl._sent_cap_rows = 0


@pytest.fixture(autouse=True)
def _no_cuda_events(monkeypatch):
    monkeypatch.setattr(planner_mod.cuda_streams, "record", lambda *a, **k: None)


def _with_capture(script: list) -> list:
    """`script` with a capturing request joining after its fourth decode step and leaving after
    two more steps (its capture rows and the clearing of the capture table after them)."""
    out, decodes, ids = [], 0, None
    for ev in script:
        out.append(ev)
        if ev[0] == "step" and all(n == 1 for n in ev[2]):
            decodes += 1
            if decodes == 4:
                ids, pos = list(ev[1]), [p + 1 for p in ev[3]]
                out.append(("register", "cap", Interventions(capture=Capture.make(["L1.post_block", "L2.pre_attn"],
                                                                                  "last_prompt"))))
                out.append(("step", ids + ["cap"], [1] * len(ids) + [PROMPT], pos + [0]))
                out.append(("step", ids + ["cap"], [1] * (len(ids) + 1), [p + 1 for p in pos] + [PROMPT]))
                out.append(("finish", "cap"))  # the script's next step visits its positions again
    return out


def _snapshot(st, rows: int) -> tuple:
    """The op's tables (every row of the row table: stale entries past this step's rows are never
    read, but the planner keeps them cleared all the same), and the checksum."""
    b = st.buffers
    return b.row_slot.numpy().copy(), b.cap_dst.numpy()[:rows].copy(), st.checksum.value, st.checksum.count


def _play(device: bool, fast: bool, script: list, skip: bool | None = None) -> tuple[list, object]:
    st = _state(fast)
    st.planner.skip_same_upload = fast if skip is None else skip
    if device:
        _as_device(st)
    return play(st, script, _snapshot), st


@pytest.mark.parametrize("script", [_script, _script_templates_only], ids=["mixed", "templates-only"])
@pytest.mark.parametrize("capture", [False, True], ids=["", "capture"])
def test_the_device_path_sends_exactly_what_request_by_request_planning_sends(script, capture):
    sc = _with_capture(script()) if capture else script()
    slow, _ = _play(device=True, fast=False, script=sc)
    fast, st = _play(device=True, fast=True, script=sc)
    host, _ = _play(device=False, fast=True, script=sc)
    assert len(slow) == len(fast) == len(host)
    for k, (a, b, c) in enumerate(zip(slow, fast, host)):
        assert np.array_equal(a[0], b[0]), f"step {k}: the device's row tables differ"
        assert np.array_equal(a[1], b[1]), f"step {k}: the device's capture tables differ"
        assert a[2:] == b[2:], f"step {k}: checksums differ"
        assert np.array_equal(a[0], c[0]) and a[2:] == c[2:], f"step {k}: the CPU engine's path differs"
    pl = st.planner
    assert pl.steady_steps > 0 and pl.uploads_skipped > 0
    # with the upload skip switched off (`cb_set_upload_skip`), every steady step is sent again
    sent, st_sent = _play(device=True, fast=True, script=sc, skip=False)
    assert all(np.array_equal(a[0], b[0]) and a[2:] == b[2:] for a, b in zip(slow, sent))
    assert st_sent.planner.uploads_skipped == 0 and st_sent.planner.held_steps == 0
    assert st_sent.planner.steady_steps == pl.steady_steps


def test_a_held_steady_plan_sends_nothing_until_something_changes(monkeypatch):
    sc = _script_templates_only()
    fast, st = _play(device=True, fast=True, script=sc)
    pl = st.planner
    assert pl._held is pl._steady is not None  # the last steps repeated a plan the device holds
    sent = []
    monkeypatch.setattr(pl, "_upload", lambda *a: sent.append(a))
    ids = [f"t{i}" for i in range(6)]
    pos = np.full(6, PROMPT + 8, np.int32)
    before = (pl.steady_steps, st.checksum.count)
    st.plan_step(ids, np.arange(7, dtype=np.int32), pos)
    assert sent == [] and pl.steady_steps == before[0] + 1 and st.checksum.count == before[1] + 5
    # a prompt token in a one-row window is not a decode row: planned request by request (and sent)
    st.plan_step(ids, np.arange(7, dtype=np.int32), np.asarray([PROMPT - 1] + [PROMPT + 9] * 5, np.int32))
    assert len(sent) == 1 and pl._held is None


def _dynamic_extra(rid: str) -> dict:
    """A request with one threshold policy (and no static steering): its steps carry dynamic
    entries (`extra`), which a held plan's repeat never skips."""
    prog = compile_program(Interventions(), PromptInfo(list(range(PROMPT)), None, None, 64), DIMS,
                           key=f"k-{rid}", named_vector_dims=lambda n: None)
    extra = program_to_extra_args(prog)
    pol = Policy.make(probe="p", sites=["L1.post_attn"], vector=np.linspace(-0.2, 0.2, H).astype(np.float32), on=-1.0)
    extra[DYNAMIC_ARGS_KEY] = canonical_json(DynamicRequest.make([pol]).wire(()))
    return extra


def _play_dynamic(fast: bool) -> tuple[list, object]:
    """Static steady requests with a dynamic request beside them that leaves (the static ones
    then repeat a held plan), then another that joins and leaves."""
    st = _state(fast)
    st.planner.skip_same_upload = fast
    _as_device(st)
    st.dynamic.set_probe(Probe.make("p", "L2.post_block", direction=np.ones(H, np.float32)).to_json())
    nc: dict[str, int] = {}
    for rid, kind in (("s0", 1), ("s1", 2), ("s2", 1)):
        _register(st, rid, _spec(kind))
        nc[rid] = 0
    st.register("d0", _dynamic_extra("d0"))
    nc["d0"] = 0
    seen = []
    for step in range(24):
        if step == 6:
            st.finish("d0")
            del nc["d0"]
        if step == 13:
            st.register("d1", _dynamic_extra("d1"))
            nc["d1"] = 0
        if step == 19:
            st.finish("d1")
            del nc["d1"]
        rids = list(nc)
        lens = [PROMPT if nc[r] == 0 else 1 for r in rids]
        qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        if st.plan_step(rids, qsl, np.asarray([nc[r] for r in rids], np.int32)):
            st.finish_step()
        st.after_forward()
        seen.append((st.buffers.row_slot.numpy().copy(), st.checksum.value, st.checksum.count))
        for r, n in zip(rids, lens):
            nc[r] += n
    return seen, st


def test_a_held_plan_gives_way_to_dynamic_entries_and_comes_back():
    slow, _ = _play_dynamic(fast=False)
    fast, st = _play_dynamic(fast=True)
    for k, (a, b) in enumerate(zip(slow, fast)):
        assert np.array_equal(a[0], b[0]), f"step {k}: the device's row tables differ"
        assert a[1:] == b[1:], f"step {k}: checksums differ"
    # held while only the static requests ran (steps 8-12 and 21-23: the first step after a
    # change plans request by request, the next builds the plan the device then holds)
    assert st.planner.held_steps >= 6
