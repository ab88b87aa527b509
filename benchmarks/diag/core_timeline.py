"""When vLLM's engine core is idle, stepping, or between the two (issue #13: a GPU sweep leaves the
core waiting for work a quarter of the time; this says when).

`install()` wraps two methods of `vllm.v1.engine.core.EngineCoreProc` (the engine core run in its
own process: a GPU engine; an in-process core, the CPU engine's, has no such loop) in the process
that calls it
(the engine-core process; `stack_sampler.arm_children` / `arm_spawned_child` call it there):
`_process_input_queue` (recorded as `idle` when the core had no work on entry: it blocks for a
request) and `_process_engine_step` (one `step`, with the number of requests the scheduler holds
and the number of tokens it scheduled in that step: `SchedulerOutput.total_num_scheduled_tokens`
summed over the `schedule()` calls the step made, 0 when it only collected a batch in flight).
Each event is (kind, start, end, held, tokens) in `time.time()` seconds, comparable with the
parent process's clock. `report(since, until)` sums them over a window and lists the idle gaps of 2 ms or more.
A diagnostic only: nothing in causalboard imports it.
"""
from __future__ import annotations

import time

EVENTS: list[tuple[str, float, float, int, int]] = []
#: tokens scheduled by each `Scheduler.schedule` call since the step began (appended by the wrapper)
_SCHEDULED: list[int] = []


def _count_scheduled(sched) -> None:
    """Wrap this scheduler instance's `schedule` to record each output's scheduled tokens."""
    if getattr(sched, "_cb_counted", False):
        return
    orig = sched.schedule

    def schedule(*args, **kwargs):
        out = orig(*args, **kwargs)
        _SCHEDULED.append(int(getattr(out, "total_num_scheduled_tokens", 0)))
        return out
    sched.schedule = schedule
    sched._cb_counted = True


def install() -> None:
    from vllm.v1.engine.core import EngineCoreProc as EngineCore

    if getattr(EngineCore, "_cb_timeline", False):
        return
    orig_input, orig_step = EngineCore._process_input_queue, EngineCore._process_engine_step

    def _process_input_queue(self):
        idle = not self.has_work()
        t = time.time()
        try:
            return orig_input(self)
        finally:
            EVENTS.append(("idle" if idle else "input", t, time.time(), 0, 0))

    def _process_engine_step(self):
        sched = self.scheduler
        _count_scheduled(sched)
        held = len(sched.running) + len(sched.waiting)  # before the step: one-token requests finish in it
        _SCHEDULED.clear()
        t = time.time()
        try:
            return orig_step(self)
        finally:
            EVENTS.append(("step", t, time.time(), held, sum(_SCHEDULED)))

    EngineCore._process_input_queue = _process_input_queue
    EngineCore._process_engine_step = _process_engine_step
    EngineCore._cb_timeline = True


def report(since: float, until: float) -> dict:
    ev = [e for e in EVENTS if e[2] >= since and e[1] <= until]
    tot: dict[str, float] = {}
    for kind, a, b, *_ in ev:
        tot[kind] = tot.get(kind, 0.0) + (min(b, until) - max(a, since))
    gaps = [[round(a - since, 4), round(b - a, 4)] for kind, a, b, *_ in ev if kind == "idle" and b - a >= 0.002]
    steps = [e for e in ev if e[0] == "step"]
    return {"window_s": round(until - since, 4), "seconds": {k: round(v, 4) for k, v in tot.items()},
            "steps": len(steps), "step_s_median": round(sorted(b - a for _, a, b, *_ in steps)[len(steps) // 2], 5) if steps else None,
            "held_requests_median": sorted(e[3] for e in steps)[len(steps) // 2] if steps else None,
            "scheduled_tokens": sum(e[4] for e in steps),
            "idle_gaps": gaps[:400], "idle_gaps_total": len(gaps)}


#: the client side (the API process): (kind, start, end, n) of the engine-loop thread's vLLM
#: steps and request submissions, and of the API thread's request preparation
CLIENT_EVENTS: list[tuple[str, float, float, int]] = []


def _timed(kind: str, fn, count=lambda *a, **k: 0):
    def wrapper(*args, **kwargs):
        t = time.time()
        try:
            return fn(*args, **kwargs)
        finally:
            CLIENT_EVENTS.append((kind, t, time.time(), count(*args, **kwargs)))
    return wrapper


def install_client(eng) -> None:
    """Time a started `engine_ext.Engine`'s loop steps (`step`: `LLMEngine.step`, which waits for the
    core's next outputs), each `add_request` (`add`: with batched submission vLLM's processing of
    one request, without the send), each batch sent in one message (`batch`, n = requests: the
    processing of all of them and the one send), each `cb_collect` delivery wait (`collect`) and
    the API side's batch preparation (`prepare`, n = requests)."""
    from engine_ext.worker import seam

    if not getattr(seam.add_requests_batched, "_cb_timed", False):
        seam.add_requests_batched = _timed("batch", seam.add_requests_batched, lambda engine, items, **k: len(items))
        seam.add_requests_batched._cb_timed = True
    loop = eng._loop
    loop.engine.step = _timed("step", loop.engine.step)
    loop.engine.add_request = _timed("add", loop.engine.add_request)
    loop._deliver_collected = _timed("collect", loop._deliver_collected)
    eng._prepare_many = _timed("prepare", eng._prepare_many, lambda batch, *a, **k: len(batch))


def client_events(since: float) -> list:
    return [[k, round(a - since, 5), round(b - a, 5), n] for k, a, b, n in CLIENT_EVENTS if b >= since]
