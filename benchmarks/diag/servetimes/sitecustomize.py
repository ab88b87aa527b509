"""Timestamps of an HTTP server's requests and of its engine's steps, the same for `vllm serve` and
`causalboard serve` (issue 13: where the batch-32 decode over HTTP loses time), without changing
either server's code. Put this folder first on PYTHONPATH and name an output folder:

    CB_SERVE_TIMES=$OUT/servetimes PYTHONPATH=benchmarks/diag/servetimes:$PYTHONPATH \\
        python3 benchmarks/compare/http_bench.py --server cb ...   # or --server stock

Python imports `sitecustomize` at start-up in every process; this one (only with CB_SERVE_TIMES
set) wraps, as their modules load:
  http     Starlette's `__call__` for each HTTP request to /v1/completions: arrival and the end of
           the response (both servers are Starlette applications),
  add      vLLM's `OutputProcessor.add_request`: the request registered by the front end, right
           before it goes to the engine core (both servers' front ends),
  out      vLLM's `OutputProcessor.process_outputs`: one engine step's outputs taken in by the front
           end (start, duration, number of outputs).
Events go to `CB_SERVE_TIMES/servetimes-<pid>.jsonl` (one JSON list per event: kind, start ns,
duration ns, count), flushed every second and at exit; `benchmarks/diag/serve_timeline.py` reads
them. Each wrapper costs ~1-2 µs.
"""
import os

if os.environ.get("CB_SERVE_TIMES"):
    import atexit
    import importlib.util
    import json
    import threading
    import time

    _OUT = os.environ["CB_SERVE_TIMES"]
    _events: list = []
    _lock = threading.Lock()

    def _flush() -> None:
        with _lock:
            batch = _events[:]
            _events.clear()
        if batch:
            os.makedirs(_OUT, exist_ok=True)
            with open(os.path.join(_OUT, f"servetimes-{os.getpid()}.jsonl"), "a") as f:
                f.write("".join(json.dumps(e) + "\n" for e in batch))

    def _flusher() -> None:
        while True:
            time.sleep(1.0)
            _flush()

    atexit.register(_flush)
    threading.Thread(target=_flusher, name="servetimes-flush", daemon=True).start()

    def _patch_starlette(module) -> None:
        orig = module.Starlette.__call__

        async def __call__(self, scope, receive, send):
            if scope.get("type") != "http" or scope.get("path") != "/v1/completions":
                return await orig(self, scope, receive, send)
            t = time.perf_counter_ns()
            try:
                return await orig(self, scope, receive, send)
            finally:
                _events.append(["http", t, time.perf_counter_ns() - t, 1])

        module.Starlette.__call__ = __call__

    def _patch_output_processor(module) -> None:
        cls = module.OutputProcessor
        add, process = cls.add_request, cls.process_outputs

        def add_request(self, *a, **k):
            t = time.perf_counter_ns()
            try:
                return add(self, *a, **k)
            finally:
                _events.append(["add", t, time.perf_counter_ns() - t, 1])

        def process_outputs(self, engine_core_outputs, *a, **k):
            t = time.perf_counter_ns()
            try:
                return process(self, engine_core_outputs, *a, **k)
            finally:
                _events.append(["out", t, time.perf_counter_ns() - t, len(engine_core_outputs)])

        cls.add_request, cls.process_outputs = add_request, process_outputs

    _spec = importlib.util.spec_from_file_location(
        "_cb_diag_after_import", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "after_import.py"))
    _spec.loader.exec_module(_after := importlib.util.module_from_spec(_spec))
    _after.patch_after_import({"starlette.applications": _patch_starlette,
                               "vllm.v1.engine.output_processor": _patch_output_processor})
