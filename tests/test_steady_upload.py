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

from engine_ext.specs import Capture, Interventions
from engine_ext.worker import planner as planner_mod
from tests.test_steady_plan import PROMPT, _register, _script, _script_templates_only, _state


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


def _play(device: bool, fast: bool, script: list, skip: bool | None = None) -> tuple[list, object]:
    st = _state(fast)
    st.planner.skip_same_upload = fast if skip is None else skip
    if device:
        _as_device(st)
    seen = []
    for ev in script:
        if ev[0] == "register":
            _register(st, ev[1], ev[2])
        elif ev[0] == "finish":
            st.finish(ev[1])
        elif ev[0] == "global":
            st.set_global_steer([{"site": 5, "vec": np.ones(16, np.float32).tobytes(), "scale": ev[1], "gen": True}])
        elif ev[0] == "fault":
            st.planner.skip_next_action = True
        else:
            _, rids, rows, computed = ev
            qsl = np.concatenate([[0], np.cumsum(rows)]).astype(np.int32)
            st.plan_step(list(rids), qsl, np.asarray(computed, np.int32))
            st.after_forward()
            n = int(qsl[-1])
            b = st.buffers
            # the op's tables: every row (stale entries past this step's rows are never read, but
            # the planner keeps them cleared all the same)
            seen.append((b.row_slot.numpy().copy(), b.cap_dst.numpy()[:n].copy(), st.checksum.value,
                         st.checksum.count))
    return seen, st


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
