"""Per-step host times inside vLLM's engine-core process (issue 15's cost where `dynamic_bench.py`
measures it: the multiprocess engine), without changing causalboard's code. Put this folder first
on PYTHONPATH and name an output folder:

    CB_STEP_TIMES=$OUT/steptimes PYTHONPATH=benchmarks/diag/steptimes:$PYTHONPATH \\
        python3 benchmarks/dynamic_bench.py --model /tmp/llama-1b --device cuda ...

Python imports `sitecustomize` at start-up in every process, vLLM's spawned engine core included;
this one (only with CB_STEP_TIMES set) wraps, as their modules load, vLLM's model runners'
`execute_model` (V1 and V2; inside causalboard's own wrapper, so it times vLLM's body with
causalboard's planning in it), causalboard's `WorkerState.plan_step`, `finish_step`,
`after_forward`, `on_schedule` (the requests a step brings and retires: outside the timed
`execute_model`), `register`, `finish` and `collect`, and `DynamicWorker.register`, `finish`,
`result`, `idle` and `sync_device` (as `dyn.<name>`). Every run of steps (a `generate` call: from a step that admits new requests after
decode steps, or after 20 ms with no step, to the next such step) becomes one
JSON line in `CB_STEP_TIMES/steptimes-<pid>.jsonl`, in order: the number of steps and the median
microseconds per step of
  period         one `execute_model` start to the next (the engine's time per step),
  execute_model  the runner's `execute_model` (host time: with asynchronous scheduling it returns
                 while the GPU still runs the step),
  plan_step, finish_step, after_forward   causalboard's parts,
  sample_tokens  the runner's `sample_tokens` (host time of the sampler's launch),
  gpu_wait       how long the engine loop waited for a step's results to reach the host (the V2
                 runner's `AsyncOutput.get_output`, its copy event): time the host had nothing to
                 do while the GPU worked. ~0 on every step means the host sets the pace (each
                 microsecond it adds per step costs a microsecond of step time); well above 0,
                 the GPU does, and host work up to that much per step is hidden,
  schedule, update_from_output   the scheduler's two parts of each step (the engine core's),
  on_schedule, register, finish, collect, dyn.*   per call, not per step (a batch's registration
                 lands at the end of the run before it: it runs before its first step's start),
and per part its total (`total_ms`: a run's time beyond steps x median shows there) and its four
slowest calls with their index in the run (`slowest_us`),
so `period` well above `execute_model` + the rest of the engine loop means the GPU sets the pace,
and `period` close to the host's work means the host does. Wrapping costs ~1 µs per call.
In the process that calls `Engine.generate` it also writes one line per call to
`CB_STEP_TIMES/client-<pid>.jsonl` (below: the call's timeline, read by `summary.py` here).
(A `sitecustomize` of the Python installation itself would be shadowed while this folder is first.)
"""
import os

