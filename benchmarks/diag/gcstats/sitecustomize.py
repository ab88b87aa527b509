"""The garbage collector's work in every Python process started with this folder first on
PYTHONPATH and `CB_GC_STATS` set to a path prefix: each process writes `PREFIX.<pid>` (JSON,
rewritten every 2 s while it lives) with collections and seconds per generation, its
oldest-generation collections (wall time, ms, objects collected; the last 50) and the objects frozen
(`gc.get_freeze_count`). Issue 13: `causalboard serve`'s slow P1 bursts over HTTP were
oldest-generation collections of an unfrozen startup heap (docs/performance.md, "Twentieth session"):

    PYTHONPATH=benchmarks/diag/gcstats:$PYTHONPATH CB_GC_STATS=$OUT/gc TASKS=p1 bash benchmarks/gpu_http_call.sh

Without the variable nothing changes. (Python imports one `sitecustomize`: not together with
`benchmarks/diag/servetimes` or `switchinterval`.)"""
import os

if os.environ.get("CB_GC_STATS"):
    import gc
    import json
    import threading
    import time

    _prefix = os.environ["CB_GC_STATS"]
    _stats = {0: [0, 0.0], 1: [0, 0.0], 2: [0, 0.0]}
    _started: dict = {}
    _oldest: list = []

    def _on_gc(phase: str, info: dict) -> None:
        g = info["generation"]
        if phase == "start":
            _started[g] = time.perf_counter()
            return
        seconds = time.perf_counter() - _started.pop(g, time.perf_counter())
        _stats[g][0] += 1
        _stats[g][1] += seconds
        if g == 2:
            _oldest.append((round(time.time(), 3), round(seconds * 1e3, 2), info.get("collected")))
            del _oldest[:-50]

    def _dump() -> None:
        while True:
            time.sleep(2)
            try:
                with open(f"{_prefix}.{os.getpid()}", "w") as f:
                    json.dump({"pid": os.getpid(), "per_generation": {g: {"collections": n, "seconds": round(s, 4)}
                                                                      for g, (n, s) in _stats.items()},
                               "oldest_ms": _oldest, "frozen": gc.get_freeze_count()}, f)
            except OSError:
                return

    gc.callbacks.append(_on_gc)
    threading.Thread(target=_dump, name="cb-gc-stats", daemon=True).start()
