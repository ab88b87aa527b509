"""Host time per step of dynamic steering inside a real engine (issue 15's cost, host side): the
worker's `WorkerState.plan_step` (and its dynamic part's first phase,
`DynamicWorker.plan_rows_begin`) and `WorkerState.after_forward`, timed around each call in an
IN-PROCESS engine (worker and client in one process; the script sets
VLLM_ENABLE_V1_MULTIPROCESSING=0 itself), batch-32 decode with one probe and one policy on every
request (the variants of `benchmarks/dynamic_bench.py`).

    PYTHONPATH=. python3 benchmarks/diag/dynamic_host.py [--model DIR] [--device cpu|cuda] [--tokens 64] [--reps 3]

Per step also: `wait`, how long the plan waits for the previous step's scores (on a GPU: for the
previous forward to end; ~0 means the host, not the GPU, is the limit); `after_wait`, from the end
of that wait to the end of the step's plan (`finish_step` where the V2 runner defers it, else
`plan_step`); `gap`, from the end of that wait to the launch of the step's forward (V2 runner: GPU
idle time). Compare with `benchmarks/dynamic_planner_bench.py` (the same work without an engine:
warmer caches, lower figures). One JSON line per variant and repetition: median microseconds per
call of each timed function, the wall time of the batch, the number of planned steps.
"""
import argparse
import json
import os
import statistics
import time


os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the worker's calls are timed in this process

from engine_ext.dynamic.worker import DynamicWorker  # noqa: E402
from engine_ext.worker.state import WorkerState  # noqa: E402

TIMES: dict[str, list[int]] = {}


def _timed(cls, name: str) -> None:
    orig = getattr(cls, name)

    def wrapper(self, *a, **k):
        t = time.perf_counter_ns()
        try:
            return orig(self, *a, **k)
        finally:
            TIMES.setdefault(name, []).append(time.perf_counter_ns() - t)

    setattr(cls, name, wrapper)


def _time_after_wait() -> None:
    """`wait`: how long a plan waits for the previous step's scores (on a GPU, for the previous
    forward to end); `after_wait`: from the end of that wait to the end of the step's plan (of
    `finish_step` where the seam defers it, else of `plan_step`); `gap`: from the end of that wait
    to the launch of the step's forward (vLLM's V2 runner, CUDA graphs: the GPU idles meanwhile)."""
    mark: list[int] = []
    plan_step, finish_step = WorkerState.plan_step, WorkerState.finish_step
    begin, decide = DynamicWorker.plan_rows_begin, DynamicWorker.decide_pending

    def ended(what: str) -> None:
        if mark and mark[0] > 0:
            TIMES.setdefault(what, []).append(time.perf_counter_ns() - mark[0])

    def plan_step_w(self, *a, **k):
        mark.clear()
        out = plan_step(self, *a, **k)
        ended("after_wait")
        return out

    def finish_step_w(self, *a, **k):
        out = finish_step(self, *a, **k)
        ended("after_wait")
        return out

    def begin_w(self, *a, **k):
        mark.append(-1)  # inside a plan: the next decide_pending with scores pending is the wait
        return begin(self, *a, **k)

    def decide_w(self, *a, **k):
        if mark == [-1] and self._pending is not None:
            event = self._pending[2]
            t = time.perf_counter_ns()
            if event is not None:
                event.synchronize()
            mark[0] = time.perf_counter_ns()
            TIMES.setdefault("wait", []).append(mark[0] - t)
        return decide(self, *a, **k)

    WorkerState.plan_step, WorkerState.finish_step = plan_step_w, finish_step_w
    DynamicWorker.plan_rows_begin, DynamicWorker.decide_pending = begin_w, decide_w
    try:  # the forward's launch (V2 runner)
        from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager, ModelCudaGraphManager
    except Exception:
        return
    for cls in (CudaGraphManager, ModelCudaGraphManager):
        for name in ("run_fullgraph", "run_pw_graph"):
            if name in vars(cls):
                orig = vars(cls)[name]

                def launch(self, *a, _orig=orig, **k):
                    ended("gap")
                    mark.clear()
                    return _orig(self, *a, **k)
                setattr(cls, name, launch)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    for cls, name in ((WorkerState, "plan_step"), (WorkerState, "after_forward"), (DynamicWorker, "plan_rows_begin")):
        _timed(cls, name)
    _time_after_wait()

    from benchmarks.dynamic_variants import in_process_engine, workload
    from engine_ext import GenerationParams

    eng = in_process_engine(args.model, args.device)
    variants, _, prompts = workload(eng, 32, 132)
    params = GenerationParams(max_tokens=args.tokens, ignore_eos=True)
    for dyn in variants.values():  # warm-up
        eng.generate(prompts, GenerationParams(max_tokens=4, ignore_eos=True), dynamic=dyn)
    for rep in range(args.reps):
        for name, dyn in variants.items():
            TIMES.clear()
            t = time.perf_counter()
            eng.generate(prompts, params, dynamic=dyn)
            wall = time.perf_counter() - t
            med = {k: round(statistics.median(x) / 1e3, 1) for k, x in TIMES.items()}
            print(json.dumps({"bench": "dyn_host_us", "variant": name, "rep": rep, "device": args.device,
                              "wall_s": round(wall, 3), "median_us": med, "steps": len(TIMES.get("plan_step", []))}),
                  flush=True)
    eng.close()


if __name__ == "__main__":
    main()
