"""Segmented requests: several independent sequences packed into one vLLM request.

A *segmented* request's prompt is K segments of S tokens each (S a multiple of the KV block
size); segment j holds carrier positions `[j*S, (j+1)*S)`. Each segment is computed as if it were
a request of its own: its rows get segment-local positions (`position % S`, what RoPE reads) and
the attention metadata holds one sequence per segment, each over its own KV blocks (vLLM's slot
mapping, computed from the carrier's linear positions before they are rewritten, already puts
segment j's keys and values in the carrier's blocks `[j*S/bs, (j+1)*S/bs)`). Patches and
captures address carrier positions like any request's. At the positions the program lists
(`score_pos`: each segment's last real token) the worker scores the model's final hidden state:
`log_softmax(compute_logits(h))` at the requested token ids, as vLLM's sampler computes a
request's `logprob_token_ids` (raw logprobs). This is how a sweep runs many cells per request
(docs/segmented-cells.md): the per-request costs of vLLM's scheduler, input and output
paths are paid once per K cells.

Where it runs (the seam, `engine_ext.worker.seam`): both of vLLM's runners. V1 (the CPU
runner's and, with `VLLM_USE_V2_MODEL_RUNNER=0`, the GPU's): after `_prepare_inputs`, `begin_step`
rewrites the carriers' positions and records the step's split; `CommonAttentionMetadata`, as the V1
runner's module names it, is replaced by a factory that applies `split_segments` while a step has
carriers; after `_model_forward`, `score` computes the scores from its output. V2 (the GPU's
default): the same after its `prepare_attn` (which computes the slot mappings from the positions),
the same factory in `attn_utils` (its `build_attn_metadata`), the scores from the step's final
hidden states after `execute_model`, through V2's own logprob kernel called exactly as its sampler
calls it (`engine_ext.worker.extension.segments_offered` says where segments are offered). A step that schedules a carrier never replays a FULL CUDA
graph (`carriers_scheduled`: the runner's dispatch is told the batch is not a uniform decode one),
since a full graph reads the captured, unsplit attention metadata. Refused for hybrids (their
recurrent state would run through all segments): the engine then runs one request per cell
instead (`Engine.agenerate_cells`).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import numpy as np
import torch

#: the step being prepared in this thread: (carriers by batch index -> S, block size), or None
_STEP = threading.local()


def active_split() -> tuple[dict[int, int], int] | None:
    """The carriers of the step this thread is preparing (batch index -> segment length) and the
    KV block size; None when it has none."""
    return getattr(_STEP, "split", None)


def clear_step() -> None:
    _STEP.split = None
    _STEP.entry = 0


def step_entry() -> int:
    """The layer at which the step this thread is preparing may enter the forward: > 0 when every
    row it schedules belongs to segmented requests that all enter at that layer (their programs'
    `entry_layer`: below it nothing reaches their scores); 0 otherwise (every layer runs)."""
    return getattr(_STEP, "entry", 0)


def set_carriers_scheduled(scheduled: bool) -> None:
    """Whether the step this thread is about to run schedules a segmented request (set from the
    scheduler's output before the runner picks the step's CUDA-graph mode)."""
    _STEP.scheduled = scheduled


def carriers_scheduled() -> bool:
    return getattr(_STEP, "scheduled", False)


def begin_step(req_ids, query_start_loc: np.ndarray, num_computed: np.ndarray, positions: torch.Tensor,
               segmented: dict[str, tuple[int, np.ndarray, int]], block_size: int) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """Right after the runner computed the step's positions and slot mapping: the carriers' rows
    get segment-local positions and the step's split is recorded for the attention metadata, with
    the layer the step may enter at (`step_entry`). `segmented`: request id -> (S, sorted score
    positions, entry layer). Returns the rows to score after the forward: (request id, carrier
    positions, rows)."""
    carriers: dict[int, int] = {}
    to_score = []
    entries: set[int] = set()
    for i, rid in enumerate(req_ids):
        seg = segmented.get(rid)
        row0 = int(query_start_loc[i])
        n = int(query_start_loc[i + 1]) - row0
        if n <= 0:
            continue
        if seg is None:
            entries.add(0)
            continue
        length, score_pos, entry = seg
        entries.add(entry)
        p0 = int(num_computed[i])
        carriers[i] = length
        positions[row0: row0 + n] = positions[row0: row0 + n] % length
        a, z = np.searchsorted(score_pos, (p0, p0 + n))
        if z > a:
            pos = score_pos[a:z]
            to_score.append((rid, pos, row0 + (pos - p0)))
    _STEP.split = (carriers, block_size) if carriers else None
    _STEP.entry = entries.pop() if len(entries) == 1 else 0
    return to_score


def split_segments(cm: Any, carriers: dict[int, int], block_size: int) -> Any:
    """vLLM's `CommonAttentionMetadata` `cm` with each carrier (batch index -> segment length S)
    replaced by one sequence per segment its window touches: the window's rows inside the
    segment, the segment's length up to the window's end, the block table from the segment's
    first block. A window may start or end inside a segment (chunked prefill). Other rows keep
    their values: where `cm` has no exact host copy of the sequence lengths (V2), their device
    values are gathered, and a carrier's (a prefill: `num_computed + scheduled`, exact) comes from
    the host's upper bound."""
    qsl = cm.query_start_loc_cpu.tolist()
    exact = cm._seq_lens_cpu is not None
    host_seq = cm._seq_lens_cpu if exact else cm.seq_lens_cpu_upper_bound
    seq = (host_seq if host_seq is not None else cm.seq_lens.cpu()).tolist()
    q_lens: list[int] = []
    s_lens: list[int] = []
    rows: list[tuple[int, int]] = []  # (batch index, first block)
    kept: list[int] = []  # indices into rows of the non-carrier rows
    for i in range(cm.num_reqs):
        q = qsl[i + 1] - qsl[i]
        length = carriers.get(i)
        if length is None:
            kept.append(len(rows))
            q_lens.append(q)
            s_lens.append(seq[i])
            rows.append((i, 0))
            continue
        computed = seq[i] - q
        for j in range(computed // length, -(-seq[i] // length)):
            a, b = max(computed, j * length), min(seq[i], (j + 1) * length)
            q_lens.append(b - a)
            s_lens.append(b - j * length)
            rows.append((i, j * length // block_size))
    bt = cm.block_table_tensor
    dev = bt.device
    width = bt.shape[1]
    src = torch.tensor([i for i, _ in rows], dtype=torch.long)
    first = torch.tensor([f for _, f in rows], dtype=torch.long)
    cols = (first[:, None] + torch.arange(width)[None, :]).clamp_(max=width - 1)
    src_dev = src.to(dev)
    new_bt = bt[src_dev[:, None], cols.to(dev)]
    new_bt.masked_fill_((first[:, None] + torch.arange(width)[None, :] >= width).to(dev), 0)
    qsl_cpu = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=cm.query_start_loc_cpu.dtype)
    seq_cpu = torch.tensor(s_lens, dtype=cm.seq_lens.dtype)
    seq_dev = seq_cpu.to(cm.seq_lens.device, non_blocking=True, copy=True)
    if not exact and kept:  # the other rows' lengths as the device has them
        keep = torch.tensor(kept, dtype=torch.long, device=cm.seq_lens.device)
        seq_dev[keep] = cm.seq_lens.index_select(0, src_dev.to(cm.seq_lens.device).index_select(0, keep))
    computed_cpu = seq_cpu - torch.tensor(q_lens, dtype=seq_cpu.dtype)
    prefilling = None
    if cm.is_prefilling is not None:  # segments are prefill; other rows as they were
        prefilling = cm.is_prefilling.index_select(0, src.to(cm.is_prefilling.device))
        is_segment = torch.ones(len(rows), dtype=torch.bool)
        is_segment[kept] = False
        prefilling |= is_segment.to(prefilling.device)
    return dataclasses.replace(
        cm, query_start_loc=qsl_cpu.to(cm.query_start_loc.device, non_blocking=True), query_start_loc_cpu=qsl_cpu,
        seq_lens=seq_dev, _seq_lens_cpu=seq_cpu if exact else None, num_reqs=len(rows),
        num_actual_tokens=cm.num_actual_tokens, max_query_len=max(q_lens), max_seq_len=max(s_lens),
        block_table_tensor=new_bt,
        _num_computed_tokens_cpu=computed_cpu if exact or cm._num_computed_tokens_cpu is not None else None,
        seq_lens_cpu_upper_bound=seq_cpu, is_prefilling=prefilling, _num_computed_tokens_cache=None,
        _token_to_req_indices_cache=None)


def score(hidden: torch.Tensor, rows: np.ndarray, model: Any, token_ids: list[int], v2: bool = False) -> torch.Tensor | None:
    """Raw logprobs [len(rows), len(token_ids)] (fp32) of `token_ids` at the final hidden states'
    `rows`, as the runner's sampler computes a request's `logprob_token_ids` from vLLM's
    `compute_logits`: V1's `log_softmax` in fp32; V2's (`v2`) logits, in the model's dtype, through
    its row-wise Triton kernel (`vllm.v1.worker.gpu.sample.logprob.compute_token_logprobs`), so that a
    segment's score equals, bit for bit, the same cell's as a request of its own."""
    idx = torch.from_numpy(np.asarray(rows, np.int64)).to(hidden.device)
    logits = model.compute_logits(hidden.index_select(0, idx))
    if logits is None:  # tensor parallelism: the logits are gathered on another rank
        return None
    ids = torch.tensor(token_ids, dtype=torch.long, device=logits.device)
    if v2:
        from vllm.v1.worker.gpu.sample.logprob import compute_token_logprobs

        # exactly V2's sampler call in its default `raw_logprobs` mode: the logits in the model's
        # dtype (the kernel upcasts as it loads; an fp32 copy compiles another kernel whose
        # in-block sums add in another order: one ulp apart), and the token ids after a column for
        # the sampled token (the kernel's gather width follows the column count)
        cols = torch.cat((ids[:1], ids))[None, :].expand(logits.shape[0], -1).contiguous()
        return compute_token_logprobs(logits, cols)[:, 1:]
    lp = logits.log_softmax(dim=-1, dtype=torch.float32)
    return lp.index_select(1, ids)
