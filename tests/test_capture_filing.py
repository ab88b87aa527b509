"""Fast tier (no engine): how captured rows travel from the capture buffer to a request's result
on the worker (`StepPlanner.after_forward` / `file_captures`, `WorkerState.finish` / `collect`).

On a GPU the copy of a step's rows to the host is still in flight when the next step is planned
and when a request's finish is seen. These tests stand in for the CUDA event of each copy with
one that reports "not done" until released (the CPU engine's copies are done at once), and check:
a step's planning and a request's finish never wait for a copy unless a run must be stored now;
the result gets every captured value once the copies are filed (at the next step that finds them
done, or at `collect`); a step copies the model-dtype pairs only if a request keeps them (a stored
run) and the fp32 sums only if one returns them, and the sums equal `x.float() + r.float()`."""

from __future__ import annotations

import gc

import numpy as np
import torch

from engine_ext.program import ModelDims, PromptInfo, compile_program, program_to_extra_args
from engine_ext.specs import Capture, Interventions
from engine_ext.worker.state import WorkerConfig, WorkerState

L, H, PROMPT = 4, 16, 5


class SlowCopy:
    """A CUDA event stand-in: `query()` is False until `release()`; `synchronize()` waits (counted)."""

    def __init__(self) -> None:
        self.released = False
        self.waits = 0

    def query(self) -> bool:
        return self.released

    def synchronize(self) -> None:
        self.waits += 1
        self.released = True

    def release(self) -> None:
        self.released = True


def _state() -> WorkerState:
    return WorkerState(L, H, 64, torch.device("cpu"), torch.bfloat16, WorkerConfig(max_capture_rows=64))


def _register(st: WorkerState, rid: str, capture: Capture) -> str:
    prog = compile_program(Interventions(capture=capture), PromptInfo(list(range(PROMPT)), None, None, 64),
                           ModelDims(L, H, 100, 0.02), key=f"k-{rid}", named_vector_dims=lambda n: None)
    st.register(rid, program_to_extra_args(prog))
    return f"k-{rid}"


def _prefill(st: WorkerState, rids: list[str], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Plan one prefill step of `rids`, fill the capture buffer with bf16 values, run the
    'forward' (after_forward) and make that step's copy a slow one. Returns the rows (x, r)."""
    qsl = np.arange(0, PROMPT * len(rids) + 1, PROMPT, dtype=np.int32)
    st.plan_step(rids, qsl, np.zeros(len(rids), np.int32))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, H, generator=g).to(torch.bfloat16)
    r = (torch.randn(64, H, generator=g) * 3).to(torch.bfloat16)
    st.buffers.cap_x.copy_(x)
    st.buffers.cap_r.copy_(r)
    st.after_forward()
    return x, r


def _slow_last(st: WorkerState) -> SlowCopy:
    ev = SlowCopy()
    done, step, blocks = st.planner._pending[-1]
    st.planner._pending[-1] = (ev, step, blocks)
    return ev


def _values(res: dict) -> dict[tuple[int, int], np.ndarray]:
    block = res["captures"]
    data = np.frombuffer(block["data"], dtype="<f4").reshape(len(block["keys"]), -1)
    return {(int(s), int(p)): data[i] for i, (s, p) in enumerate(block["keys"])}


def test_a_finish_does_not_wait_for_the_copy_and_the_result_gets_its_values_at_the_next_step():
    st = _state()
    key = _register(st, "a", Capture.make(["L1.post_block", "L3.pre_attn"], "all_prompt"))
    x, r = _prefill(st, ["a"], seed=1)
    hc = st.planner.hc[:PROMPT].copy()
    ev = _slow_last(st)
    assert st.planner._pending[-1][1].xs is None, "no request keeps pairs: only the fp32 sums are copied"
    st.finish("a")  # the request left the engine while its rows are on their way
    assert ev.waits == 0
    assert "captures" not in st.results[key], "captures must not be read before their copy finished"
    st.plan_step([], np.zeros(1, np.int32), np.zeros(0, np.int32))  # a step while the copy runs: no wait
    assert ev.waits == 0 and "captures" not in st.results[key]
    ev.release()
    st.plan_step([], np.zeros(1, np.int32), np.zeros(0, np.int32))  # the copy is done: filed, result complete
    assert ev.waits == 0
    res = st.collect([key])[key]
    assert res["status"] == "ok"
    got = _values(res)
    want = {(int(site), row): (x[hc[row, site]].float() + r[hc[row, site]].float()).numpy()
            for row in range(PROMPT) for site in np.nonzero(hc[row] >= 0)[0]}
    assert set(got) == set(want) and len(got) == 2 * PROMPT
    for k, v in want.items():
        assert np.array_equal(got[k], v), k


