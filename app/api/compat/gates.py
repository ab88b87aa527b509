"""The fork's declarative gates on a completion: the request's `GateSet` (its gates, its own
static decode steering for `attenuate`, and a latched conversation's bridge) and the
`rest_of_conversation` latches, kept by the app per `conversation_id` (by reference: the steer
vector's registered name, its content digest and the gate's strength; never the vectors).

A latch is recorded when a request whose `rest_of_conversation` add gate fired completes; a later
request of the conversation is bridged (steered with the latched vectors from its first
evaluation on, its own gates not evaluated, as in the fork) while every referenced name still
resolves to the same digest; otherwise the latch is dropped and the request runs its own gates.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from engine_ext import Generation
from engine_ext.dynamic.gates import Gate, GateSet

from engine_ext.dynamic.gates import SiteVectors
from app.api.deps import state_singleton
from app.fork.gates import site_vectors

#: conversations whose latches are remembered (least recently used dropped beyond)
MAX_CONVERSATIONS = 4096


class ConversationLatches:
    """conversation_id -> [(steer name, digest, strength)], a bounded LRU."""

    def __init__(self, max_conversations: int = MAX_CONVERSATIONS) -> None:
        self._latches: OrderedDict[str, list[tuple[str, str, float]]] = OrderedDict()
        self._max = max_conversations
        self._lock = threading.Lock()

    def get(self, cid: str) -> list[tuple[str, str, float]] | None:
        with self._lock:
            refs = self._latches.get(cid)
            if refs is not None:
                self._latches.move_to_end(cid)
            return refs

    def set(self, cid: str, refs: list[tuple[str, str, float]]) -> None:
        with self._lock:
            self._latches[cid] = refs
            self._latches.move_to_end(cid)
            while len(self._latches) > self._max:
                self._latches.popitem(last=False)

    def drop(self, cid: str) -> None:
        with self._lock:
            self._latches.pop(cid, None)

    def __len__(self) -> int:
        return len(self._latches)


def latches_of(state: Any) -> ConversationLatches:
    """The app's latches (`app.state`), created on first use."""
    return state_singleton(state, "fork_gate_latches", ConversationLatches)


def bridge(cid: str | None, registry, latches: ConversationLatches) -> tuple[tuple[SiteVectors, float], ...]:
    """The latched vectors of conversation `cid` when every reference still resolves to its
    digest; else () (and a stale latch is dropped: the conversation disengages)."""
    if cid is None:
        return ()
    refs = latches.get(cid)
    if not refs:
        return ()
    parts = []
    for name, dig, strength in refs:
        got = registry.resolve(name, "steer")
        if got is None or got[1] != dig:
            latches.drop(cid)
            return ()
        parts.append((site_vectors(got[0]), strength))
    return tuple(parts)


def gate_set(gates: list[Gate] | None, static: SiteVectors | None, cid: str | None, registry,
             latches: ConversationLatches) -> GateSet | None:
    """A request's gate set, or None when it has no gates and no bridge."""
    parts = bridge(cid, registry, latches)
    if not gates and not parts:
        return None
    return GateSet(tuple(gates or ()), static, parts)


def record(gen: Generation, cid: str | None, latches: ConversationLatches) -> None:
    """After a request: latch its conversation when a rest_of_conversation add gate fired."""
    iv = gen.intervention
    dyn = iv.dynamic if iv is not None else None
    if cid is None or not dyn or not dyn.get("gates") or iv.voided:
        return
    refs = dyn["gates"].get("latch") or []
    if refs:
        latches.set(cid, [(str(n), str(d), float(s)) for n, d, s in refs])
