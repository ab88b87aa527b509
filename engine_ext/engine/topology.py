"""Several workers, one answer: what the engine's client makes of per-rank replies.

With tensor parallelism every rank of a pipeline stage holds the whole residual stream of that
stage's layers and applies the same interventions (their replies agree; the checksum checks it).
With pipeline parallelism each stage owns a contiguous range of layers: a capture at layer 10 is
made on the stage that owns layer 10, a patch there is applied there. The functions here merge
replies of `collective_rpc` (one per worker, in rank order) so that callers see one engine:

* `Topology.of(infos)` — TP x PP and which layers each stage owns, from `cb_model_info`;
* `merge_results` — a request's result: voided when any stage voided it (so a patch that could
  not be applied on one stage is never reported as applied), errors of every stage, captures of
  every stage as one block, stored only if every stage stored it;
* `merge_store_info` / `merge_store_usage` — the source store as one store.

Only the first tensor-parallel rank of each stage (its *leader*) speaks for the stage's data.
Pure Python: no vLLM, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Stage:
    pp_rank: int
    #: decoder layers `[first_layer, end_layer)` this stage computes
    first_layer: int
    end_layer: int
    tp_ranks: tuple[int, ...] = ()

    def to_json(self) -> dict:
        return {"pp_rank": self.pp_rank, "layers": [self.first_layer, self.end_layer - 1], "tp_ranks": list(self.tp_ranks)}


@dataclass(frozen=True)
class Topology:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    stages: tuple[Stage, ...] = field(default_factory=tuple)
    #: index (in rank order) of each stage's first tensor-parallel rank
    leaders: tuple[int, ...] = (0,)

    @classmethod
    def of(cls, infos: list[dict]) -> "Topology":
        """From the workers' `cb_model_info` replies (rank order)."""
        by_stage: dict[int, list[tuple[int, dict]]] = {}
        for i, info in enumerate(infos):
            by_stage.setdefault(int(info.get("pp_rank", 0)), []).append((i, info))
        stages, leaders = [], []
        for pp, members in sorted(by_stage.items()):
            members.sort(key=lambda m: int(m[1].get("tp_rank", 0)))
            lead = members[0][1]
            stages.append(Stage(pp, int(lead.get("first_layer", 0)), int(lead.get("end_layer", lead.get("num_layers", 0))),
                                tuple(int(m[1].get("tp_rank", 0)) for m in members)))
            leaders.append(members[0][0])
        tp = max((len(s.tp_ranks) for s in stages), default=1)
        return cls(tp, len(stages), tuple(stages), tuple(leaders))

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def to_json(self) -> dict:
        return {"tensor_parallel_size": self.tensor_parallel_size, "pipeline_parallel_size": self.pipeline_parallel_size,
                "stages": [s.to_json() for s in self.stages]}


def merge_model_info(infos: list[dict], topology: Topology) -> dict:
    """One `cb_model_info`: layers patched on every stage (counted once per stage), the
    embedding's std from the stage that holds the embedding, the rest from rank 0."""
    merged = dict(infos[0])
    merged["patched_layers"] = sum(int(infos[i]["patched_layers"]) for i in topology.leaders)
    stds = [info["embedding_std"] for info in infos if info.get("embedding_std") is not None]
    merged["embedding_std"] = stds[0] if stds else None
    merged["buffer_bytes"] = sum(int(info.get("buffer_bytes", 0)) for info in infos)
    return merged


