"""Worker-side store of captured source runs, for patching.

A run is stored whole (all its captured (site, position) values) and evicted whole, least
recently used first, to stay within a byte budget. A run is *leased* while any in-flight
request (or a client, e.g. a sweep) references it; leased runs are never evicted. Values are
kept on the host as the exact (hidden, residual) pair vLLM carries, in the model dtype, so that
writing them back reproduces the source run bit-exactly. A run's values are two contiguous
`[values, hidden]` tensors, so that the planner gathers many of them with one indexing op.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from typing import NamedTuple

import torch

_UIDS = itertools.count(1)


class RunRows(NamedTuple):
    """A run's pairs already stacked, as `SourceRun` holds them: `x[i]`, `r[i]` at the (site,
    position) `keys[i]` (each key once). The store keeps these tensors: they must not be views of
    a buffer that is reused."""

    keys: list[tuple[int, int]]
    x: torch.Tensor
    r: torch.Tensor


#: what `SourceStore.put` takes: (site, position) -> (x, r), or the rows already stacked
RunValues = dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] | RunRows


class SourceRun:
    """One stored run: `x[i]`, `r[i]` is the pair at the (site, position) `keys[i]`."""

    def __init__(self, run_id: str, values: RunValues):
        self.run_id = run_id
        #: unique per stored content (a run stored again under the same id gets a new uid)
        self.uid = next(_UIDS)
        if isinstance(values, RunRows):
            self.keys, self.x, self.r = list(values.keys), values.x, values.r
        else:
            self.keys = list(values)
            pairs = list(values.values())
            self.x = torch.stack([p[0] for p in pairs]) if pairs else torch.zeros(0)
            self.r = torch.stack([p[1] for p in pairs]) if pairs else torch.zeros(0)
        self.row_of = {k: i for i, k in enumerate(self.keys)}
        self.nbytes = self.x.numel() * self.x.element_size() + self.r.numel() * self.r.element_size()
        self.created = time.time()
        self.leases = 0
        #: bytes it counts against the store's budget (its own bytes unless the store says)
        self.charge = self.nbytes
        self._on: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """`(x, r)` on `device`, copied there once (a cache while the run is stored) so that
        patch values are gathered on the device instead of uploaded per request."""
        if device.type == "cpu":
            return self.x, self.r
        key = str(device)
        pair = self._on.get(key)
        if pair is None:
            pair = self._on[key] = (self.x.to(device), self.r.to(device))
        return pair

    def value(self, site: int, pos: int) -> "StoredPair | None":
        row = self.row_of.get((site, pos))
        return None if row is None else StoredPair(self, row)


class StoredPair(NamedTuple):
    """One stored (x, r) pair: row `row` of `run`."""

    run: SourceRun
    row: int

    @property
    def x(self) -> torch.Tensor:
        return self.run.x[self.row]

    @property
    def r(self) -> torch.Tensor:
        return self.run.r[self.row]

    @property
    def ident(self) -> tuple[str, int, int]:
        """Identity of the stored content, equal on every rank that stored the same runs."""
        return (self.run.run_id, self.run.uid, self.row)


class SourceStoreFull(RuntimeError):
    pass


class SourceStore:
    def __init__(self, budget_bytes: int):
        self.budget = int(budget_bytes)
        self._runs: OrderedDict[str, SourceRun] = OrderedDict()
        self.evictions = 0

    @property
    def used_bytes(self) -> int:
        return sum(r.charge for r in self._runs.values())

    def __contains__(self, run_id: str) -> bool:
        return run_id in self._runs

    def put(self, run_id: str, values: RunValues, charge: int | None = None) -> list[str]:
        """Store (or replace) a run; returns the run ids evicted to make room. The run counts
        against the budget with `charge` bytes when given (a pipeline stage charges the whole
        run, not its own share, so that every stage evicts the same runs), else its own bytes.
        Raises SourceStoreFull if it cannot fit even after evicting every unleased run."""
        pairs = [(values.x, values.r)] if isinstance(values, RunRows) else values.values()
        own = sum(x.numel() * x.element_size() + r.numel() * r.element_size() for x, r in pairs)
        nbytes = own if charge is None else int(charge)
        old = self._runs.pop(run_id, None)
        leases = old.leases if old else 0
        evicted: list[str] = []
        for rid in list(self._runs):
            if self.used_bytes + nbytes <= self.budget:
                break
            if self._runs[rid].leases == 0:
                del self._runs[rid]
                evicted.append(rid)
        self.evictions += len(evicted)
        if self.used_bytes + nbytes > self.budget:
            raise SourceStoreFull(f"source run {run_id!r} needs {nbytes} bytes; store budget {self.budget}, "
                                  f"{self.used_bytes} held by leased runs")
        run = SourceRun(run_id, values)
        run.leases = leases
        run.charge = nbytes
        self._runs[run_id] = run
        return evicted

    def get(self, run_id: str) -> SourceRun | None:
        run = self._runs.get(run_id)
        if run is not None:
            self._runs.move_to_end(run_id)
        return run

    def value(self, run_id: str, site: int, pos: int) -> StoredPair | None:
        """A stored value, without touching the run's recency (`get` does that)."""
        run = self._runs.get(run_id)
        return run.value(site, pos) if run else None

    def mean(self, run_id: str, site: int) -> torch.Tensor | None:
        """fp32 mean of the run's stream values at `site` over every captured position (recency
        untouched)."""
        run = self._runs.get(run_id)
        if run is None:
            return None
        rows = [i for i, (s, _) in enumerate(run.keys) if s == site]
        if not rows:
            return None
        idx = torch.tensor(rows, device="cpu")
        return (run.x[idx].float() + run.r[idx].float()).mean(0)

    def lease(self, run_id: str) -> bool:
        run = self._runs.get(run_id)
        if run is None:
            return False
        run.leases += 1
        return True

    def release(self, run_id: str) -> None:
        run = self._runs.get(run_id)
        if run is not None and run.leases > 0:
            run.leases -= 1

    def info(self, run_id: str) -> dict | None:
        """What a stored run holds: its site indices, positions, bytes and leases (None if absent)."""
        run = self._runs.get(run_id)
        if run is None:
            return None
        return {"sites": sorted({int(k[0]) for k in run.keys}), "positions": sorted({int(k[1]) for k in run.keys}),
                "bytes": int(run.nbytes), "leases": int(run.leases)}

    def drop(self, run_id: str) -> bool:
        """Remove a run even if leased (in-flight requests already hold references to its values)."""
        return self._runs.pop(run_id, None) is not None

    def usage(self) -> dict:
        return {
            "budget_bytes": self.budget,
            "used_bytes": self.used_bytes,
            "evictions": self.evictions,
            "runs": [{"run_id": r.run_id, "bytes": r.nbytes, "values": len(r.keys), "leases": r.leases}
                     for r in self._runs.values()],
        }
