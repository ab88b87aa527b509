"""Recording CUDA events on the current stream without torch's per-call device lookup.

`torch.cuda.Event.record()` with no stream calls `torch.cuda.current_stream()`, which resolves the
current device through `torch.cuda.is_available()` (an NVML query) and builds a new `Stream`
wrapper on every call: ~10 µs of host time per record on an H200 host
(`benchmarks/diag/op_costs.py`), and causalboard records a few events every decode step, whose
host time sets the step's pace once the engine is host-bound (docs/performance.md, "Twenty-eighth
session"). `record(event, index)` asks for the calling thread's current stream of a known device
index and reuses one wrapper while that stream stays the same: the event is recorded on exactly
the stream `event.record()` would have used.
"""

from __future__ import annotations

import torch

#: device index -> the wrapper of the stream last seen current there
_last: dict[int, torch.cuda.Stream] = {}


def device_index(device: torch.device) -> int:
    """The CUDA device index of `device` (its own, else the current device's)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def current_stream(index: int) -> torch.cuda.Stream:
    """The calling thread's current stream on device `index`, as `torch.cuda.current_stream(index)`
    returns it (the same stream id), without building a wrapper when it did not change."""
    stream_id, dev, dev_type = torch._C._cuda_getCurrentStream(index)
    s = _last.get(index)
    if s is None or s.stream_id != stream_id or s.device_index != dev:
        s = _last[index] = torch.cuda.Stream(stream_id=stream_id, device_index=dev, device_type=dev_type)
    return s


def record(event: torch.cuda.Event, index: int) -> None:
    """`event.record()` on the current stream of device `index`."""
    event.record(current_stream(index))
