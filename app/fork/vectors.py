"""The reference fork's vector wire formats, parsed into causalboard's `Steer` specs.

Two shapes carry steering vectors (`/v1/steering/set`, steering modules, and the per-request
`steering_vectors` / `prefill_steering_vectors` / `decode_steering_vectors` of
`/v1/completions`):

* the dict form `{hook: {layer: [floats] | {"vector": [floats], "scale": s}}}`;
* the packed form `{hook: {"dtype", "shape": [n_rows, hidden], "layer_indices": [...],
  "data": "<base64>", "scales"?: [...]}}` (row i is the vector of `layer_indices[i]`).

`patch_vectors` (the table that `patch[i].source_inline` indexes) is the packed form without
`layer_indices`. dtypes: float32, float16, bfloat16 (and float64). Every problem is a
`SpecError` naming the field as the client wrote it (`vectors.post_block.3`).

Hooks are causalboard's (`engine_ext.sites.HOOKS`: the fork's five, `mlp_in` and `mlp_out`
included). The fork controller's `post_mlp` alias has no counterpart here and is refused as not
supported, never silently ignored.
"""

from __future__ import annotations

import base64
import binascii
import math
from typing import Any

import numpy as np

from engine_ext.errors import SpecError
from engine_ext.specs import Steer, as_vector
from engine_ext.sites import HOOKS, Site

#: fork hooks causalboard cannot honour
UNSUPPORTED_HOOKS = ("post_mlp",)
PACKED_DTYPES = ("float32", "float16", "bfloat16", "float64")
#: fork vector tiers -> the `phase` of the Steer entries they become
TIER_PHASES = {"vectors": "both", "prefill_vectors": "prefill", "decode_vectors": "decode"}

#: JSON schema of one tier (for OpenAPI; parsing is done here, field by field)
VECTOR_SPEC_SCHEMA: dict = {
    "type": "object",
    "description": "hook -> {layer: [floats] | {'vector': [floats], 'scale': s}}, or hook -> packed "
                   "{'dtype', 'shape': [n, hidden], 'layer_indices', 'data': base64, 'scales'?}",
    "additionalProperties": {
        "anyOf": [
            {"type": "object", "additionalProperties": {"anyOf": [
                {"type": "array", "items": {"type": "number"}},
                {"type": "object", "properties": {"vector": {"type": "array", "items": {"type": "number"}},
                                                  "scale": {"type": "number"}}, "required": ["vector"]}]}},
            {"type": "object", "required": ["dtype", "shape", "layer_indices", "data"], "properties": {
                "dtype": {"enum": list(PACKED_DTYPES)}, "shape": {"type": "array", "items": {"type": "integer"}},
                "layer_indices": {"type": "array", "items": {"type": "integer"}},
                "data": {"type": "string", "description": "base64 of the little-endian rows"},
                "scales": {"type": "array", "items": {"type": "number"}}}},
        ]
    },
}


def check_hook(hook: Any, field: str) -> str:
    if hook in UNSUPPORTED_HOOKS:
        raise SpecError(field, f"hook {hook!r} is not supported by causalboard (hooks: {', '.join(HOOKS)})")
    if hook not in HOOKS:
        raise SpecError(field, f"unknown hook {hook!r}; expected one of {', '.join(HOOKS)}")
    return hook


def check_layer(layer: Any, field: str, num_layers: int) -> int:
    """A layer index from an int or a dict key string; SpecError if not in 0..num_layers-1."""
    if isinstance(layer, bool):
        raise SpecError(field, f"layer must be an integer, got {layer!r}")
    if isinstance(layer, str):
        try:
            layer = int(layer)
        except ValueError:
            raise SpecError(field, f"layer must be an integer, got {layer!r}") from None
    if not isinstance(layer, int):
        raise SpecError(field, f"layer must be an integer, got {layer!r}")
    if not 0 <= layer < num_layers:
        raise SpecError(field, f"layer {layer} is out of range: the model has layers 0..{num_layers - 1}")
    return layer


def check_vector(value: Any, field: str, hidden: int) -> np.ndarray:
    vec = as_vector(value, field)
    if vec.shape[0] != hidden:
        raise SpecError(field, f"has dimension {vec.shape[0]}, the model's hidden size is {hidden}")
    return vec


