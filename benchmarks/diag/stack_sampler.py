"""A sampling profiler for every Python thread of a process, including vLLM's engine-core process
(issue #13: where the host time of a GPU sweep goes, on a host without py-spy).

A daemon thread reads `sys._current_frames()` every `interval_s` and counts each thread's stack
(file:function per frame). Reported per thread: samples, the leaf functions (self time) and the
functions on the stack (inclusive time), as fractions of that thread's samples. Sampling holds the
GIL for the time it takes to walk the stacks (tens of microseconds), so keep the interval at a few
milliseconds; compare fractions, not absolute times.

Use in one process: `s = StackSampler(); s.start(); ...; report = s.stop()`.

Across processes (vLLM's engine core runs in its own process on a GPU): call `arm_children(dir,
flag)` in the parent before the engine starts. Every child forked afterwards (and every child
spawned from a script that calls `arm_spawned_child()` at import) samples while the file `flag`
exists and writes its report to `dir/stack-<pid>.json` when the file goes away (the parent
creates the flag before the timed work and removes it after). Children that `exec` (compilers,
`git`) lose the thread with their image, as they should.
"""
from __future__ import annotations

import collections
import json
import os
import sys
import threading
import time

IDLE_LEAVES = {"wait", "select", "poll", "epoll", "recv", "recv_multipart", "_recv", "recv_into", "sleep", "acquire",
               "get", "_wait_for_tstate_lock", "dequeue", "_poll", "socket_recv", "readinto"}
#: leaves that mean "idle" too: an event loop run by uvloop (uvicorn's) waits in C below `run`
IDLE_FRAMES = {"runners.py:run"}


def _frame_key(code) -> str:
    """`vllm/v1/engine/core.py:step`, `engine_ext/worker/state.py:register`, `threading.py:wait`."""
    fn = code.co_filename
    i = fn.rfind("site-packages/")
    if i >= 0:
        fn = fn[i + len("site-packages/"):]
    else:
        j = max(fn.rfind(f"/{top}/") for top in ("engine_ext", "app", "benchmarks", "vllm"))
        fn = fn[j + 1:] if j >= 0 else os.path.basename(fn)
    return f"{fn}:{code.co_name}"


class StackSampler:
    """Counts the stacks of every other thread of this process (see the module docstring)."""

    def __init__(self, interval_s: float = 0.002, depth: int = 48) -> None:
        self.interval_s, self.depth = interval_s, depth
        self.stacks: collections.Counter = collections.Counter()
        self.samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0
        self.wall_s = 0.0

    def start(self) -> "StackSampler":
        self._stop.clear()
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.interval_s):
            names = {t.ident: t.name for t in threading.enumerate()}
            for tid, frame in sys._current_frames().items():
                if tid == me:
                    continue
                stack = []
                while frame is not None and len(stack) < self.depth:
                    stack.append(_frame_key(frame.f_code))
                    frame = frame.f_back
                self.stacks[(names.get(tid, str(tid)), tuple(stack))] += 1
            self.samples += 1

    def stop(self, top: int = 30) -> dict:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.wall_s += time.perf_counter() - self._t0
        return self.report(top)

    def report(self, top: int = 30) -> dict:
        threads: dict[str, dict] = {}
        for (name, stack), n in self.stacks.items():
            t = threads.setdefault(name, {"samples": 0, "self": collections.Counter(), "incl": collections.Counter(),
                                          "stacks": collections.Counter()})
            t["samples"] += n
            if stack:
                t["self"][stack[0]] += n
            for f in set(stack):
                t["incl"][f] += n
            t["stacks"][" <- ".join(stack[:8])] += n
        out = {"pid": os.getpid(), "argv0": sys.argv[0] if sys.argv else "", "samples": self.samples,
               "wall_s": round(self.wall_s, 3), "interval_s": self.interval_s, "threads": {}}
        for name, t in sorted(threads.items(), key=lambda kv: -kv[1]["samples"]):
            n = t["samples"]
            idle = sum(c for f, c in t["self"].items() if f in IDLE_FRAMES or f.rsplit(":", 1)[-1] in IDLE_LEAVES)
            out["threads"][name] = {
                "samples": n, "idle_leaf_frac": round(idle / n, 3),
                "self": [[f, round(c / n, 4)] for f, c in t["self"].most_common(top)],
                "inclusive": [[f, round(c / n, 4)] for f, c in t["incl"].most_common(top)],
                "stacks": [[s, round(c / n, 4)] for s, c in t["stacks"].most_common(12)],
            }
        return out


