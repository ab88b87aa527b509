"""A vLLM `LLMEngine` driven by one background thread.

Contract: every call into the engine (build, add_request, step, abort, collective_rpc) happens on
the loop thread, so callers on any thread or event loop can submit work concurrently and vLLM's
scheduler batches it (continuous batching). Outputs are handed to per-request `Sink`s on the loop
thread; sinks must not block. A failing `add_request` fails only that request; a failing `step`
kills the loop and fails every in-flight request with `EngineDeadError`.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

from engine_ext.errors import EngineDeadError

logger = logging.getLogger("causalboard.engine")


class Sink(Protocol):
    """Receives one request's outputs on the loop thread."""

    def on_output(self, output: Any, worker_result: dict | None = None) -> None: ...  # a vllm RequestOutput

    def on_error(self, error: BaseException) -> None: ...


class EngineLoop:
    def __init__(self, build_engine: Callable[[], Any], name: str = "causalboard-engine"):
        self._build_engine = build_engine
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._collect: dict[str, str] = {}  # request id -> causalboard key to collect at finish
        self._ready = threading.Event()
        self._stopping = False
        self._error: BaseException | None = None
        self.engine: Any = None
        #: makes one result per request key of the workers' `cb_collect` replies (rank order);
        #: the facade sets it from the topology (several ranks), rank 0's reply otherwise
        self.merge_results: Callable[[list[dict[str, dict]]], dict[str, dict]] = lambda per_rank: per_rank[0]
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Build the engine on the loop thread; re-raise its build error here."""
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def shutdown(self) -> None:
        if not self._thread.is_alive():
            return
        self._stopping = True
        self._commands.put(lambda: None)  # wake the loop
        self._thread.join(timeout=60)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._error is None and not self._stopping

    @property
    def in_flight(self) -> int:
        return len(self._sinks)

    # ---- submission (any thread) -------------------------------------------------------------
    def submit(self, request_id: str, prompt: Any, params: Any, sink: Sink, collect_key: str | None = None) -> None:
        """Add a request. With `collect_key`, the workers' result for it (captures, voided
        status) is fetched when it finishes and handed to the sink with the final output."""
        self._check_alive()

        def add() -> None:
            try:
                self.engine.add_request(request_id, prompt, params)
            except Exception as exc:  # refused by vLLM: only this request fails
                sink.on_error(exc)
                return
            self._sinks[request_id] = sink
            if collect_key is not None:
                self._collect[request_id] = collect_key

        self._commands.put(add)

    def submit_many(self, requests: list[tuple[str, Any, Any, Sink, str | None]]) -> None:
        """Add several requests `(request_id, prompt, params, sink, collect_key)` with one command
        (one wake-up of the loop thread): what `submit` does for each."""
        self._check_alive()

        def add_all() -> None:
            for request_id, prompt, params, sink, collect_key in requests:
                try:
                    self.engine.add_request(request_id, prompt, params)
                except Exception as exc:  # refused by vLLM: only this request fails
                    sink.on_error(exc)
                    continue
                self._sinks[request_id] = sink
                if collect_key is not None:
                    self._collect[request_id] = collect_key

        self._commands.put(add_all)

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if it already finished). Its sink gets no further output."""
        if not self.alive:
            return

        def abort() -> None:
            if self._sinks.pop(request_id, None) is not None:
                self.engine.abort_request([request_id])
            key = self._collect.pop(request_id, None)
            if key is not None:  # drop the worker-side result nobody will read
                self._collect_results([key])

        self._commands.put(abort)

    def call(self, fn: Callable[[Any], Any]) -> Future:
        """Run `fn(engine)` on the loop thread between steps; the Future holds its result."""
        self._check_alive()
        fut: Future = Future()

        def run() -> None:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.engine))
                except BaseException as exc:
                    fut.set_exception(exc)

        self._commands.put(run)
        return fut

    # ---- loop thread -----------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the vLLM engine stopped: {self._error!r}")
        if self._stopping or not self._thread.is_alive():
            raise EngineDeadError("the vLLM engine is shut down")

    def _run(self) -> None:
        try:
            self.engine = self._build_engine()
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            while not self._stopping:
                self._drain_commands(block=not self.engine.has_unfinished_requests())
                if self._stopping:
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
        except BaseException as exc:
            logger.exception("engine loop failed")
            self._error = exc
            dead = EngineDeadError(f"the vLLM engine stopped: {exc!r}")
            for sink in self._sinks.values():
                sink.on_error(dead)
            self._sinks.clear()
        finally:
            self._close_engine()

    def _drain_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            cmd()
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _step(self) -> None:
        outs = self.engine.step()
        keys = [self._collect[o.request_id] for o in outs if o.finished and o.request_id in self._collect]
        results = self._collect_results(keys) if keys else {}
        for out in outs:
            sink = self._sinks.get(out.request_id)
            if sink is None:  # aborted meanwhile
                continue
            result = None
            if out.finished:
                del self._sinks[out.request_id]
                key = self._collect.pop(out.request_id, None)
                if key is not None:
                    result = results.get(key, {"status": "unknown", "errors": ["no worker result"]})
            try:
                sink.on_output(out, result)
            except Exception:  # a consumer bug must not kill the engine for everyone
                logger.exception("sink failed for %s", out.request_id)

    def _collect_results(self, keys: list[str]) -> dict[str, dict]:
        """Fetch every worker's results and merge them (`merge_results`)."""
        per_rank = self.engine.collective_rpc("cb_collect", args=(keys,))
        return self.merge_results(per_rank) if per_rank else {}

    def _close_engine(self) -> None:
        for sink in self._sinks.values():
            sink.on_error(EngineDeadError("the vLLM engine is shut down"))
        self._sinks.clear()
        engine, self.engine = self.engine, None
        if engine is not None:
            try:
                engine.engine_core.shutdown()
            except Exception:  # best effort at exit
                logger.debug("engine shutdown raised", exc_info=True)
