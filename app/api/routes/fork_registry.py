"""Routes: the reference fork's named probe/steer vector registry (see app/api/routes/__init__.py).

* `POST /v1/steering/vectors/register` — `{"name", "kind": "probe" | "steer", "packed": {hook:
  packed}}` → `{"status": "ok", "name", "kind", "vectors": {"probe": [names], "steer": [names]}}`;
  registering a name again replaces it; a probe names exactly one (hook, layer).
* `POST /v1/steering/vectors/unregister` — `{"name", "kind"}` → the same shape; 404 (with the
  listing) when absent.
* `GET /v1/steering/vectors` lists it (in `steering.py`: that listing also carries causalboard's
  named vectors).

The names are what the declarative steering gates (the `steering` field of `/v1/completions` and
`/v1/chat/completions`, `app/fork/gates.py`) reference: `{"kind": "name", "name": ...}` as a
gate's probe (kind `probe`) or its `add` vector (kind `steer`). The registry validates the vectors
(hooks, layers, hidden size, finite values, exactly the fork's rules) and keeps, per name, a content
digest: a `rest_of_conversation` gate latches the name and that digest, and a later turn of the
conversation is steered only while the name still resolves to the same content (re-registering it
with other values, or unregistering it, disengages the latch). Unlike the fork, registering needs
the API key when the server has one (every mutating endpoint does).
"""

from __future__ import annotations

import threading
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from engine_ext import Engine
from engine_ext.specs import check_safe_name

from app.api.auth import UNAUTHORIZED, require_api_key
from app.fork.gates import digest, packed_rows
from app.api.deps import get_engine, state_singleton
from app.api.schemas.generation import ErrorResponse
from app.wire import StrictModel

router = APIRouter(tags=["steering"])

KINDS = ("probe", "steer")
_ERR = {"model": ErrorResponse}
RESPONSES = {400: _ERR, 404: _ERR, **{k: {**v, **_ERR} for k, v in UNAUTHORIZED.items()}}


class RegisterVectorRequest(StrictModel):
    name: str = Field(..., min_length=1, max_length=200, description="Unique name within its kind.")
    kind: Literal["probe", "steer"] = Field(description="'probe' (a gate's condition) or 'steer' (a gate's action).")
    packed: dict[str, Any] = Field(description="{hook: {dtype, shape: [n, hidden], layer_indices, data: base64, scales?}}; "
                                                "a probe resolves to exactly one (hook, layer).")


class UnregisterVectorRequest(StrictModel):
    name: str = Field(..., min_length=1, max_length=200)
    kind: Literal["probe", "steer"]


class RegistryResponse(BaseModel):
    status: Literal["ok"] = "ok"
    name: str
    kind: str
    vectors: dict[str, list[str]] = Field(description="Registered names per kind: {'probe': [...], 'steer': [...]}.")


class VectorRegistry:
    """The fork's two namespaces of named vectors: kind -> name -> {(hook, layer): vector}."""

    def __init__(self) -> None:
        self._vectors: dict[str, dict[str, dict[tuple[str, int], np.ndarray]]] = {k: {} for k in KINDS}
        self._digests: dict[str, dict[str, str]] = {k: {} for k in KINDS}
        self._lock = threading.Lock()

    def register(self, name: str, kind: str, rows: dict[tuple[str, int], np.ndarray]) -> None:
        with self._lock:
            self._vectors[kind][name] = rows
            self._digests[kind][name] = digest(rows)

    def unregister(self, name: str, kind: str) -> bool:
        with self._lock:
            self._digests[kind].pop(name, None)
            return self._vectors[kind].pop(name, None) is not None

    def get(self, name: str, kind: str) -> dict[tuple[str, int], np.ndarray] | None:
        return self._vectors[kind].get(name)

    def resolve(self, name: str, kind: str) -> tuple[dict[tuple[str, int], np.ndarray], str] | None:
        """The rows of `name` and their content digest, or None when absent."""
        with self._lock:
            rows = self._vectors[kind].get(name)
            return None if rows is None else (rows, self._digests[kind][name])

    def listing(self) -> dict[str, list[str]]:
        with self._lock:
            return {k: sorted(v) for k, v in self._vectors.items()}

    def count(self) -> int:
        return sum(len(v) for v in self._vectors.values())


def registry_of(request: Request) -> VectorRegistry:
    """The app's registry (created on first use)."""
    return registry_of_state(request.app.state)


def registry_of_state(state: Any) -> VectorRegistry:
    """The registry kept on `app.state` (created on first use)."""
    return state_singleton(state, "fork_vector_registry", VectorRegistry)


def decode_rows(packed: Any, kind: str, eng: Engine) -> dict[tuple[str, int], np.ndarray]:
    """The packed spec as {(hook, layer): float32 vector} (scales folded in), checked like the
    fork's registry: known hooks, model layers, hidden size, finite values; a probe is one row."""
    return packed_rows(packed, "packed", kind, num_layers=eng.info.num_layers, hidden=eng.info.hidden_size)


@router.post("/v1/steering/vectors/register", response_model=RegistryResponse, responses=RESPONSES,
             dependencies=[Depends(require_api_key)], summary="Register a named probe/steer vector (fork)")
def register_vector(req: RegisterVectorRequest, request: Request, eng: Engine = Depends(get_engine)) -> RegistryResponse:
    """Register (or replace) a named probe/steer vector in the fork's registry (names in the same
    safe character set as every other name: 400 naming `name`)."""
    check_safe_name(req.name, "name")
    rows = decode_rows(req.packed, req.kind, eng)
    reg = registry_of(request)
    reg.register(req.name, req.kind, rows)
    return RegistryResponse(name=req.name, kind=req.kind, vectors=reg.listing())


@router.post("/v1/steering/vectors/unregister", response_model=RegistryResponse, responses=RESPONSES,
             dependencies=[Depends(require_api_key)], summary="Unregister a named probe/steer vector (fork)")
def unregister_vector(req: UnregisterVectorRequest, request: Request, eng: Engine = Depends(get_engine)):
    """Remove a named vector; 404 (with the current listing) when absent."""
    reg = registry_of(request)
    if not reg.unregister(req.name, req.kind):
        return JSONResponse({"error": f"name: {req.kind} vector '{req.name}' not found.", "field": "name",
                             "vectors": reg.listing()}, status_code=404)
    return RegistryResponse(name=req.name, kind=req.kind, vectors=reg.listing())