def test_collect_waits_for_a_copy_still_in_flight():
    st = _state()
    key = _register(st, "a", Capture.make(["L2.post_attn"], "last_prompt"))
    x, r = _prefill(st, ["a"], seed=2)
    row_site = int(st.planner.hc[PROMPT - 1, :].argmax())
    idx = int(st.planner.hc[PROMPT - 1, row_site])
    ev = _slow_last(st)
    st.finish("a")
    res = st.collect([key])[key]
    assert ev.waits == 1
    assert np.array_equal(_values(res)[(row_site, PROMPT - 1)], (x[idx].float() + r[idx].float()).numpy())


def test_a_run_to_store_is_stored_at_its_finish_with_its_pairs():
    st = _state()
    _register(st, "other", Capture.make(["L0.post_block"], "last_prompt"))
    key = _register(st, "keep", Capture.make(["L1.post_block"], "all_prompt", keep_as="clean", return_values=False))
    x, r = _prefill(st, ["other", "keep"], seed=3)
    ev = _slow_last(st)
    step = st.planner._pending[-1][1]
    assert step.xs is not None and step.rs is not None, "a request keeps its pairs: they are copied"
    st.finish("keep")
    assert ev.waits == 1, "the stored run must be complete when the next request may read it"
    assert st.store.get("clean") is not None
    res = st.collect([key])[key]
    assert res["stored_as"] == "clean" and "captures" not in res


def test_requests_without_captures_finish_without_waiting():
    st = _state()
    _register(st, "a", Capture.make(["L1.post_block"], "last_prompt"))
    prog = compile_program(Interventions(), PromptInfo(list(range(PROMPT)), None, None, 64), ModelDims(L, H, 100, 0.02),
                           key="k-plain", named_vector_dims=lambda n: None)
    st.register("plain", program_to_extra_args(prog))
    _prefill(st, ["a", "plain"], seed=4)
    ev = _slow_last(st)
    st.finish("plain")
    assert ev.waits == 0
    assert st.collect(["k-plain"])["k-plain"]["status"] == "ok"


def test_a_step_s_values_go_into_one_ring_region_and_results_are_slices_of_it():
    from engine_ext.capture_ring import CaptureRing, RingReaders

    st = _state()
    ring_name = st.enable_ring(1 << 20)
    readers = RingReaders()
    try:
        assert ring_name and readers.open(ring_name)
        keys = [_register(st, rid, Capture.make(["L0.post_attn", "L2.post_block"], "last_prompt")) for rid in "abc"]
        keys.append(_register(st, "d", Capture.make(["L1.pre_attn", "L3.post_attn"], [1, 3])))  # 2 x 2: a copy
        x, r = _prefill(st, ["a", "b", "c", "d"], seed=5)
        hc = st.planner.hc[: 4 * PROMPT].copy()
        assert st.ring.allocs == 1, "one region for the step's rows"
        for rid in "abcd":
            st.finish(rid)
        res = st.collect(keys, {})
        descs = [res[k]["captures"]["ring"] for k in keys]
        assert st.ring.allocs == 2, "the 2 x 2 block is copied into a region of its own (key order differs from row order)"
        region = descs[0][1]
        assert [d[1] for d in descs[:3]] == [region, region + 2 * 4 * H, region + 4 * 4 * H], "slices of the step's region"
        for k, rid, row0 in zip(keys, "abcd", range(0, 4 * PROMPT, PROMPT)):
            got = _values(readers.materialize({k: res[k]})[k])
            assert len(got) == 2 if rid != "d" else len(got) == 4
            for (site, pos), v in got.items():
                idx = hc[row0 + pos, site]
                assert np.array_equal(v, (x[idx].float() + r[idx].float()).numpy()), (rid, site, pos)
        in_use = st.ring.in_use
        assert in_use > 0 and readers.lent_replies == 4
        del got, v, res  # (the reply's blocks are the lent values too)
        gc.collect()  # the lent values dropped: their slices given back
        st.collect([], readers.take_acks())  # acknowledged: every region free again
        assert st.ring.in_use == 0
        assert isinstance(st.ring, CaptureRing) and st.ring.full == 0
    finally:
        readers.close()
        st.enable_ring(0)