def finite_number(value: Any, field: str) -> float:
    """`value` as a float, or a SpecError naming `field` (not a number, a bool, NaN or inf)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise SpecError(field, f"must be a finite number, got {value!r}")
    return float(value)


def is_packed(value: Any) -> bool:
    return isinstance(value, dict) and "data" in value and "dtype" in value


def packed_shape(shape: Any, field: str, hidden: int) -> tuple[int, int]:
    """A packed table's `shape`: `[n_rows, hidden]` with positive integers and the model's width,
    or a SpecError naming `field`."""
    if (not isinstance(shape, list) or len(shape) != 2
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in shape)):
        raise SpecError(field, f"must be [n_rows, hidden] with positive integers, got {shape!r}")
    n, width = shape
    if width != hidden:
        raise SpecError(field, f"rows have dimension {width}, the model's hidden size is {hidden}")
    return n, width


def decode_packed(blob: Any, field: str, *, hidden: int, with_layers: bool) -> tuple[np.ndarray, list | None, list[float] | None]:
    """(rows float32 [n, hidden], layer_indices or None, scales or None) of one packed blob."""
    if not isinstance(blob, dict):
        raise SpecError(field, "must be a packed object {'dtype', 'shape', 'data', ...}")
    allowed = {"dtype", "shape", "data", "layer_indices", "scales"} if with_layers else {"dtype", "shape", "data"}
    extra = sorted(set(blob) - allowed)
    if extra:
        raise SpecError(f"{field}.{extra[0]}", "unknown field in a packed vector blob")
    dtype = blob.get("dtype")
    if dtype not in PACKED_DTYPES:
        raise SpecError(f"{field}.dtype", f"must be one of {', '.join(PACKED_DTYPES)}, got {dtype!r}")
    n, width = packed_shape(blob.get("shape"), f"{field}.shape", hidden)
    data = blob.get("data")
    if not isinstance(data, str):
        raise SpecError(f"{field}.data", "must be a base64 string")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise SpecError(f"{field}.data", "is not valid base64") from None
    itemsize = 2 if dtype in ("float16", "bfloat16") else np.dtype(dtype).itemsize
    if len(raw) != n * width * itemsize:
        raise SpecError(f"{field}.data", f"holds {len(raw)} bytes; shape {[n, width]} of {dtype} needs {n * width * itemsize}")
    if dtype == "bfloat16":
        rows = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        rows = np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<")).astype(np.float32)
    rows = rows.reshape(n, width)
    if not np.all(np.isfinite(rows)):
        raise SpecError(f"{field}.data", "contains NaN or infinite values")
    layers = scales = None
    if with_layers:
        layers = blob.get("layer_indices")
        if not isinstance(layers, list) or len(layers) != n:
            raise SpecError(f"{field}.layer_indices", f"must be a list of {n} layer indices (one per row)")
        if blob.get("scales") is not None:
            sc = blob["scales"]
            if not isinstance(sc, list) or len(sc) != n:
                raise SpecError(f"{field}.scales", f"must be a list of {n} numbers (one per row)")
            scales = [finite_number(s, f"{field}.scales[{k}]") for k, s in enumerate(sc)]
    return rows, layers, scales


def parse_vector_spec(spec: Any, field: str, *, phase: str, num_layers: int, hidden: int) -> list[Steer]:
    """One tier of fork vectors -> one single-site `Steer` per (hook, layer), at every position
    ("all") of `phase`. The fork pre-multiplies `scale` into the vector; causalboard keeps it
    as the entry's `scale` (same sum)."""
    if spec is None:
        return []
    if not isinstance(spec, dict):
        raise SpecError(field, "must be an object {hook: {layer: vector}} or {hook: packed blob}")
    out: list[Steer] = []
    for hook, per_hook in spec.items():
        hf = f"{field}.{hook}"
        check_hook(hook, hf)
        if is_packed(per_hook):
            rows, layers, scales = decode_packed(per_hook, hf, hidden=hidden, with_layers=True)
            seen: set[int] = set()
            for k, layer in enumerate(layers):
                layer = check_layer(layer, f"{hf}.layer_indices[{k}]", num_layers)
                if layer in seen:
                    raise SpecError(f"{hf}.layer_indices[{k}]", f"layer {layer} appears twice")
                seen.add(layer)
                out.append(Steer((Site(layer, hook),), rows[k], None, scales[k] if scales else 1.0, "all", phase))
            continue
        if not isinstance(per_hook, dict):
            raise SpecError(hf, "must be an object {layer: vector} or a packed blob")
        for layer_key, entry in per_hook.items():
            lf = f"{hf}.{layer_key}"
            layer = check_layer(layer_key, lf, num_layers)
            scale = 1.0
            if isinstance(entry, dict):
                extra = sorted(set(entry) - {"vector", "scale"})
                if extra:
                    raise SpecError(f"{lf}.{extra[0]}", "unknown field (a layer entry is {'vector': [...], 'scale': s})")
                if "vector" not in entry:
                    raise SpecError(f"{lf}.vector", "required field is missing")
                scale = finite_number(entry.get("scale", 1.0), f"{lf}.scale")
                vec = check_vector(entry["vector"], f"{lf}.vector", hidden)
            else:
                vec = check_vector(entry, lf, hidden)
            out.append(Steer((Site(layer, hook),), vec, None, scale, "all", phase))
    return out


def parse_patch_vectors(value: Any, field: str, *, hidden: int) -> np.ndarray | None:
    """The fork's `patch_vectors` table (packed, no layer_indices) -> float32 [n_rows, hidden]."""
    if value is None:
        return None
    rows, _, _ = decode_packed(value, field, hidden=hidden, with_layers=False)
    return rows


def pack_vectors(rows: np.ndarray, layer_indices: list[int] | None = None, dtype: str = "float32") -> dict:
    """The packed form of `rows` [n, hidden] (what a fork client sends; used by tests and docs).
    `dtype`: float32, float16 or float64 (numpy has no bfloat16)."""
    arr = np.ascontiguousarray(np.atleast_2d(rows), dtype=np.dtype(dtype).newbyteorder("<"))
    blob: dict = {"dtype": dtype, "shape": list(arr.shape), "data": base64.b64encode(arr.tobytes()).decode("ascii")}
    if layer_indices is not None:
        blob["layer_indices"] = list(layer_indices)
    return blob
