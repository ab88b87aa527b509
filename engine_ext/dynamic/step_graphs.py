"""CUDA graphs of dynamic steering's small per-step device work in a steady decode, each replayed
as one launch instead of several: a score layout's probe scores (`capture_scores`, for
`worker._ScorePlan`: the capture rows' fp32 sum, one matmul and bias per probe) and the launches
of decisions on the device (`capture_launch`, for `device_decisions`: the decision kernel, the
rows' and payloads' rewrite).

Why: each small kernel costs the host ~10-30 µs to launch on a GPU host
(`benchmarks/diag/op_costs.py`: ~75 µs for the scores eagerly against ~10 µs as a graph replay),
every step, and a batch-32 decode's engine core is host-bound (docs/performance.md, "Twenty-eighth
session": the engine loop waits ~0 µs for the GPU a step once dynamic steering is on), so each
microsecond of host time per step costs one of step time. Used for chains of repeated steps: the
scores of every chain, the decision and rewrite of a chain decided on the device
(`device_decisions`; `dynamic_planner_bench.py --device cuda`: that path's worker time per step
~530 -> ~210 µs). Work is captured once it has run eagerly `AFTER` times in a row (a chain of
steady steps; batches that change every step never pay for a capture), and only when everything it
reads stays at the same addresses (views of persistent buffers, no host copy inside).
`CAUSALBOARD_DYN_GRAPHS=0` (or the RPC `cb_set_dyn_graphs`) keeps everything eager.

Contracts: a graph of the scores is the eager scores exactly: `capture_scores` replays the new
graph once and compares it with the eager result of the same step on the device; the caller
replays it only once that comparison has reached the host equal (`PendingScoreGraph.verdict`,
read without waiting: eager scoring goes on until then), and stays eager (logged) if they differ
in any element or the capture fails. Its output tensor is the graph's
own: each replay overwrites it, so a caller consumes it (its device-to-host copy, a decision
kernel) before the next step's scores, on the same stream. A captured launch runs the same kernel
binary on the same arguments as the eager launch it replaces (nothing is compared: it may update
state in place, so it is captured without running).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

logger = logging.getLogger("causalboard.dynamic")

#: repeating work is captured at its this-many-th eager run in a row
AFTER = 4


class ScoreGraph:
    """One captured layout: `replay()` launches it on the current stream and returns its output."""

    __slots__ = ("graph", "out", "_keep")

    def __init__(self, graph: torch.cuda.CUDAGraph, out: torch.Tensor, keep: tuple):
        self.graph, self.out, self._keep = graph, out, keep

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.out


_side_stream: torch.cuda.Stream | None = None

#: graphs captured in this process, and the host seconds their captures took (`_capture`;
#: reported in the dynamic status: a capture is a cost per chain, paid on the step that makes it)
captures = 0
capture_seconds = 0.0


def _capture(work: Callable[[], object], warm_up: bool) -> tuple[torch.cuda.CUDAGraph, object]:
    """`work()` captured on a side stream that follows the current one (thread-local capture mode:
    other threads' CUDA calls go on), after one eager run there first with `warm_up` (the stream's
    library handles and workspaces); returns the graph and what the captured call returned.
    Raises what the capture raises."""
    global _side_stream, captures, capture_seconds
    t0 = time.perf_counter()
    cur = torch.cuda.current_stream()
    if _side_stream is None:
        _side_stream = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    _side_stream.wait_stream(cur)
    with torch.cuda.stream(_side_stream):
        if warm_up:
            work()
        g.capture_begin(capture_error_mode="thread_local")
        try:
            out = work()
        finally:
            g.capture_end()
    cur.wait_stream(_side_stream)
    captures += 1
    capture_seconds += time.perf_counter() - t0
    return g, out


class PendingScoreGraph:
    """A graph of the scores captured at one step, whose check against that step's eager scores
    runs on the device: `verdict()` is None until the check's result has reached the host (read
    without waiting: the caller goes on scoring eagerly meanwhile), then whether the graph's
    replay equalled the eager scores bit for bit."""

    __slots__ = ("graph", "_flag", "_event")

    def __init__(self, graph: ScoreGraph, flag: torch.Tensor, event: torch.cuda.Event):
        self.graph, self._flag, self._event = graph, flag, event

    def verdict(self) -> bool | None:
        if not self._event.query():
            return None
        return bool(self._flag[0])


def capture_scores(score: Callable[[], torch.Tensor], eager: torch.Tensor, keep: tuple = ()) -> PendingScoreGraph | None:
    """Capture `score()` (device work only: views of persistent buffers, no host copies) as a
    graph, replay it once and start comparing that replay with `eager`, this step's eager result
    (every element equal, as `torch.equal`), on the device: the result reaches the host without a
    wait (`PendingScoreGraph.verdict`), so the capture's step never waits for the GPU. `keep`:
    objects whose device memory the graph reads (held as long as it). None: no graph (the failure
    logged; a stream already capturing — vLLM's own graphs — is not a failure)."""
    if torch.cuda.is_current_stream_capturing():
        return None
    try:
        g, out = _capture(score, warm_up=True)
        if out.shape != eager.shape or out.dtype != eager.dtype:
            raise ValueError(f"the graph's output is {tuple(out.shape)} {out.dtype}, the eager scores "
                             f"{tuple(eager.shape)} {eager.dtype}")
        g.replay()  # on the current stream, after this step's eager scores
        flag = torch.empty(1, dtype=torch.bool, pin_memory=True)
        flag.copy_(torch.eq(out, eager).all().reshape(1), non_blocking=True)
        done = torch.cuda.Event()
        done.record()
    except Exception as e:  # noqa: BLE001 - any failure: stay eager
        logger.warning("causalboard: probe scores not captured as a CUDA graph (%s: %s); scoring eagerly",
                       type(e).__name__, e)
        return None
    return PendingScoreGraph(ScoreGraph(g, out, keep), flag, done)


class LaunchGraph:
    """One captured launch sequence: `replay()` launches it on the current stream."""

    __slots__ = ("graph", "_keep")

    def __init__(self, graph: torch.cuda.CUDAGraph, keep: tuple):
        self.graph, self._keep = graph, keep

    def replay(self) -> None:
        self.graph.replay()


def capture_launch(launch: Callable[[], None], keep: tuple = ()) -> LaunchGraph | None:
    """Capture `launch()` (kernel launches on persistent tensors, already run eagerly: compiled and
    loaded, no allocation, no host copy) as a graph, without running it. `keep`: what its kernels
    read or write (held as long as the graph). None: not captured (logged unless vLLM is
    capturing)."""
    if torch.cuda.is_current_stream_capturing():
        return None
    try:
        g, _ = _capture(launch, warm_up=False)
    except Exception as e:  # noqa: BLE001 - any failure: stay eager
        logger.warning("causalboard: dynamic steering's device launches not captured as a CUDA graph (%s: %s)",
                       type(e).__name__, e)
        return None
    return LaunchGraph(g, keep)


class RepeatingLaunch:
    """A launch sequence run eagerly until it has run `AFTER` times in a row with the same `key`
    (what its graph bakes in besides persistent tensors: an input's address), then captured
    (`capture_launch`) and replayed, but only for the key it was captured with: another key runs
    eagerly, and once it has repeated `AFTER` times it is captured in its place (the scores of a
    chain decided on the device move to their own graph's output after a few steps). A failed
    capture is not retried."""

    __slots__ = ("graph", "_graph_key", "_last", "_runs", "_failed")

    def __init__(self) -> None:
        self.graph: LaunchGraph | None = None
        self._graph_key: object = None
        self._last: object = None
        self._runs = 0
        self._failed = False

    def run(self, launch: Callable[[], None], key: object = None, graphs: bool = True) -> bool:
        """`launch()`, or its graph's replay; `graphs`: graphs allowed now (a CUDA device, the
        worker's switch on). Returns whether the graph was replayed."""
        if graphs and self.graph is not None and key == self._graph_key:
            self.graph.replay()
            return True
        launch()
        self._runs = self._runs + 1 if key == self._last else 1
        self._last = key
        if graphs and self._runs == AFTER and not self._failed:
            graph = capture_launch(launch)
            if graph is None:
                self._failed = True
            else:
                self.graph, self._graph_key = graph, key
        return False