def _watch_flag(out_dir: str, flag: str, interval_s: float, timeline: bool) -> None:
    """In a child process: sample while `flag` exists; write the report when it goes away (with
    the engine core's timeline over the same window when `timeline`)."""
    sampler, since = None, 0.0
    while True:
        exists = os.path.exists(flag)
        if exists and sampler is None:
            sampler, since = StackSampler(interval_s).start(), time.time()
        elif not exists and sampler is not None:
            report = sampler.stop(top=80)
            if timeline:
                from benchmarks.diag import core_timeline

                report["core_timeline"] = core_timeline.report(since, time.time())
                report["core_timeline"]["since"] = since
                # [kind, start, seconds, requests held, tokens scheduled]
                report["core_events"] = [[k, round(a - since, 5), round(b - a, 5), n, tok]
                                         for k, a, b, n, tok in core_timeline.EVENTS if b >= since]
            path = os.path.join(out_dir, f"stack-{os.getpid()}.json")
            with open(path, "w") as f:
                json.dump(report, f)
            sampler = None
        time.sleep(0.05)


def _arm(out_dir: str, flag: str, interval_s: float) -> None:
    timeline = os.environ.get("CB_CORE_TIMELINE") == "1"
    if timeline:
        try:
            from benchmarks.diag import core_timeline

            core_timeline.install()
        except Exception:  # not a process with vLLM (a compiler child): nothing to time
            timeline = False
    threading.Thread(target=_watch_flag, args=(out_dir, flag, interval_s, timeline), name="stack-sampler-watch",
                     daemon=True).start()


def arm_children(out_dir: str, flag: str, interval_s: float = 0.002, core_timeline: bool = True) -> None:
    """Every child this process forks from now on samples while `flag` exists (module docstring),
    and (`core_timeline`) records vLLM's engine-core loop (benchmarks/diag/core_timeline.py).
    Also exported as CB_STACK_DIR / CB_STACK_FLAG for spawned children (`arm_spawned_child`)."""
    os.makedirs(out_dir, exist_ok=True)
    os.environ.update(CB_STACK_DIR=out_dir, CB_STACK_FLAG=flag, CB_STACK_INTERVAL=str(interval_s),
                      CB_CORE_TIMELINE="1" if core_timeline else "0")
    os.register_at_fork(after_in_child=lambda: _arm(out_dir, flag, interval_s))


def arm_spawned_child() -> None:
    """Call at import in a script whose children are spawned (they re-import it as __mp_main__)."""
    d, flag = os.environ.get("CB_STACK_DIR"), os.environ.get("CB_STACK_FLAG")
    if d and flag:
        _arm(d, flag, float(os.environ.get("CB_STACK_INTERVAL", "0.002")))


def sampled_window(out_dir: str, flag: str, name: str, run, reps: int, bench: str, extra=None) -> None:
    """One sampled window: `reps` calls of `run()` with this process's threads sampled (written to
    `out_dir/client-<name>.json`, with `extra(since)`'s keys added: `since` is the window's start,
    `time.time()`) and every armed child sampling too (its `stack-<pid>.json` renamed to
    `stack-<pid>-<name>.json`); prints one `{"bench": bench, "variant": name, "seconds": ...}`
    line per call."""
    open(flag, "w").close()
    time.sleep(0.3)
    since = time.time()
    sampler = StackSampler().start()
    for _ in range(reps):
        t = time.perf_counter()
        run()
        print(json.dumps({"bench": bench, "variant": name, "seconds": round(time.perf_counter() - t, 4)}), flush=True)
    report = sampler.stop(top=80)
    report["since"] = since
    if extra is not None:
        report.update(extra(since))
    os.remove(flag)
    with open(os.path.join(out_dir, f"client-{name}.json"), "w") as f:
        json.dump(report, f)
    time.sleep(1.0)  # the children write their reports when the flag is gone
    for fn in os.listdir(out_dir):
        if fn.startswith("stack-") and fn.count("-") == 1:  # stack-<pid>.json: this window's
            os.replace(os.path.join(out_dir, fn), os.path.join(out_dir, fn[:-5] + f"-{name}.json"))
