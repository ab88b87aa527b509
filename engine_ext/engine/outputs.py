"""Per-request plumbing between the engine loop and callers: the prepared vLLM request
(`Prepared`), the sinks that receive a request's outputs on the loop thread (`QueueSink` for
threads; `AsyncSink` for asyncio, delivered through the event loop's `LoopMailbox`; `BatchSink`
for a batch of requests awaited from asyncio) and the conversion of vLLM `RequestOutput`s into
plain `GenerationDelta`s (no vLLM type leaves this package)."""

from __future__ import annotations

import asyncio
import functools
import queue
import threading
from dataclasses import dataclass
from typing import Any

from engine_ext.dynamic import trace as dynamic_trace
from engine_ext.errors import EngineDeadError
from engine_ext.generation import GenerationDelta, InterventionResult
from engine_ext.sites import SitePosition, site_from_index


class QueueSink:
    """Sync sink: deltas go to a thread-safe queue."""

    def __init__(self, convert):
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self._convert = convert

    def on_output(self, output: Any, worker_result: dict | None = None) -> None:
        self.q.put(self._convert(output, worker_result))

    def convert(self, output: Any, worker_result: dict | None = None) -> Any:
        """`on_output` in two parts (the loop builds items while captured values are copied out,
        and hands them over once they are): the item, then `put`."""
        return self._convert(output, worker_result)

    def put(self, item: Any) -> None:
        self.q.put(item)

    def on_error(self, error: BaseException) -> None:
        self.q.put(error)


class LoopMailbox:
    """Deliveries from the engine loop thread to one asyncio event loop, woken once per burst.

    `post(fn, item)` (any thread) queues `fn(item)` to run on the event loop; the first post after
    a delivery schedules one `call_soon_threadsafe`, later ones join its batch. So the requests
    that finish in one engine step (768 one-token completions over HTTP) cost the caller's loop one
    wake-up, not one each, and the loop thread one self-pipe write instead of 768 (each of which
    also woke the event loop's thread to contend for the GIL). Calls run in posting order: one
    request's items keep their order. A closed event loop drops what is posted to it (nobody
    listens any more). One mailbox per event loop: `for_loop`; `AsyncSink` and `BatchSink` post through it."""

    _by_loop: dict = {}
    _registry_lock = threading.Lock()

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[Any, Any]] = []
        self._waking = False  # a delivery is scheduled on the loop and has not started yet

    @classmethod
    def for_loop(cls, loop: asyncio.AbstractEventLoop) -> "LoopMailbox":
        """The mailbox of `loop` (created on first use; mailboxes of closed loops are forgotten)."""
        box = cls._by_loop.get(loop)
        if box is None:
            with cls._registry_lock:
                box = cls._by_loop.get(loop)
                if box is None:
                    for old in [lp for lp in cls._by_loop if lp.is_closed()]:
                        del cls._by_loop[old]
                    box = cls._by_loop[loop] = cls(loop)
        return box

    def post(self, fn, item: Any) -> None:
        with self._lock:
            self._items.append((fn, item))
            if self._waking:
                return
            self._waking = True
        try:
            self._loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, []
            self._waking = False
        for fn, item in items:
            fn(item)


class AsyncSink:
    """Async sink: deltas are posted onto the caller's event loop (through its `LoopMailbox`)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, convert):
        self.q: asyncio.Queue = asyncio.Queue()
        self._box = LoopMailbox.for_loop(loop)
        self._convert = convert

    def on_output(self, output: Any, worker_result: dict | None = None) -> None:
        self._box.post(self.q.put_nowait, self._convert(output, worker_result))

    def convert(self, output: Any, worker_result: dict | None = None) -> Any:
        return self._convert(output, worker_result)

    def put(self, item: Any) -> None:
        self._box.post(self.q.put_nowait, item)

    def on_error(self, error: BaseException) -> None:
        self._box.post(self.q.put_nowait, error)


class BatchSink:
    """Async sink shared by the requests of one batch (`Engine.agenerate_many`): each request
    gets a `member(index, convert)`; their deltas (and errors) reach the caller's event loop through
    its `LoopMailbox` (one wake-up per burst, shared with every other sink of that loop) and are
    kept in one list there. `get` returns every `(index, item)` received since the last call; an
    engine failure comes as `(None, EngineDeadError)`."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._box = LoopMailbox.for_loop(loop)
        self._items: list[tuple[int | None, Any]] = []  # touched on the event loop only
        self._ready = asyncio.Event()

    def member(self, index: int, convert) -> "_BatchMember":
        return _BatchMember(self, index, convert)

    def post(self, index: int | None, item: Any) -> None:
        """Loop thread: send one item to the caller's event loop."""
        self._box.post(self._receive, (index, item))

    def _receive(self, entry: tuple[int | None, Any]) -> None:
        self._items.append(entry)
        self._ready.set()

    async def get(self) -> list[tuple[int | None, Any]]:
        """Wait for news; return (and forget) everything received so far, oldest first."""
        while not self._items:
            await self._ready.wait()
            self._ready.clear()
        items, self._items = self._items, []
        return items


