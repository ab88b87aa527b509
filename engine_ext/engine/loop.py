"""A vLLM `LLMEngine` driven by one background thread.

Contract: every call into the engine (build, add_request, step, abort, collective_rpc) happens on
the loop thread, so callers on any thread or event loop can submit work concurrently and vLLM's
scheduler batches it (continuous batching). Outputs are handed to per-request `Sink`s on the loop
thread; sinks must not block. A failing `add_request` fails only that request.

Engine failure (what `vllm serve` does: no restart, every caller told at once): a `step` that
raises (in-process engine: any exception of the model or the worker), or the engine-core process
dying (multiprocess engine: killed, out of memory; noticed by a watchdog thread, since vLLM's
sync client then blocks forever in `get_output` or a utility call) makes the loop dead for good:
every in-flight request, every request queued but not yet added and every pending `call` future
fails with `EngineDeadError`, and every later entry point raises it. Sinks and call futures are
registered before their command is queued, so none can be missed.

Worker results (captures, voided status) of finished requests are fetched with one
`cb_collect` call per step that finished any. With a multiprocess engine core the call is sent
without waiting (`seam.start_collective_rpc`): the loop keeps stepping, and each finished
request's final output goes to its sink together with its result once the reply is in (in the
order the calls were sent). Its sink stays registered until then, so an engine death fails it.

Control calls (`Engine._rpc`: stores, vectors, status) with a multiprocess engine core are sent
from the loop thread like `cb_collect` and their replies awaited by the caller's thread, so the
loop never waits for a core step to end on their account.

Submission: `submit_many` hands its requests to vLLM with one command; with a multiprocess engine
core that answers causalboard's `cb_add_requests` utility they also reach the core in a few
messages (`seam.add_requests_batched`: the first of 32 requests, so the core starts while the
rest are processed, then larger ones) instead of one per request; single requests (`submit`, one
per HTTP completion) queued while the loop thread was busy are gathered into such a batch when it
drains its commands. A message the core refuses fails its requests (aborted in vLLM's client,
each sink told) and the loop serves on.

Wake-ups: with a multiprocess engine core the loop thread spends most of a busy step waiting in
`LLMEngine.step` for the core's outputs. A command queued meanwhile (requests, aborts, calls)
wakes it (`seam.wake_output_wait`: one empty output, processed as nothing), so it reaches the
core while the core works rather than after the step (`CAUSALBOARD_WAKE_LOOP=0`: not woken).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

from engine_ext.capture_ring import RingReaders, copied_already
from engine_ext.collect_reply import expand_layouts
from engine_ext.errors import EngineDeadError
from engine_ext.switches import env_switch

logger = logging.getLogger("causalboard.engine")

#: how often the watchdog looks at the engine-core process (and how soon an idle loop notices)
WATCHDOG_INTERVAL_S = 0.5
#: how long `shutdown` waits for the loop thread of an engine that already died
DEAD_JOIN_TIMEOUT_S = 5.0


def engine_core_dead(engine: Any) -> bool:
    """Whether vLLM (0.25.1) has marked its engine-core client dead: `MPClient.resources.engine_dead`,
    set by vLLM's own `MPClientEngineMonitor` thread when an engine-core process exits and by the
    output thread on an `ENGINE_CORE_DEAD` message. The in-process client has no such flag (a
    failure there raises from `step` on the loop thread)."""
    core = getattr(engine, "engine_core", None)
    return bool(getattr(getattr(core, "resources", None), "engine_dead", False))


def wake_blocked_calls(engine: Any, error: BaseException) -> None:
    """Unblock a loop thread stuck in vLLM's sync multiprocess client after the engine core died:
    `SyncMPClient.get_output` waits on `outputs_queue` and `call_utility` (collective_rpc) on a
    future in `utility_results`; neither is ever answered by a dead process."""
    core = getattr(engine, "engine_core", None)
    q = getattr(core, "outputs_queue", None)
    if q is not None:
        try:
            q.put_nowait(error)
        except Exception:  # best effort: the loop thread's failure is reported either way
            logger.debug("could not post to outputs_queue", exc_info=True)
    for fut in list((getattr(core, "utility_results", None) or {}).values()):
        try:
            if not fut.done():
                fut.set_exception(error)
        except Exception:
            logger.debug("could not fail a utility future", exc_info=True)


class Sink(Protocol):
    """Receives one request's outputs on the loop thread. A sink may also offer `on_output` in two
    parts, `convert(output, worker_result) -> item` then `put(item)` (`outputs.QueueSink`): a
    final output whose result carries captured values is then converted while those values are
    still being copied out of the ring, and put once they are (`EngineLoop._deliver_collected`)."""

    def on_output(self, output: Any, worker_result: dict | None = None) -> None: ...  # a vllm RequestOutput

    def on_error(self, error: BaseException) -> None: ...


#: `_converted`'s answers for a sink without `convert` (its `on_output` is called instead) and
#: for one whose `convert` failed (logged; nothing handed over, as when an `on_output` fails)
_UNCONVERTED = object()
_FAILED = object()


class EngineLoop:
    def __init__(self, build_engine: Callable[[], Any], name: str = "causalboard-engine"):
        self._build_engine = build_engine
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._collect: dict[str, str] = {}  # request id -> causalboard key to collect at finish
        self._calls: set[Future] = set()  # `call` futures not yet resolved
        #: `cb_collect` calls sent without waiting, oldest first: (future, [(output, key)])
        self._collecting: list[tuple[Future, list[tuple[Any, str]]]] = []
        #: guards `_sinks`, `_calls` and `_error` (callers register, the loop and the watchdog fail them)
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._stopping = False
        self._error: BaseException | None = None
        self.engine: Any = None
        #: makes one result per request key of the workers' `cb_collect` replies (rank order);
        #: the facade sets it from the topology (several ranks), rank 0's reply otherwise
        self.merge_results: Callable[[list[dict[str, dict]]], dict[str, dict]] = lambda per_rank: per_rank[0]
        #: the workers' capture rings (`engine_ext.capture_ring`), set by the facade where enabled
        self.rings: RingReaders | None = None
        #: the ranks whose captured values `merge_results` uses (the facade: each pipeline stage's
        #: leader); None: every rank's. Other ranks' ring-held values are acknowledged, not copied
        self.capture_ranks: frozenset[int] | None = None
        #: whether `submit_many` sends its requests to the engine core in a few messages (`cb_add_requests`)
        #: (`seam.batch_adds_available`; decided once the engine is built)
        self._batch_adds = False
        #: whether a command may wake the loop thread waiting for the core's outputs
        #: (`seam.output_wait_wakeable`), whether it is waiting, whether it was woken in this wait
        self._wakeable = False
        self._waiting = self._woken = False
        self._wake_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._watchdog = threading.Thread(target=self._watch, name=f"{name}-watchdog", daemon=True)

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Build the engine on the loop thread; re-raise its build error here."""
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        self._watchdog.start()

    def shutdown(self) -> None:
        if not self._thread.is_alive():
            return
        self._stopping = True
        self._commands.put(lambda: None)  # wake the loop
        self._thread.join(timeout=DEAD_JOIN_TIMEOUT_S if self._error is not None else 60)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._error is None and not self._stopping

    @property
    def error(self) -> BaseException | None:
        """What killed the engine (None while it serves or after a clean shutdown)."""
        return self._error

    @property
    def in_flight(self) -> int:
        return len(self._sinks)

    # ---- submission (any thread) -------------------------------------------------------------
    def _queue(self, cmd: Callable[[], None]) -> None:
        """Queue a command for the loop thread; if that thread is waiting in `LLMEngine.step` for
        the engine core's outputs, wake it (`seam.wake_output_wait`, once per wait), so that the
        command reaches the core while the core works instead of after its current step."""
        self._commands.put(cmd)
        if not self._wakeable:
            return
        with self._wake_lock:
            if not self._waiting or self._woken:
                return
            self._woken = True
        from engine_ext.worker.seam import wake_output_wait

        wake_output_wait(self.engine)

    def submit(self, request_id: str, prompt: Any, params: Any, sink: Sink, collect_key: str | None = None) -> None:
        """Add a request. With `collect_key`, the workers' result for it (captures, voided
        status) is fetched when it finishes and handed to the sink with the final output."""
        self._register([(request_id, sink)])
        self._queue(_AddOne((request_id, prompt, params, sink, collect_key)))

    def submit_many(self, requests: list[tuple[str, Any, Any, Sink, str | None]]) -> None:
        """Add several requests `(request_id, prompt, params, sink, collect_key)` with one command
        (one wake-up of the loop thread): what `submit` does for each."""
        self._register([(r[0], r[3]) for r in requests])

        self._queue(lambda: self._add_singles(requests))

    def _can_wake(self) -> bool:
        """`seam.output_wait_wakeable`, unless `CAUSALBOARD_WAKE_LOOP=0` (commands then wait for
        the step the loop thread is waiting for, as before)."""
        from engine_ext.worker.seam import output_wait_wakeable

        if not env_switch("CAUSALBOARD_WAKE_LOOP", True):
            return False
        try:
            return output_wait_wakeable(self.engine)
        except Exception:
            logger.exception("could not check whether the loop thread can be woken")
            return False

    def _can_batch_adds(self) -> bool:
        """`seam.batch_adds_available`, unless `CAUSALBOARD_BATCH_ADDS=0` asks for one message per
        request (vLLM's own path)."""
        from engine_ext.worker.seam import batch_adds_available

        if not env_switch("CAUSALBOARD_BATCH_ADDS", True):
            return False
        try:
            return batch_adds_available(self.engine)
        except Exception:  # never a reason not to serve: one message per request then
            logger.exception("could not check for batched request submission")
            return False

    def _add_batch(self, requests: list[tuple[str, Any, Any, Sink, str | None]]) -> None:
        """On the loop thread: `_add` for several requests, sent to the engine core in a few
        messages (`seam.add_requests_batched`). Should the core fail to add a message's requests,
        they are aborted and fail with that error."""
        from engine_ext.worker.seam import add_requests_batched

        with self._lock:  # those aborted (or failed) before they were added are left out
            live = [r for r in requests if self._sinks.get(r[0]) is r[3]]
        if not live:
            return
        errors = add_requests_batched(self.engine, [(r[0], r[1], r[2]) for r in live],
                                      on_refused=lambda error, ids: self._commands.put(lambda: self._fail_added(ids, error)))
        for (request_id, _, _, sink, collect_key), exc in zip(live, errors):
            if exc is not None:
                self._refused(request_id, sink, exc)
                continue
            if collect_key is not None:
                self._collect[request_id] = collect_key

    def _fail_added(self, request_ids: list[str], error: BaseException) -> None:
        """On the loop thread: requests the engine core did not take (a refused message) leave
        vLLM's client state, and their sinks get the error."""
        logger.error("the engine core refused a message of %d requests: %s", len(request_ids), error)
        with self._lock:
            sinks = [(r, self._sinks.pop(r)) for r in request_ids if r in self._sinks]
        for r, _ in sinks:
            self._collect.pop(r, None)
        if sinks:
            self.engine.abort_request([r for r, _ in sinks])
        for _, sink in sinks:
            sink.on_error(RuntimeError(f"the engine core did not add the request: {error}"))

    def _register(self, sinks: list[tuple[str, Sink]]) -> None:
        """Record sinks before their command is queued (so an engine death fails them too)."""
        with self._lock:
            self._check_alive()
            for request_id, sink in sinks:
                self._sinks[request_id] = sink

    def _add(self, request_id: str, prompt: Any, params: Any, sink: Sink, collect_key: str | None) -> None:
        """On the loop thread: hand one registered request to vLLM."""
        with self._lock:
            if self._sinks.get(request_id) is not sink:  # aborted (or failed) before it was added
                return
        try:
            self.engine.add_request(request_id, prompt, params)
        except Exception as exc:
            self._refused(request_id, sink, exc)
            return
        if collect_key is not None:
            self._collect[request_id] = collect_key

    def _refused(self, request_id: str, sink: Sink, exc: Exception) -> None:
        """vLLM refused to add a request: only this request fails (unless it was already gone)."""
        with self._lock:
            gone = self._sinks.pop(request_id, None) is None
        if not gone:
            sink.on_error(exc)

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if it already finished). Its sink gets no further output."""
        self.abort_many([request_id])

    def abort_many(self, request_ids: list[str]) -> None:
        """`abort` for several requests with one command (one wake-up of the loop thread, one
        `abort_request` call into vLLM, one `cb_collect` to drop their worker-side results)."""
        if not self.alive or not request_ids:
            return

        def abort() -> None:
            with self._lock:
                known = [r for r in request_ids if self._sinks.pop(r, None) is not None]
            if known:
                self.engine.abort_request(known)
            keys = [k for k in (self._collect.pop(r, None) for r in request_ids) if k is not None]
            if keys:  # drop the worker-side results nobody will read
                self._collect_results(keys)

        self._queue(abort)

    def call(self, fn: Callable[[Any], Any]) -> Future:
        """Run `fn(engine)` on the loop thread between steps; the Future holds its result."""
        fut: Future = Future()
        with self._lock:
            self._check_alive()
            self._calls.add(fut)

        def run() -> None:
            with self._lock:
                if fut not in self._calls:  # failed meanwhile (engine death)
                    return
            if fut.set_running_or_notify_cancel():
                try:
                    result = fn(self.engine)
                except BaseException as exc:
                    self._resolve(fut, exc=exc)
                else:
                    self._resolve(fut, result=result)
            else:
                with self._lock:
                    self._calls.discard(fut)

        self._queue(run)
        return fut

    def _resolve(self, fut: Future, result: Any = None, exc: BaseException | None = None) -> None:
        with self._lock:
            if fut not in self._calls:  # already failed by an engine death
                return
            self._calls.discard(fut)
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    # ---- loop thread -----------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._error is not None:
            raise self._dead_error()
        if self._stopping or not self._thread.is_alive():
            raise EngineDeadError("the vLLM engine is shut down")

    def _dead_error(self) -> EngineDeadError:
        err = self._error
        return err if isinstance(err, EngineDeadError) else EngineDeadError(f"the vLLM engine stopped: {err!r}")

    def _die(self, error: BaseException) -> None:
        """The engine is dead for good: record why (the first cause wins), then fail every
        registered sink and pending call (once each). Any thread."""
        with self._lock:
            if self._error is None:
                self._error = error
            sinks, self._sinks = list(self._sinks.values()), {}
            calls, self._calls = list(self._calls), set()
        dead = self._dead_error()
        for sink in sinks:
            try:
                sink.on_error(dead)
            except Exception:
                logger.exception("sink failed on the engine's death")
        for fut in calls:
            if not fut.done():
                try:
                    fut.set_exception(dead)
                except Exception:  # resolved concurrently
                    pass
        self._commands.put(lambda: None)  # wake an idle loop thread

    def _watch(self) -> None:
        """Watchdog: notice an engine-core process that died (the loop thread may be blocked in
        vLLM waiting for it), fail everything, and unblock the loop thread."""
        while self._thread.is_alive() and not self._stopping:
            engine = self.engine
            if self._error is None and engine is not None and engine_core_dead(engine):
                logger.error("the vLLM engine-core process died; failing every in-flight request")
                self._die(EngineDeadError("the vLLM engine stopped: its engine-core process died "
                                          "(killed or out of memory)"))
                wake_blocked_calls(engine, self._dead_error())
            if self._error is not None:
                return
            time.sleep(WATCHDOG_INTERVAL_S)

    def _run(self) -> None:
        try:
            self.engine = self._build_engine()
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            return
        self._batch_adds = self._can_batch_adds()
        self._wakeable = self._can_wake()
        logger.info("batches of requests go to the engine core %s", "in a few messages each" if self._batch_adds
                    else "one message per request")
        self._ready.set()
        try:
            while not self._stopping and self._error is None:
                busy = self.engine.has_unfinished_requests()
                self._drain_commands(block=not busy and not self._collecting)
                if self._stopping or self._error is not None:
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
                if self._collecting:  # idle engine: wait for the oldest reply
                    self._deliver_collected(wait=not self.engine.has_unfinished_requests())
        except BaseException as exc:
            if self._error is None:
                logger.exception("engine loop failed")
            self._die(exc)
        finally:
            self._close_engine()

    def _drain_commands(self, block: bool) -> None:
        """Run the queued commands in order. Single requests queued one after another (`submit`:
        one per HTTP completion) are added together, as `submit_many` adds its batch: a few
        messages to the core instead of one each (`_add_batch`)."""
        try:
            cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        adds: list = []
        while True:
            if isinstance(cmd, _AddOne):
                adds.append(cmd.request)
            else:
                if adds:
                    self._add_singles(adds)
                    adds = []
                cmd()
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                if adds:
                    self._add_singles(adds)
                return

    def _add_singles(self, requests: list[tuple[str, Any, Any, Sink, str | None]]) -> None:
        """On the loop thread: add `requests`, in a few messages where the core takes them
        (`_add_batch`), else one by one (`_add`)."""
        if self._batch_adds and len(requests) > 1:
            self._add_batch(requests)
            return
        for request_id, prompt, params, sink, collect_key in requests:
            self._add(request_id, prompt, params, sink, collect_key)

    def _step(self) -> None:
        if self._wakeable:
            with self._wake_lock:
                self._waiting, self._woken = True, False
            try:
                if not self._commands.empty():  # queued since the drain (its wake-up would be lost)
                    return
                outs = self.engine.step()
            finally:
                with self._wake_lock:
                    self._waiting = False
        else:
            outs = self.engine.step()
        keys = [self._collect[o.request_id] for o in outs if o.finished and o.request_id in self._collect]
        if keys:
            from engine_ext.worker.seam import start_collective_rpc

            fut = start_collective_rpc(self.engine, "cb_collect", self._collect_args(keys))
            if fut is not None:  # multiprocess: hold the finished outputs until the reply is in
                held = [(o, self._collect.pop(o.request_id)) for o in outs if o.finished and o.request_id in self._collect]
                self._collecting.append((fut, held))
                held_ids = {id(o) for o, _ in held}
                outs = [o for o in outs if id(o) not in held_ids]
                keys = []
        results = self._collect_results(keys) if keys else {}
        for out in outs:
            with self._lock:
                sink = self._sinks.pop(out.request_id, None) if out.finished else self._sinks.get(out.request_id)
            if sink is None:  # aborted (or failed) meanwhile
                continue
            result = None
            if out.finished:
                key = self._collect.pop(out.request_id, None)
                if key is not None:
                    result = results.get(key, {"status": "unknown", "errors": ["no worker result"]})
            try:
                sink.on_output(out, result)
            except Exception:  # a consumer bug must not kill the engine for everyone
                logger.exception("sink failed for %s", out.request_id)

    def _deliver_collected(self, wait: bool) -> None:
        """Hand the held final outputs whose `cb_collect` reply is in to their sinks, oldest call
        first; with `wait`, block for the oldest reply. A failed call raises (the loop dies, as
        with a blocking call)."""
        while self._collecting:
            fut, held = self._collecting[0]
            if not fut.done() and not wait:
                return
            per_rank = fut.result()
            self._collecting.pop(0)
            wait = False
            results, copied = self._merge_started(per_rank)
            ready = []
            for out, key in held:
                with self._lock:
                    sink = self._sinks.pop(out.request_id, None)
                if sink is None:  # aborted (or failed) meanwhile
                    continue
                result = results.get(key, {"status": "unknown", "errors": ["no worker result"]})
                ready.append((sink, out, result, self._converted(sink, out, result)))
            copied()  # every value in place before any caller can see one
            for sink, out, result, item in ready:
                if item is _FAILED:
                    continue
                try:
                    if item is _UNCONVERTED:
                        sink.on_output(out, result)
                    else:
                        sink.put(item)
                except Exception:  # a consumer bug must not kill the engine for everyone
                    logger.exception("sink failed for %s", out.request_id)

    @staticmethod
    def _converted(sink: Sink, out: Any, result: dict) -> Any:
        """A two-part sink's item (`Sink`), else `_UNCONVERTED` (its `on_output` is called later);
        a failing `convert` is logged like a failing `on_output`, and its output is not handed
        over (`_FAILED`), as a failing `on_output` hands over nothing."""
        convert = getattr(sink, "convert", None)
        if convert is None:
            return _UNCONVERTED
        try:
            return convert(out, result)
        except Exception:  # a consumer bug must not kill the engine for everyone
            logger.exception("sink failed for %s", out.request_id)
            return _FAILED

    def _collect_results(self, keys: list[str]) -> dict[str, dict]:
        """Fetch every worker's results and merge them (`merge_results`)."""
        per_rank = self.engine.collective_rpc("cb_collect", args=self._collect_args(keys))
        return self._merge(per_rank)

    def _collect_args(self, keys: list[str]) -> tuple:
        """`cb_collect`'s arguments: the keys, and the ring regions read since the last call."""
        acks = self.rings.take_acks() if self.rings else None
        return (keys, acks) if acks else (keys,)

    def _merge(self, per_rank: list[dict[str, dict]] | None) -> dict[str, dict]:
        """One result per key from the workers' replies, ring-held captures copied out first."""
        results, copied = self._merge_started(per_rank)
        copied()
        return results

    def _merge_started(self, per_rank: list[dict[str, dict]] | None) -> tuple[dict[str, dict], Callable[[], None]]:
        """`_merge` whose copies out of one worker's ring may still run on the ring readers'
        threads when it returns (`RingReaders.materialize_started`): no captured value may be
        read before `copied()` has returned. Several workers' replies are merged after their
        copies (merging joins the stages' values)."""
        if not per_rank:
            return {}, copied_already
        for reply in per_rank:
            expand_layouts(reply)
        if not self.rings:
            return self.merge_results(per_rank), copied_already
        use = self.capture_ranks
        started = [self.rings.materialize_started(r, copy=use is None or i in use) for i, r in enumerate(per_rank)]
        if len(started) == 1:
            return self.merge_results([started[0][0]]), started[0][1]
        for _, copied in started:
            copied()
        return self.merge_results([r for r, _ in started]), copied_already

    def _close_engine(self) -> None:
        with self._lock:
            sinks, self._sinks = list(self._sinks.values()), {}
            calls, self._calls = list(self._calls), set()
        shut = self._dead_error() if self._error is not None else EngineDeadError("the vLLM engine is shut down")
        for sink in sinks:
            sink.on_error(shut)
        for fut in calls:
            if not fut.done():
                fut.set_exception(shut)
        engine, self.engine = self.engine, None
        if engine is not None:
            try:
                engine.engine_core.shutdown()
            except Exception:  # best effort at exit
                logger.debug("engine shutdown raised", exc_info=True)


class _AddOne:
    """The command `EngineLoop.submit` queues: one request `(request_id, prompt, params, sink,
    collect_key)` to add, gathered with its queued neighbours by `_drain_commands`."""

    __slots__ = ("request",)

    def __init__(self, request: tuple) -> None:
        self.request = request

    def __call__(self) -> None:  # never run directly: `_drain_commands` adds it
        raise RuntimeError("an _AddOne command is added by EngineLoop._drain_commands")
