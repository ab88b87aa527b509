"""Fast tier (no engine): a steady decode step repeats the last step's plan
(`planner._SteadyDecode`) and gives exactly the tables and checksum of planning it request by
request — through requests joining and leaving, a prefill step among decode steps, the global
steering changing (plans recomposed), a request without a plan, an injected fault and a request
whose plan has more than a generation template."""

from __future__ import annotations

import numpy as np
import torch

from engine_ext.program import ModelDims, PromptInfo, compile_program, program_to_extra_args
from engine_ext.specs import Interventions, Steer
from engine_ext.worker.state import WorkerConfig, WorkerState

L, H, PROMPT = 4, 16, 5
DIMS = ModelDims(L, H, 100, 0.02)


def _vec(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(H).astype(np.float32)


def _state(steady: bool) -> WorkerState:
    st = WorkerState(L, H, 64, torch.device("cpu"), torch.float32, WorkerConfig())
    st.planner.steady_decode = steady
    return st


def _register(st: WorkerState, rid: str, spec: Interventions | None) -> None:
    if spec is None:
        st.register(rid, None)
        return
    prog = compile_program(spec, PromptInfo(list(range(PROMPT)), None, None, 64), DIMS, key=f"k-{rid}",
                           named_vector_dims=lambda n: None)
    st.register(rid, program_to_extra_args(prog))


def _spec(kind: int) -> Interventions | None:
    """Interventions of a request: none (0), one site (1), two sites (2: two templates), or a
    steer at one generated position as well (3: more than a generation template, never repeated)."""
    if kind == 0:
        return None
    if kind == 1:
        return Interventions(steer=(Steer.make(["L1.post_block"], _vec(kind)),))
    if kind == 2:
        return Interventions(steer=(Steer.make(["L0.pre_attn", "L2.post_attn"], _vec(kind), scale=0.5),))
    return Interventions(steer=(Steer.make(["L3.post_block"], _vec(kind), positions=[PROMPT + 6]),))


def _play(st: WorkerState, script: list, snapshot) -> list:
    """Play `script` (steps of ("step", req_ids, rows per request, computed) and events) on `st`;
    returns `snapshot(st, rows)` after every step (rows: the step's row count)."""
    seen = []
    for ev in script:
        if ev[0] == "register":
            _register(st, ev[1], ev[2])
        elif ev[0] == "finish":
            st.finish(ev[1])
        elif ev[0] == "global":
            st.set_global_steer([{"site": 5, "vec": _vec(99).tobytes(), "scale": ev[1], "gen": True}])
        elif ev[0] == "fault":
            st.planner.skip_next_action = True
        else:
            _, rids, rows, computed = ev
            qsl = np.concatenate([[0], np.cumsum(rows)]).astype(np.int32)
            st.plan_step(list(rids), qsl, np.asarray(computed, np.int32))
            st.after_forward()
            seen.append(snapshot(st, int(qsl[-1])))
    return seen


def _run(steady: bool, script: list) -> tuple[list, WorkerState]:
    """`_play` on a fresh worker: per step the row table, the checksum and the action count."""
    st = _state(steady)
    return _play(st, script, lambda st, n: (st.buffers.row_slot[:n].numpy().copy(), st.checksum.value,
                                            st.checksum.count)), st


def _script() -> list:
    s: list = []
    ids = [f"r{i}" for i in range(8)]
    for rid, kind in zip(ids, (0, 1, 2, 1, 2, 0, 1, 3)):
        s.append(("register", rid, _spec(kind)))
    s.append(("step", ids, [PROMPT] * 8, [0] * 8))  # prefill
    pos = [PROMPT] * 8

    def decode(n):
        nonlocal pos
        for _ in range(n):
            s.append(("step", list(ids), [1] * len(ids), list(pos)))
            pos = [p + 1 for p in pos]

    decode(4)  # r7's steer at a generated position: no step repeats
    s.append(("finish", "r7"))
    ids, pos = ids[:7], pos[:7]
    decode(4)
    s.append(("finish", "r2"))  # a request leaves
    del ids[2], pos[2]
    decode(3)
    s.append(("register", "r9", _spec(2)))  # one joins: its prefill beside the decode rows
    s.append(("step", ids + ["r9"], [1] * len(ids) + [PROMPT], pos + [0]))
    ids, pos = ids + ["r9"], [p + 1 for p in pos] + [PROMPT]
    decode(4)
    s.append(("global", 0.5))  # every plan recomposed
    decode(3)
    s.append(("fault",))
    decode(3)
    ids, pos = ids[::-1], pos[::-1]  # the same requests in another order
    decode(3)
    return s


def _script_templates_only() -> list:
    """Requests whose plans are generation templates only (and one without a plan)."""
    s: list = []
    ids = [f"t{i}" for i in range(6)]
    for i, rid in enumerate(ids):
        s.append(("register", rid, _spec(1 + i % 2 if i != 4 else 0)))
    s.append(("step", ids, [PROMPT] * 6, [0] * 6))
    pos = [PROMPT] * 6
    for _ in range(8):
        s.append(("step", ids, [1] * 6, list(pos)))
        pos = [p + 1 for p in pos]
    return s


def test_steady_decode_steps_plan_exactly_as_request_by_request():
    repeated = []
    for script in (_script(), _script_templates_only()):
        fast, st_fast = _run(True, script)
        slow, st_slow = _run(False, script)
        assert len(fast) == len(slow)
        for k, (a, b) in enumerate(zip(fast, slow)):
            assert np.array_equal(a[0], b[0]), f"step {k}: row tables differ"
            assert a[1:] == b[1:], f"step {k}: checksums differ"
        assert st_slow.planner.steady_steps == 0
        repeated.append(st_fast.planner.steady_steps)
    # the repeat ran where it may: in the mixed script, after r7 left, each decode step that
    # follows a decode step of the same batch planned the same way (3 + 2 + 3 + 2 + 1 + 2: the
    # first step after a request left or joined, after the recomposition and in a new order is
    # planned request by request, and after the fault two are: the faulty one does not repeat);
    # in the templates-only one, every decode step after the first
    assert repeated == [13, 7]


def test_the_repeat_needs_the_same_plan_objects_and_one_row_each():
    fast, st = _run(True, _script_templates_only()[:-3])
    n = st.planner.steady_steps
    ids = [f"t{i}" for i in range(6)]
    pos = [PROMPT + 5] * 6
    # two rows for one request (a recomputation): planned request by request
    st.plan_step(ids, np.asarray([0, 1, 2, 4, 5, 6, 7], np.int32), np.asarray(pos, np.int32))
    assert st.planner.steady_steps == n
    st.after_forward()
    # a request's plan replaced by another object (the global steering changed)
    st.set_global_steer([{"site": 5, "vec": _vec(7).tobytes(), "scale": 1.0, "gen": True}])
    st.plan_step(ids, np.arange(7, dtype=np.int32), np.asarray(pos, np.int32) + 2)
    assert st.planner.steady_steps == n