class _BatchMember:
    """One request of a `BatchSink` (the loop's per-request `Sink`)."""

    __slots__ = ("_batch", "_index", "_convert")

    def __init__(self, batch: BatchSink, index: int, convert):
        self._batch, self._index, self._convert = batch, index, convert

    def on_output(self, output: Any, worker_result: dict | None = None) -> None:
        self._batch.post(self._index, self._convert(output, worker_result))

    def convert(self, output: Any, worker_result: dict | None = None) -> Any:
        return self._convert(output, worker_result)

    def put(self, item: Any) -> None:
        self._batch.post(self._index, item)

    def on_error(self, error: BaseException) -> None:
        # the engine's death ends the whole batch; anything else (vLLM refused this request) is this item's
        self._batch.post(None if isinstance(error, EngineDeadError) else self._index, error)


def delta_from_output(output: Any, worker_result: dict | None, top_k: int, score_ids: tuple[int, ...],
                      program_hash: str | None, chosen: bool = True, dynamic_policies: Any = None) -> GenerationDelta:
    """Convert a vLLM `RequestOutput` (DELTA: what one step added; FINAL_ONLY: everything) and,
    at the end, the workers' result. `chosen`: report the chosen tokens' logprobs.
    `dynamic_policies`: a callable returning the request's dynamic wire policies in their API
    JSON (what a dynamic result's `policy_index` refers to), or None."""
    comp = output.outputs[0]
    logprobs: list[float] = []
    tops: list[dict[int, float]] = []
    scores: list[dict[int, float]] = []
    for tid, step in zip(comp.token_ids, comp.logprobs or []):
        if chosen:
            logprobs.append(float(step[tid].logprob))
        if top_k:
            # vLLM adds the sampled token to the top-k even when it ranks lower; keep the top-k only
            tops.append({int(t): float(lp.logprob) for t, lp in step.items() if lp.rank <= top_k})
        if score_ids:
            scores.append({t: float(step[t].logprob) for t in score_ids})
    return GenerationDelta(
        token_ids=list(comp.token_ids),
        text=comp.text,
        logprobs=logprobs,
        top_logprobs=tops,
        finished=bool(output.finished),
        finish_reason=comp.finish_reason,
        scores=scores,
        intervention=(_intervention_result(worker_result, program_hash, dynamic_policies)
                      if worker_result is not None else None),
        num_cached_tokens=int(output.num_cached_tokens or 0) if output.finished else None,
    )


def _intervention_result(res: dict, program_hash: str | None, dynamic_policies: Any = None) -> InterventionResult:
    import numpy as np

    caps = {}
    block = res.get("captures")
    if block and block["keys"]:
        keys = block["keys"]
        # one array for the whole block, each key's value a row of it; a writable buffer (an
        # in-process worker's bytearray) is used as is, read-only bytes (from another process)
        # are copied once so that every value is an ordinary writable array
        values = np.frombuffer(block["data"], dtype="<f4").reshape(len(keys), -1)
        if not values.flags.writeable:
            values = values.copy()
        caps = dict(zip(_site_positions(keys), values))
    errors = list(res.get("errors") or [])
    if res.get("store_error"):
        errors.append(res["store_error"])
    return InterventionResult(status=res.get("status", "unknown"), errors=errors, captures=caps,
                              stored_as=res.get("stored_as"), evicted=list(res.get("evicted") or []),
                              program_hash=program_hash,
                              dynamic=_dynamic(res.get("dynamic"), dynamic_policies),
                              segment_scores=res.get("segment_scores"))


def _dynamic(dyn: dict | None, policies: Any) -> dict | None:
    """A worker's dynamic result in its public form (`dynamic.trace.expand`)."""
    if dyn is None:
        return None
    return dynamic_trace.expand(dyn, policies() if policies is not None and "policy_index" in dyn else None)


#: the last capture block's keys (the list itself, and a copy) and their `SitePosition`s (the
#: results of a batch share them: one list for a whole reply, `collect_reply.expand_layouts`)
_LAST_KEYS: tuple[list | None, list, list[SitePosition]] = (None, [], [])


def _site_positions(keys: list) -> list[SitePosition]:
    """A capture block's `[site, position]` keys as `SitePosition`s (the last block's answer
    reused for the same list, or equal keys: ~2 µs a result of P3's 16 keys)."""
    global _LAST_KEYS
    last = _LAST_KEYS
    if keys is last[0] or keys == last[1]:
        return last[2]
    out = [_site_position(s, p) for s, p in keys]
    _LAST_KEYS = (keys, [list(k) for k in keys], out)
    return out


@functools.lru_cache(maxsize=1 << 16)
def _site_position(site_idx: int, pos: int) -> SitePosition:
    """The capture key of a flat site index and a position (cached: keys are immutable, and a
    capture block repeats the same few per request)."""
    site = site_from_index(int(site_idx))
    return SitePosition(site.layer, site.hook, int(pos))


@dataclass
class Prepared:
    text: str | None
    ids: list[int]
    sampling: Any
    key: str | None = None
    program_hash: str | None = None
    cache_salt: str | None = None
    #: its dynamic steering's wire policies in their API JSON (a callable, computed once per
    #: wire: `Engine`'s `_DynamicWire.policies_api`), None without dynamic steering
    dynamic_policies: Any = None

    def prompt(self) -> dict:
        p: dict = {"prompt_token_ids": self.ids}
        if self.cache_salt:
            p["cache_salt"] = self.cache_salt
        return p