def merge_results(per_rank: list[dict[str, dict]], topology: Topology) -> dict[str, dict]:
    """One result per request key from every worker's `cb_collect` reply."""
    if len(per_rank) == 1:
        return per_rank[0]
    out: dict[str, dict] = {}
    leaders = [per_rank[i] for i in topology.leaders] if len(topology.leaders) <= len(per_rank) else per_rank[:1]
    for key in per_rank[0]:
        replies = [r.get(key) or {"key": key, "status": "unknown", "errors": []} for r in per_rank]
        statuses = [r.get("status", "unknown") for r in replies]
        if "voided" in statuses:
            status = "voided"
        elif all(s == "ok" for s in statuses):
            status = "ok"
        else:
            status = "unknown"
        errors: list[str] = []
        for r in replies:
            errors += [e for e in r.get("errors") or [] if e not in errors]
        merged = {**replies[0], "status": status, "errors": errors}
        stage_replies = [r.get(key) or {} for r in leaders]
        blocks = [r["captures"] for r in stage_replies if r.get("captures")]
        if len(blocks) == 1:  # one stage (tensor parallelism alone): the leader's block as it is (lent: no copy)
            merged["captures"] = blocks[0]
        elif blocks:  # the stages' values joined once, into a writable buffer (used as is, not copied again)
            merged["captures"] = {"keys": [k for b in blocks for k in b["keys"]],
                                  "data": bytearray().join(b["data"] for b in blocks)}
        if any("stored_as" in r for r in stage_replies):
            if all(r.get("stored_as") for r in stage_replies):
                merged["stored_as"] = stage_replies[0]["stored_as"]
            else:
                merged.pop("stored_as", None)
        evicted: list[str] = []
        for r in stage_replies:
            evicted += [e for e in r.get("evicted") or [] if e not in evicted]
        if evicted:
            merged["evicted"] = evicted
        scored = [r["segment_scores"] for r in replies if r.get("segment_scores")]
        if scored:  # the last stage's rank that holds the gathered logits (the others score nothing)
            merged["segment_scores"] = max(scored, key=lambda sc: len(sc["positions"]))
        store_errors = [r["store_error"] for r in stage_replies if r.get("store_error")]
        if store_errors:
            merged["store_error"] = store_errors[0]
        out[key] = merged
    return out


def merge_store_info(infos: list[dict | None], topology: Topology) -> dict | None:
    """A stored run as one run (None unless every worker holds it)."""
    if any(i is None for i in infos):
        return None
    leaders = [infos[i] for i in topology.leaders]
    return {"sites": sorted({s for i in leaders for s in i["sites"]}),
            "positions": sorted({p for i in leaders for p in i["positions"]}),
            "bytes": sum(int(i["bytes"]) for i in leaders), "leases": min(int(i["leases"]) for i in infos)}


def merge_store_usage(usages: list[dict], topology: Topology) -> dict:
    """The source store as one store. Every stage charges each run's whole size (all stages'
    values) against its own budget, so that all stages evict the same runs: the merged budget and
    use are one stage's (the largest, they agree), a run's `bytes` is summed over the stages (its
    real size), the eviction count is the largest of any worker."""
    leaders = [usages[i] for i in topology.leaders]
    runs: dict[str, dict] = {}
    for u in leaders:
        for r in u["runs"]:
            cur = runs.get(r["run_id"])
            runs[r["run_id"]] = {**r} if cur is None else {**cur, "bytes": cur["bytes"] + r["bytes"],
                                                            "values": cur["values"] + r["values"],
                                                            "leases": min(cur["leases"], r["leases"])}
    return {"budget_bytes": max(int(u["budget_bytes"]) for u in leaders), "used_bytes": max(int(u["used_bytes"]) for u in leaders),
            "evictions": max(int(u["evictions"]) for u in usages), "runs": list(runs.values())}


def cpu_thread_binding(world_size: int, cores: list[int]) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` for `world_size` CPU ranks: the cores split into contiguous
    groups, one per rank (`"0|1"`, `"0-3|4-7"`); ValueError when there are fewer cores than ranks."""
    cores = sorted(cores)
    if len(cores) < world_size:
        raise ValueError(f"{world_size} ranks need at least {world_size} CPU cores; {len(cores)} are available")
    per = len(cores) // world_size
    groups = [cores[k * per:(k + 1) * per] for k in range(world_size)]

    def text(group: list[int]) -> str:
        if len(group) > 1 and group[-1] - group[0] == len(group) - 1:
            return f"{group[0]}-{group[-1]}"
        return ",".join(map(str, group))

    return "|".join(text(g) for g in groups)
