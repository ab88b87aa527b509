"""Rolling 64-bit checksum of the interventions a worker actually applied.

An applied action is one request's plan (`planner.RequestPlan`: every steer / patch / noise /
capture entry it composed, each vector payload identified by a digest of its exact bytes, and the
request key) applied to the rows of one step's window of positions `[p0, p1)`; a dynamic-steering
action (`engine_ext.dynamic.worker`: one request's composed policy payloads at one generated
position `p`, window `[p, p + 1)`) is one action too, folded after the plans'. Requests voided or
left untouched (capacity), and dynamic actions rejected, are not folded. Per step, the crc32 of
the ordered list of applied actions (batch order) is mixed (splitmix64) into the running value
together with the step ordinal; `action_count` counts actions. Ranks that apply the same actions
in the same order agree; `compare_ranks` reports any disagreement (never raises).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence

import numpy as np

_MASK = (1 << 64) - 1


def mix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def vector_digest(vec: np.ndarray | None) -> str:
    if vec is None:
        return "-"
    arr = np.ascontiguousarray(vec, dtype="<f4")
    return f"{'x'.join(map(str, arr.shape))}:{zlib.crc32(arr.tobytes()):08x}"


class ActionChecksum:
    def __init__(self) -> None:
        self.value = 0
        self.count = 0
        self.step = 0

    def begin_step(self) -> None:
        self.step += 1

    def fold(self, kind: str, key: str, site: int, positions: Iterable[int], vector: str = "-") -> None:
        """Fold one action described by its fields (tests and tools; the planner uses `fold_step`)."""
        self._mix(zlib.crc32(f"{kind}|{key}|{site}|{','.join(map(str, positions))}|{vector}".encode()))

    def fold_step(self, actions: Sequence[tuple[int, int, int]], step: int | None = None) -> None:
        """Fold the step's applied actions in application order: each a plan (its content digest,
        which includes the request key) or a dynamic action (its crc) applied to positions
        `[p0, p1)`. One mix per step over the crc32 of the ordered list; `action_count` grows by
        the number of actions. `step`: the ordinal of the step that applied them, when they are
        folded later (dynamic decisions taken on the device are read back a step later)."""
        arr = np.asarray(actions, dtype=np.int64)
        arr[:, 0] &= 0xFFFFFFFF
        ordinal = self.step if step is None else step
        self.value = mix64(self.value ^ ((ordinal & 0xFFFFFFFF) << 32 | zlib.crc32(arr.astype("<i8").tobytes())))
        self.count += len(actions)

    def fold_prepared(self, arr: np.ndarray) -> None:
        """`fold_step` of actions already in its form: a C-contiguous `[k, 3]` little-endian int64
        array whose digests are already masked to 32 bits (`_SteadyDecode.fold_actions`); the
        same value as `fold_step` of the same actions, without the conversions."""
        self.value = mix64(self.value ^ ((self.step & 0xFFFFFFFF) << 32 | zlib.crc32(arr.tobytes())))
        self.count += arr.shape[0]

    def _mix(self, crc: int) -> None:
        self.value = mix64(self.value ^ ((self.step & 0xFFFFFFFF) << 32 | crc))
        self.count += 1

    def status(self) -> dict:
        return {"action_checksum": f"{self.value:016x}", "action_count": self.count}


def compare_ranks(workers: Sequence[dict]) -> dict:
    """Compare the checksums of ranks that must agree: tensor-parallel ranks of one pipeline
    stage. `workers` are dicts with `tp_rank`, `pp_rank`, `action_checksum`, `action_count`.

    Returns `{"consistent": True, "action_count": N, "ranks": R}` or `{"consistent": False,
    "mismatches": {"pp<k>": {"tp<i>/pp<k>": hex}} (only the disagreeing stages), "checksums":
    {"tp<i>/pp<k>": hex} (every worker), "ranks": R}`."""
    stages: dict[int, list[dict]] = {}
    for w in workers:
        stages.setdefault(int(w.get("pp_rank", 0)), []).append(w)
    mismatches = {}
    for pp, ranks in sorted(stages.items()):
        if len({(w["action_checksum"], w["action_count"]) for w in ranks}) > 1:
            mismatches[f"pp{pp}"] = {f"tp{w.get('tp_rank', 0)}/pp{pp}": w["action_checksum"] for w in ranks}
    if mismatches:
        checksums = {f"tp{w.get('tp_rank', 0)}/pp{w.get('pp_rank', 0)}": w["action_checksum"] for w in workers}
        return {"consistent": False, "mismatches": mismatches, "checksums": checksums, "ranks": len(workers)}
    return {"consistent": True, "action_count": max((int(w["action_count"]) for w in workers), default=0),
            "ranks": len(workers)}