if os.environ.get("CB_STEP_TIMES"):
    import atexit
    import importlib.util
    import json
    import statistics
    import time

    _OUT = os.environ["CB_STEP_TIMES"]
    _GAP_NS = 20_000_000
    _steps: dict[str, list[int]] = {}
    _last: dict[str, int] = {"start": 0, "end": 0, "decoding": False}

    def _flush() -> None:
        if not _steps.get("execute_model"):
            _steps.clear()
            return
        rec = {"bench": "step_times", "pid": os.getpid(), "steps": len(_steps["execute_model"]),
               "median_us": {k: round(statistics.median(v) / 1e3, 1) for k, v in _steps.items() if v},
               "total_ms": {k: round(sum(v) / 1e6, 2) for k, v in _steps.items() if v},
               # the slowest calls of each timed part, as [index in the run, µs]: steps that
               # cost much more than the median (a capture, a registration) show here
               "slowest_us": {k: [[i, round(x / 1e3)] for i, x in sorted(enumerate(v), key=lambda e: -e[1])[:4]]
                              for k, v in _steps.items() if v}}
        os.makedirs(_OUT, exist_ok=True)
        with open(os.path.join(_OUT, f"steptimes-{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps(rec) + "\n")
        _steps.clear()

    atexit.register(_flush)

    def _timed(cls, name: str, key: str, step: bool = False) -> None:
        orig = getattr(cls, name, None)  # inherited ones too (wrapped on `cls`)
        if orig is None:
            return

        def wrapper(self, *a, **k):
            t = time.perf_counter_ns()
            if step:
                new = bool(getattr(a[0] if a else None, "scheduled_new_reqs", None))
                if (new and _last["decoding"]) or (_last["end"] and t - _last["end"] > _GAP_NS):
                    _flush()  # a new batch after decode steps, or after an idle engine
                elif _last["start"]:
                    _steps.setdefault("period", []).append(t - _last["start"])
                _last["start"], _last["decoding"] = t, not new
            try:
                return orig(self, *a, **k)
            finally:
                end = time.perf_counter_ns()
                _steps.setdefault(key, []).append(end - t)
                if step:
                    _last["end"] = end

        setattr(cls, name, wrapper)

    def _patch_state(module) -> None:
        for name in ("plan_step", "finish_step", "after_forward", "collect", "on_schedule", "register", "finish"):
            _timed(module.WorkerState, name, name)

    def _patch_dynamic(module) -> None:
        for name in ("register", "finish", "result", "idle", "sync_device"):
            _timed(module.DynamicWorker, name, "dyn." + name)

    # the client's side of each `Engine.generate` (in the process that calls it): one JSON line per
    # call in `CB_STEP_TIMES/client-<pid>.jsonl`, milliseconds from the call's start of
    #   submitted, added   the requests handed to the loop thread (prepared) / added to the engine,
    #   first_step  the loop's first engine step to return after the call began (requests added),
    #   last_step   the last engine step to return before the results' collection was sent,
    #   collect_sent, collect_reply   the first `cb_collect` call sent / its reply in (multiprocess core),
    #   end         the call returns (results expanded and handed over),
    # the number of engine steps the loop took meanwhile, and per `cb_collect` call of the
    # generate `collects`: [sent, reply in, keys, merge begun, its copies done] (the merge: the
    # ring's values copied out, `EngineLoop._merge_started`, the results converted meanwhile; None
    # where not reached) and `convert_ms`, the loop thread's time in the sinks' conversion of
    # final outputs with a worker result (`QueueSink.on_output` / `convert`).
    _gen: dict = {}

    def _ms() -> float:
        return time.perf_counter_ns() / 1e6

    def _patch_facade(module) -> None:
        orig = module.Engine.generate

        def generate(self, *a, **k):
            _gen.clear()
            _gen.update(start=_ms(), steps=0)
            try:
                return orig(self, *a, **k)
            finally:
                rec, t0 = dict(_gen), _gen.get("start")
                _gen.clear()
                if t0 is not None:
                    out = {"bench": "client_times", "steps": rec.pop("steps"), "end": round(_ms() - t0, 2)}
                    collects = rec.pop("collects", [])
                    convert = rec.pop("convert_ms", None)
                    out.update({k: round(v - t0, 2) for k, v in rec.items() if k != "start"})
                    if collects:
                        out["collects"] = [[None if v is None else (v if i == 2 else round(v - t0, 2))
                                            for i, v in enumerate(c)] for c in collects]
                    if convert is not None:
                        out["convert_ms"] = round(convert, 2)
                    os.makedirs(_OUT, exist_ok=True)
                    with open(os.path.join(_OUT, f"client-{os.getpid()}.jsonl"), "a") as f:
                        f.write(json.dumps(out) + "\n")

        module.Engine.generate = generate

    def _patch_loop(module) -> None:
        orig = module.EngineLoop._step

        def step(self):
            try:
                return orig(self)
            finally:
                if "start" in _gen:
                    t = _ms()
                    _gen.setdefault("first_step", t)
                    if "collect_sent" not in _gen:
                        _gen["last_step"] = t
                    _gen["steps"] += 1

        module.EngineLoop._step = step
        _patch_loop_adds(module)
        orig_merge = module.EngineLoop._merge_started

        def merge_started(self, per_rank):
            t = _ms()
            results, copied = orig_merge(self, per_rank)
            # replies are merged in the order their calls were sent: the oldest one not merged
            rec = next((c for c in _gen.get("collects", ()) if c[3] is None), None)
            if rec is None:
                return results, copied
            rec[3] = t

            def waited():
                copied()
                rec[4] = _ms()
            return results, waited

        module.EngineLoop._merge_started = merge_started

    def _patch_outputs(module) -> None:
        for name in ("on_output", "convert"):
            orig = getattr(module.QueueSink, name)

            def converting(self, output, worker_result=None, _orig=orig):
                if worker_result is None or "start" not in _gen:
                    return _orig(self, output, worker_result)
                t = time.perf_counter_ns()
                try:
                    return _orig(self, output, worker_result)
                finally:
                    _gen["convert_ms"] = _gen.get("convert_ms", 0.0) + (time.perf_counter_ns() - t) / 1e6

            setattr(module.QueueSink, name, converting)

    def _patch_loop_adds(module) -> None:
        for name, key in (("submit_many", "submitted"), ("_add_singles", "added")):
            orig = getattr(module.EngineLoop, name)

            def wrapper(self, *a, _orig=orig, _key=key, **k):
                try:
                    return _orig(self, *a, **k)
                finally:
                    if "start" in _gen:
                        _gen.setdefault(_key, _ms())

            setattr(module.EngineLoop, name, wrapper)

    def _patch_seam(module) -> None:
        orig = module.start_collective_rpc

        def start(engine, method, args=()):
            fut = orig(engine, method, args)
            if method == "cb_collect" and "start" in _gen:
                sent = _ms()
                _gen.setdefault("collect_sent", sent)
                rec = [sent, None, len(args[0]) if args else 0, None, None]
                _gen.setdefault("collects", []).append(rec)
                if fut is not None:
                    def done(f, rec=rec):
                        rec[1] = _ms()
                        _gen.setdefault("collect_reply", rec[1])
                    fut.add_done_callback(done)
            return fut

        module.start_collective_rpc = start

    def _patch_runner(module) -> None:
        _timed(module.GPUModelRunner, "execute_model", "execute_model", step=True)
        _timed(module.GPUModelRunner, "sample_tokens", "sample_tokens")

    def _patch_async_output(module) -> None:
        orig = module.AsyncOutput.get_output

        def waited_get_output(self):
            t = time.perf_counter_ns()
            self.copy_event.synchronize()  # the wait alone (get_output's own synchronize then returns at once)
            _steps.setdefault("gpu_wait", []).append(time.perf_counter_ns() - t)
            return orig(self)

        module.AsyncOutput.get_output = waited_get_output

    def _patch_scheduler(module) -> None:
        _timed(module.Scheduler, "schedule", "schedule")
        _timed(module.Scheduler, "update_from_output", "update_from_output")

    _TARGETS = {"engine_ext.worker.state": _patch_state,
                "engine_ext.dynamic.worker": _patch_dynamic,
                "engine_ext.engine.facade": _patch_facade,
                "engine_ext.engine.loop": _patch_loop,
                "engine_ext.engine.outputs": _patch_outputs,
                "engine_ext.worker.seam": _patch_seam,
                "vllm.v1.worker.gpu.model_runner": _patch_runner,
                "vllm.v1.worker.gpu_model_runner": _patch_runner,
                "vllm.v1.worker.gpu.async_utils": _patch_async_output,
                "vllm.v1.core.sched.scheduler": _patch_scheduler}

    # benchmarks/diag/after_import.py, loaded by its path (only this folder is on sys.path)
    _spec = importlib.util.spec_from_file_location(
        "_cb_diag_after_import", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "after_import.py"))
    _spec.loader.exec_module(_after := importlib.util.module_from_spec(_spec))
    _after.patch_after_import(_TARGETS)
