"""Cells packed into segmented requests (`Engine.agenerate_cells`; the worker side is
`engine_ext.worker.segments`).

A *cell* is one scored forward of a prompt with its own patches (a sweep's cell, a baseline).
`pack` lays up to K cells side by side in one request: the prompt padded to S tokens (the next
multiple of the KV block size) and repeated, cell i's patches moved to positions `i*S + p` (a
stored run's values still read at `p`), each segment scored at its last real token. The results
(`split`) are one `Generation` per cell, as `Engine.agenerate_many` would give for the cell alone
(scores at the last prompt token, its intervention status; no generated tokens).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from engine_ext.generation import Generation, InterventionResult
from engine_ext.program import PromptInfo, resolve_positions
from engine_ext.sites import Site
from engine_ext.specs import Interventions, Patch, RunSource

#: at most this many cells in one request (bounds a request's programme and result sizes)
MAX_SEGMENTS = 256
#: segments are used by default only where padding the prompt to whole KV blocks adds at most
#: this fraction of its tokens: every padded token is computed (on the 2-core CPU, 768 cells of a
#: 16-token prompt padded to 32 ran at 0.70x of one request per cell, unpadded at 1.32x)
MAX_PADDING = 0.25


@dataclass
class Carrier:
    """One segmented request: its prompt, its spec (every cell's patches moved to its segment),
    the worker's `segments` block and the cells it holds (indices into the caller's list)."""

    ids: list[int]
    spec: Interventions
    segments: dict
    cells: list[int]


@dataclass
class PreparedCells:
    """Cells ready to run (`Engine.prepare_cells`, run once by `Engine.arun_cells`): the prompt's
    ids, the requests (request id, the prepared vLLM request, what it carries: a cell's index or
    a `Carrier`, the converter of its outputs) and the cells that failed validation (index,
    error)."""

    ids: list[int]
    requests: list[tuple] = dataclasses.field(default_factory=list)
    errors: list[tuple[int, Exception]] = dataclasses.field(default_factory=list)
    submitted: bool = False

    def add(self, request_id: str, prep, what, convert) -> None:
        self.requests.append((request_id, prep, what, convert))

    def claim(self) -> None:
        """Mark the cells submitted; `RuntimeError` if they were already (their request ids and
        KV salts are single-use)."""
        if self.submitted:
            raise RuntimeError("these prepared cells were already run (prepare them again)")
        self.submitted = True


def packable(cell: Interventions | None) -> bool:
    """Cells whose whole effect is patches (sweeps' cells and baselines): steering, noise,
    captures and clamps are not moved into segments (those cells run as requests of their own)."""
    return cell is None or not (cell.steer or cell.capture or cell.noise or cell.clamp)


def worth_it(n_prompt: int, length: int, per_request: int) -> bool:
    """Whether segments of `length` tokens for an `n_prompt`-token prompt, `per_request` per
    request, are the default (`MAX_PADDING`)."""
    return per_request >= 2 and n_prompt > 0 and (length - n_prompt) <= MAX_PADDING * n_prompt


def segments_per_request(n_prompt: int, block_size: int, max_model_len: int, step_tokens: int) -> tuple[int, int]:
    """(segment length S, cells per request K) for a prompt of `n_prompt` tokens: S the next
    multiple of the block size; K as many as fit the context (the prompt plus the one generated
    token), one step's token budget and `MAX_SEGMENTS`."""
    if n_prompt <= 0:  # nothing to pack (each cell's own request reports the empty prompt)
        return 0, 0
    length = -(-n_prompt // block_size) * block_size
    k = min((max_model_len - 1) // length, max(1, step_tokens // length), MAX_SEGMENTS)
    return length, k


def pack(prompt: Sequence[int], cells: Sequence[Interventions | None], score_ids: Sequence[int], length: int,
         per_request: int, pad_id: int, entry_run: str | None = None, entry_band: int = 1) -> list[Carrier]:
    """The carriers for `cells` (all `packable`) on `prompt`: as few as `per_request` cells each
    allow, their sizes within one of each other (not a full request and a nearly empty one).

    `entry_run`: a stored run of `prompt` itself, with no patches (a sweep's corrupt baseline),
    holding `pre_attn` at every layer and prompt position. Then each carrier holds cells of one
    *entry layer* (`lowest_patched_layer`; below it a cell equals that
    run) and enters the forward there: every segment's `pre_attn` pairs at that layer come from
    `entry_run` (where the cell patches that site and position itself, its own patch; one patch
    per carrier, first in its list), and a step
    that schedules only such carriers of one layer skips the layers below
    (docs/segmented-cells.md, "Layer skipping"). Same scores; cells with entry layer 0 are packed
    as without `entry_run`. `entry_band`: cells enter at the first layer of their band of that
    many layers (fewer, larger steps; each cell computes up to `entry_band - 1` layers more;
    `Engine.prepare_cells` checks it)."""
    n = len(prompt)
    info = PromptInfo(list(prompt), None, None, 1)
    padded = list(prompt) + [pad_id] * (length - n)
    groups: dict[int, list[int]] = {}
    for i, cell in enumerate(cells):
        groups.setdefault(lowest_patched_layer(cell) // entry_band * entry_band if entry_run is not None else 0, []).append(i)
    out = []
    for layer in sorted(groups):
        members = groups[layer]
        count = -(-len(members) // per_request)
        q, r = divmod(len(members), count)
        first = 0
        for c in range(count):
            idx = members[first: first + q + (1 if c < r else 0)]
            first += len(idx)
            patches: list[Patch] = []
            entry_dst: list[int] = []  # the carrier's one entry patch: destinations, stored positions
            entry_src: list[int] = []
            for j, i in enumerate(idx):
                moved = [_moved(p, j * length, info, f"cells[{i}].patch[{k}]")
                         for k, p in enumerate(cells[i].patch if cells[i] is not None else ())]
                if layer:
                    keep = _entry_positions(layer, n, j * length, moved)
                    entry_dst += [j * length + q for q in keep]
                    entry_src += keep
                patches += moved
            if entry_dst:
                patches.insert(0, Patch(Site(layer, "pre_attn"), tuple(entry_dst), RunSource(entry_run, tuple(entry_src))))
            segments = {"len": length, "score_pos": [j * length + n - 1 for j in range(len(idx))],
                        "ids": [int(t) for t in score_ids]}
            if layer:
                segments["entry"] = layer
            out.append(Carrier(ids=padded * len(idx), spec=Interventions(patch=tuple(patches)), segments=segments,
                               cells=idx))
    return out


def lowest_patched_layer(cell: Interventions | None) -> int:
    """The lowest layer any patch of `cell` touches (0 without patches): below it the cell's
    forward is the prompt's own."""
    return min((p.site.layer for p in cell.patch), default=0) if cell is not None else 0


def _entry_positions(layer: int, n: int, offset: int, own: list[Patch]) -> list[int]:
    """The prompt positions of a segment (carrier positions `offset` .. `offset + n - 1`) whose
    `pre_attn` pairs at `layer` come from the entry run: all but those where the cell's own patches
    (`own`, already moved) replace that site and position. The carrier's entry patch gathers them
    for all its segments (one patch per carrier, not one per segment)."""
    site = Site(layer, "pre_attn")
    taken = {int(x) - offset for p in own if p.site == site for x in p.positions}
    return [q for q in range(n) if q not in taken]


def _moved(p: Patch, offset: int, info: PromptInfo, field: str) -> Patch:
    """`p` with its destination positions moved by `offset` (a stored run's values still read at
    the original positions)."""
    pos, gen = resolve_positions(p.positions, info, f"{field}.positions")
    if gen:
        from engine_ext.errors import SpecError

        raise SpecError(f"{field}.positions", "a cell is one forward of the prompt: no generated positions")
    source = p.source
    if isinstance(source, RunSource) and source.positions is None:
        source = RunSource(source.run_id, tuple(int(x) for x in pos))
    return dataclasses.replace(p, positions=tuple(int(x) + offset for x in pos), source=source)


def split(carrier: Carrier, gen: Generation, prompt: Sequence[int]) -> list[tuple[int, Generation]]:
    """One `Generation` per cell of a finished carrier: the scores of its segment (by token id),
    the carrier's intervention status and errors."""
    iv = gen.intervention
    raw = iv.segment_scores if iv is not None else None
    by_pos = dict(zip(raw["positions"], raw["logprobs"])) if raw else {}
    ids = raw["ids"] if raw else []
    out = []
    for j, i in enumerate(carrier.cells):
        lps = by_pos.get(carrier.segments["score_pos"][j])
        cell_iv = None
        if iv is not None:
            errors = list(iv.errors)
            if lps is None and not iv.voided:
                errors.append("no score for this cell")
            cell_iv = InterventionResult(status=iv.status if lps is not None else "voided", errors=errors,
                                         program_hash=iv.program_hash)
        g = Generation(f"{gen.request_id}/{j}", None, list(prompt))
        g.scores = [dict(zip(ids, lps))] if lps is not None else []
        g.intervention = cell_iv
        g.finish_reason = gen.finish_reason
        out.append((i, g))
    return out
