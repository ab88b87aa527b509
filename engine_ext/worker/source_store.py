"""Worker-side store of captured source runs, for patching.

A run is stored whole (all its captured (site, position) values) and evicted whole, least
recently used first, to stay within a byte budget. A run is *leased* while any in-flight
request (or a client, e.g. a sweep) references it; leased runs are never evicted. Values are
kept on the host as the exact (hidden, residual) pair vLLM carries, in the model dtype, so that
writing them back reproduces the source run bit-exactly.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch


@dataclass
class SourceRun:
    run_id: str
    #: (site index, position) -> (x, r) pair in the model dtype (r is zeros at L0.pre_attn)
    values: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]
    nbytes: int
    created: float = field(default_factory=time.time)
    leases: int = 0

    def value(self, site: int, pos: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.values.get((site, pos))


class SourceStoreFull(RuntimeError):
    pass


class SourceStore:
    def __init__(self, budget_bytes: int):
        self.budget = int(budget_bytes)
        self._runs: OrderedDict[str, SourceRun] = OrderedDict()
        self.evictions = 0

    @property
    def used_bytes(self) -> int:
        return sum(r.nbytes for r in self._runs.values())

    def __contains__(self, run_id: str) -> bool:
        return run_id in self._runs

    def put(self, run_id: str, values: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]) -> list[str]:
        """Store (or replace) a run; returns the run ids evicted to make room.
        Raises SourceStoreFull if it cannot fit even after evicting every unleased run."""
        nbytes = sum(x.numel() * x.element_size() + r.numel() * r.element_size() for x, r in values.values())
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
        self._runs[run_id] = SourceRun(run_id, values, nbytes, leases=leases)
        return evicted

    def get(self, run_id: str) -> SourceRun | None:
        run = self._runs.get(run_id)
        if run is not None:
            self._runs.move_to_end(run_id)
        return run

    def value(self, run_id: str, site: int, pos: int):
        run = self.get(run_id)
        return run.value(site, pos) if run else None

    def mean(self, run_id: str, site: int) -> torch.Tensor | None:
        """fp32 mean of the run's stream values at `site` over every captured position."""
        run = self.get(run_id)
        if run is None:
            return None
        vals = [x.float() + r.float() for (s, _), (x, r) in run.values.items() if s == site]
        return torch.stack(vals).mean(0) if vals else None

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

    def drop(self, run_id: str) -> bool:
        """Remove a run even if leased (in-flight requests already hold copies of their values)."""
        return self._runs.pop(run_id, None) is not None

    def usage(self) -> dict:
        return {
            "budget_bytes": self.budget,
            "used_bytes": self.used_bytes,
            "evictions": self.evictions,
            "runs": [{"run_id": r.run_id, "bytes": r.nbytes, "values": len(r.values), "leases": r.leases}
                     for r in self._runs.values()],
        }
