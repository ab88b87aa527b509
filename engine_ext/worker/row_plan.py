"""Which rows of a step's flattened batch belong to which request, at which absolute positions.

Pure code (numpy only), shared by every model runner: the seam extracts, per runner, the
scheduled requests in batch order with their row offsets and the number of tokens already
computed (`ScheduledRequest`), and `RowPlan` turns them into per-row (request, position).

Holds under:
* chunked prefill — a request's rows cover positions `[num_computed, num_computed + n_rows)`;
* mixed prefill/decode batches — each request has its own window;
* preemption and resume — a resumed request restarts at its new `num_computed` (recomputed
  positions are simply visited again; consumers must be idempotent per position);
* async scheduling without speculative decoding — vLLM's CPU-side `num_computed` is exact;
* padding — rows at or beyond `num_tokens` belong to no request (request index -1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ScheduledRequest:
    req_id: str
    row_start: int
    n_rows: int
    num_computed: int
    num_prompt: int = -1  # -1: unknown


@dataclass(frozen=True)
class RequestWindow:
    """One request's rows in the step: rows `[row_start, row_start + n_rows)` hold absolute
    positions `[first_position, first_position + n_rows)`."""

    req_id: str
    row_start: int
    n_rows: int
    first_position: int
    num_prompt: int = -1

    def rows_for(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows, positions) for those of `positions` that fall in this step's window."""
        pos = np.asarray(positions, dtype=np.int64)
        keep = (pos >= self.first_position) & (pos < self.first_position + self.n_rows)
        pos = pos[keep]
        return self.row_start + (pos - self.first_position), pos

    @property
    def positions(self) -> np.ndarray:
        return np.arange(self.first_position, self.first_position + self.n_rows, dtype=np.int64)


class RowPlan:
    """The per-step mapping rows -> (request, position)."""

    def __init__(self, requests: Sequence[ScheduledRequest], num_rows: int):
        self.num_rows = int(num_rows)
        self.windows: list[RequestWindow] = []
        self.row_request = np.full(self.num_rows, -1, dtype=np.int32)
        self.row_position = np.full(self.num_rows, -1, dtype=np.int64)
        end = 0
        for k, r in enumerate(requests):
            if r.n_rows < 0 or r.row_start < end or r.num_computed < 0:
                raise ValueError(f"inconsistent scheduled request {r} (previous rows end at {end})")
            end = r.row_start + r.n_rows
            if end > self.num_rows:
                raise ValueError(f"request {r.req_id} rows end at {end} > {self.num_rows} rows in the step")
            w = RequestWindow(r.req_id, r.row_start, r.n_rows, r.num_computed, r.num_prompt)
            self.windows.append(w)
            self.row_request[r.row_start:end] = k
            self.row_position[r.row_start:end] = w.positions

    @classmethod
    def from_query_start(cls, req_ids: Sequence[str], query_start_loc: Sequence[int] | np.ndarray,
                         num_computed: Sequence[int] | np.ndarray, num_rows: int,
                         num_prompt: Sequence[int] | None = None) -> "RowPlan":
        """From the arrays both vLLM runners keep: `query_start_loc[i]..query_start_loc[i+1]`
        are request i's rows, `num_computed[i]` its tokens computed before this step."""
        qsl = np.asarray(query_start_loc, dtype=np.int64)
        nc = np.asarray(num_computed, dtype=np.int64)
        npr = list(num_prompt) if num_prompt is not None else [-1] * len(req_ids)
        reqs = [ScheduledRequest(rid, int(qsl[i]), int(qsl[i + 1] - qsl[i]), int(nc[i]), int(npr[i]))
                for i, rid in enumerate(req_ids)]
        return cls(reqs, num_rows)

    def window(self, req_id: str) -> RequestWindow | None:
        for w in self.windows:
            if w.req_id == req_id:
                return w
        return None
