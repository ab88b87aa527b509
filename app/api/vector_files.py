"""Decode an uploaded steering-vector file: `.npy` or `.safetensors`, told apart by magic bytes.

* `.npy` (numpy's format; never unpickled): a float array of shape `[hidden]` or `[1, hidden]`.
* `.safetensors`: exactly one tensor, or a tensor named `vector`; F32, F16, BF16 or F64, shape
  `[hidden]` or `[1, hidden]`. Parsed here (header + raw bytes), so bfloat16 works without torch.

`decode_vector_file(data)` returns a float32 vector or raises `VectorFileError` (status 415 for
an unknown format, 400 otherwise) naming `body`. Dimension and finiteness are checked by the
caller against the model.
"""

from __future__ import annotations

import io
import json
import struct

import numpy as np

NPY_MAGIC = b"\x93NUMPY"
_ST_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "F64": np.dtype("<f8")}
_MAX_HEADER = 1 << 20


class VectorFileError(ValueError):
    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.message = message
        self.status = status


def sniff_format(data: bytes) -> str | None:
    """'npy', 'safetensors' or None, from the first bytes."""
    if data.startswith(NPY_MAGIC):
        return "npy"
    if len(data) >= 9:
        (n,) = struct.unpack("<Q", data[:8])
        if 2 <= n <= min(_MAX_HEADER, len(data) - 8) and data[8:9] == b"{":
            return "safetensors"
    return None


def decode_vector_file(data: bytes) -> np.ndarray:
    fmt = sniff_format(data)
    if fmt == "npy":
        arr = _load_npy(data)
    elif fmt == "safetensors":
        arr = _load_safetensors(data)
    else:
        raise VectorFileError("the body is neither a .npy nor a .safetensors file (checked by magic bytes)", 415)
    if arr.ndim == 2 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim != 1 or arr.size == 0:
        raise VectorFileError(f"the file's array has shape {list(arr.shape)}; expected [hidden] or [1, hidden]")
    return np.ascontiguousarray(arr, dtype=np.float32)


def _load_npy(data: bytes) -> np.ndarray:
    try:
        arr = np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise VectorFileError(f"not a readable .npy file ({exc})") from None
    if arr.dtype.kind != "f":
        raise VectorFileError(f"the .npy array has dtype {arr.dtype}; expected a float dtype")
    return arr


def _load_safetensors(data: bytes) -> np.ndarray:
    (n,) = struct.unpack("<Q", data[:8])
    try:
        header = json.loads(data[8:8 + n])
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise VectorFileError(f"the .safetensors header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise VectorFileError("the .safetensors header is not an object")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    if "vector" in tensors:
        name = "vector"
    elif len(tensors) == 1:
        name = next(iter(tensors))
    else:
        raise VectorFileError(f"the .safetensors file holds {len(tensors)} tensors ({', '.join(sorted(tensors)[:5])}); "
                              "it must hold exactly one, or one named 'vector'")
    info = tensors[name]
    try:
        dtype, shape, (start, end) = info["dtype"], [int(d) for d in info["shape"]], info["data_offsets"]
    except (KeyError, TypeError, ValueError):
        raise VectorFileError(f"tensor {name!r}: malformed header entry") from None
    body = data[8 + n:]
    if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= len(body)):
        raise VectorFileError(f"tensor {name!r}: data offsets {[start, end]} are outside the file")
    raw = body[start:end]
    count = int(np.prod(shape)) if shape else 1
    if dtype == "BF16":
        if len(raw) != 2 * count:
            raise VectorFileError(f"tensor {name!r}: {len(raw)} bytes for shape {shape} of BF16")
        arr = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    elif dtype in _ST_DTYPES:
        dt = _ST_DTYPES[dtype]
        if len(raw) != dt.itemsize * count:
            raise VectorFileError(f"tensor {name!r}: {len(raw)} bytes for shape {shape} of {dtype}")
        arr = np.frombuffer(raw, dtype=dt)
    else:
        raise VectorFileError(f"tensor {name!r} has dtype {dtype}; expected F32, F16, BF16 or F64")
    return arr.reshape(shape)
