"""cProfile of causalboard's per-step worker calls inside vLLM's engine-core process (where
`dynamic_bench.py` and `cb_bench.py` measure: the multiprocess engine), without changing
causalboard's code. Put this folder first on PYTHONPATH and name an output folder:

    CB_STEP_PROFILE=$OUT/stepprofile PYTHONPATH=benchmarks/diag/stepprofile:$PYTHONPATH \\
        python3 benchmarks/dynamic_bench.py --model /tmp/llama-1b --device cuda ...

Python imports `sitecustomize` at start-up in every process, vLLM's spawned engine core included;
this one (only with CB_STEP_PROFILE set) profiles `WorkerState.plan_step`, `finish_step` and
`after_forward` (one `cProfile.Profile`, enabled only inside those calls), and writes one
`pstats` file per run of decode steps (a `generate` call: from a step that admits new requests
after decode steps to the next such step) of at least `CB_STEP_PROFILE_MIN` steps (default 50):
`CB_STEP_PROFILE/prof-<pid>-<NNN>-<steps>.pstats`, NNN counting such runs in order. Read them with
`python3 -m pstats` or `benchmarks/diag/stepprofile/summary.py`. cProfile slows small Python calls
down several times: compare the functions' shares, not the absolute times.
"""
import os

if os.environ.get("CB_STEP_PROFILE"):
    import cProfile
    import importlib.util

    _OUT = os.environ["CB_STEP_PROFILE"]
    _MIN = int(os.environ.get("CB_STEP_PROFILE_MIN", "50"))
    _state = {"prof": cProfile.Profile(), "steps": 0, "decoding": False, "runs": 0, "depth": 0}

    def _dump() -> None:
        prof, steps = _state["prof"], _state["steps"]
        _state["prof"], _state["steps"] = cProfile.Profile(), 0
        if steps >= _MIN:
            os.makedirs(_OUT, exist_ok=True)
            prof.dump_stats(os.path.join(_OUT, f"prof-{os.getpid()}-{_state['runs']:03d}-{steps}.pstats"))
            _state["runs"] += 1

    def _profiled(cls, name: str) -> None:
        orig = cls.__dict__.get(name)
        if orig is None:
            return

        def wrapper(self, *a, **k):
            if _state["depth"]:
                return orig(self, *a, **k)
            _state["depth"] = 1
            prof = _state["prof"]
            prof.enable()
            try:
                return orig(self, *a, **k)
            finally:
                prof.disable()
                _state["depth"] = 0

        setattr(cls, name, wrapper)

    def _patch_state(module) -> None:
        for name in ("plan_step", "finish_step", "after_forward"):
            _profiled(module.WorkerState, name)

    def _patch_runner(module) -> None:
        orig = module.GPUModelRunner.__dict__.get("execute_model")
        if orig is None:
            return

        def execute_model(self, scheduler_output, *a, **k):
            new = bool(getattr(scheduler_output, "scheduled_new_reqs", None))
            if new and _state["decoding"]:
                _dump()
            _state["decoding"] = not new
            _state["steps"] += 1
            return orig(self, scheduler_output, *a, **k)

        module.GPUModelRunner.execute_model = execute_model

    import atexit
    atexit.register(_dump)

    _TARGETS = {"engine_ext.worker.state": _patch_state,
                "vllm.v1.worker.gpu.model_runner": _patch_runner,
                "vllm.v1.worker.gpu_model_runner": _patch_runner}

    _spec = importlib.util.spec_from_file_location(
        "_cb_diag_after_import", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "after_import.py"))
    _spec.loader.exec_module(_after := importlib.util.module_from_spec(_spec))
    _after.patch_after_import(_TARGETS)
