"""Multi-GPU validation: the GPU correctness matrix and the sweep checks at TP=2 / PP=2, compared
with TP=1 run in the same device call, plus the cross-rank checksum under an injected fault and
TP=2 vs TP=1 throughput.

Run on a host with two GPUs after `source .vbundle/gpu_env.sh` (uvicorn etc. on PYTHONPATH for the
HTTP sweeps, as for gpu_sweep.py). One configuration per process; `benchmarks/gpu_multirank.sh`
runs them all and then `--compare`:

    python3 benchmarks/gpu_multirank.py --tp 2 --out $OUT/mr-tp2.json              # checks
    python3 benchmarks/gpu_multirank.py --tp 2 --throughput --out $OUT/mr-tp2-tput.json
    python3 benchmarks/gpu_multirank.py --compare $OUT/mr-tp1.json $OUT/mr-tp2.json $OUT/mr-pp2.json --out $OUT/mr-compare.json

Checks mode (one engine per process): every check of benchmarks/gpu_validate.py (captures, steering,
patching, corrupt->clean, mixed-batch isolation, prefix-cache isolation, voided patches, MLP sites,
masks, clamps: each against the transformers oracle or bit-exact within the run), the sweep checks of
benchmarks/gpu_sweep.py over the HTTP API (recovered grid, same-stream hooks, concurrent = solo,
zoom, disconnect), the checksum status after all of it (`consistent` over the ranks of each stage),
and at TP>1 a fault injected on rank 1 (one planned action skipped) reported as
`consistent: false` with both ranks' checksums, while requests keep being served.

Several configurations can run at once on the same GPUs: each engine reserves a fixed KV cache
(`--kv-gib`, vLLM's `kv_cache_memory_bytes`) instead of profiling free memory, which another
process's allocations would disturb.

Compare mode: each configuration's outputs against the first (TP=1): steered logprobs, patched and
clean scores, an unintervened request batched with intervened neighbours, and the sweep grids, each
within the bf16 logprob tolerance of the oracle checks (another rank count reduces in another order,
so the last bits differ) plus, for grids, both runs' noise floors.

Throughput mode: decode tokens/s (batch 1 and 32, vanilla and every request steered; median of
`--reps`) and the sweep throughput of gpu_sweep.py, batch invariance off (vLLM's default).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LOGPROB_TOL_BF16 = 0.1


def _engine(args, batch_invariant):
    from benchmarks.gpu_validate import _model_path, engine_memory
    from engine_ext import Engine

    return Engine(model=_model_path(args.model, args.scratch), device=args.device,
                  enforce_eager=args.mode == "eager" or args.device == "cpu",
                  max_model_len=None if args.model == "bundled" else 1024,
                  source_store_bytes=512 * 1024 * 1024, batch_invariant=batch_invariant if args.device == "cuda" else None,
                  tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp,
                  distributed_executor_backend=args.executor,
                  **engine_memory(args.kv_gib, args.device, default_utilization=0.08)).start()


def _fault(eng) -> dict:
    """At TP>1: consistent after the run so far; one action skipped on rank 1 -> inconsistent with
    both checksums listed; the next request is still served."""
    import numpy as np

    from engine_ext import GenerationParams
    from engine_ext.specs import Interventions, Steer

    before = eng.intervention_status()["determinism"]
    out = {"before": before}
    if eng.config.tensor_parallel_size < 2:
        out["ok"] = bool(before.get("consistent"))
        out["note"] = "one rank per pipeline stage: nothing to compare a checksum with"
        return out
    v = np.random.default_rng(7).standard_normal(eng.info.hidden_size).astype(np.float32)
    took = eng.inject_fault("skip_action", tp_rank=1, pp_rank=0)
    eng.generate([11, 12, 13, 14, 15, 16], GenerationParams(max_tokens=2, logprobs=0),
                 Interventions(steer=(Steer.make(["L0.pre_attn"], v),)))
    after = eng.intervention_status()
    det = after["determinism"]
    sums = {f"tp{w['tp_rank']}/pp{w['pp_rank']}": w["action_checksum"] for w in after["workers"]}
    still = eng.generate([11, 12, 13, 14], GenerationParams(max_tokens=2, logprobs=0)).token_ids
    out.update({"fault_taken": took, "after": det, "worker_checksums": sums, "served_after_fault": bool(still)})
    out["ok"] = (bool(before.get("consistent")) and before.get("ranks") == eng.world_size and took
                 and det.get("consistent") is False and det.get("checksums") == sums and len(set(sums.values())) == 2
                 and bool(still))
    return out


def run_checks(args) -> dict:
    from benchmarks import gpu_sweep, gpu_validate

    t0 = time.perf_counter()
    eng = _engine(args, None)  # batch invariance: the engine's default (on for CUDA), as the TP=1 matrix
    res: dict = {"tp": args.tp, "pp": args.pp, "model": args.model, "mode": args.mode, "runner": args.runner,
                 "startup_s": round(time.perf_counter() - t0, 1), "topology": eng.info.topology,
                 "batch_invariant": eng.info.batch_invariant, "kv_isolation": eng.info.kv_isolation}
    print(json.dumps({"started": res}), flush=True)
    try:
        res["validate"] = gpu_validate.run_checks(args, eng)
        res["sweep"] = gpu_sweep.run(args, eng, checks=True, throughput=False)
        try:
            res["checksum_fault"] = _fault(eng)
        except Exception as exc:
            res["checksum_fault"] = {"ok": False, "error": repr(exc), "trace": traceback.format_exc()[-1500:]}
        print(json.dumps({"checksum_fault": res["checksum_fault"]}), flush=True)
    finally:
        eng.close()
    res["all_ok"] = bool(res["validate"].get("all_ok") and res["sweep"].get("all_ok") and res["checksum_fault"].get("ok"))
    return res


def run_throughput(args) -> dict:
    from benchmarks import gpu_sweep, gpu_validate

    t0 = time.perf_counter()
    eng = _engine(args, False)
    res: dict = {"tp": args.tp, "pp": args.pp, "model": args.model, "startup_s": round(time.perf_counter() - t0, 1),
                 "batch_invariant": eng.info.batch_invariant}
    try:
        res["decode"] = gpu_validate.run_throughput(args, eng)
        res["sweep"] = gpu_sweep.run(args, eng, checks=False, throughput=True)["throughput"]
    finally:
        eng.close()
    res["all_ok"] = True
    return res


def _max_abs(a, b) -> float:
    import numpy as np

    x, y = np.array(a, dtype=float), np.array(b, dtype=float)
    if x.shape != y.shape:
        return float("inf")
    both = ~(np.isnan(x) & np.isnan(y))
    return float(np.nanmax(np.abs(x[both] - y[both]))) if both.any() else 0.0


def compare(paths: list[str]) -> dict:
    """Each configuration against the first one's outputs."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    base = runs[0]
    out: dict = {"baseline": f"tp{base['tp']}/pp{base['pp']}", "configs": {}}
    bv, bs = base["validate"]["values"], base["sweep"]["values"]
    for path, run in zip(paths[1:], runs[1:]):
        name = f"{Path(path).stem} (tp{run['tp']}/pp{run['pp']}, {run.get('mode')}, kv {run.get('kv_isolation')})"
        v, s = run["validate"]["values"], run["sweep"]["values"]
        c: dict = {}
        lp = max(abs(a - b) for a, b in zip(v["steered"]["logprobs"], bv["steered"]["logprobs"]))
        c["steered"] = {"same_tokens": v["steered"]["token_ids"] == bv["steered"]["token_ids"], "max_logprob_diff": lp,
                        "ok": lp <= LOGPROB_TOL_BF16}
        sc = max(abs(v["corrupt_to_clean"][k][t] - bv["corrupt_to_clean"][k][t])
                 for k in ("patched", "clean") for t in bv["corrupt_to_clean"][k])
        c["corrupt_to_clean"] = {"max_score_diff": sc, "ok": sc <= LOGPROB_TOL_BF16}
        # greedy decoding of a random-weight model meets near-ties: once another reduction order
        # picks another token the sequences are different texts, so logprobs are compared up to
        # the first differing token (that token's position included: same context, other argmax)
        nb, agree = [], []
        for g, h in zip(v["neighbours"], bv["neighbours"]):
            n = next((i for i, (a, b) in enumerate(zip(g["token_ids"], h["token_ids"])) if a != b), len(g["token_ids"]))
            agree.append(n)
            nb.append(max((abs(a - b) for a, b in zip(g["logprobs"][:n], h["logprobs"][:n])), default=0.0))
        c["neighbours"] = {"max_logprob_diff_per_request": nb, "tokens_agreeing_per_request": agree,
                           "tokens_per_request": [len(h["token_ids"]) for h in bv["neighbours"]],
                           "ok": max(nb) <= LOGPROB_TOL_BF16 and min(agree) >= 1}
        # Grids: within both runs' noise floors plus the bf16 logprob tolerance (another rank
        # count reduces in another order, so cells are not bit-identical across configurations;
        # for `recovered` the tolerance is scaled by the clean-corrupt gap it is divided by).
        rec, brec = s["recovered"], bs["recovered"]
        tol = 2 * LOGPROB_TOL_BF16 / max(abs(brec["clean"] - brec["corrupt"]), 1e-6)
        d = _max_abs(rec["grid"], brec["grid"])
        c["recovered_grid"] = {"max_abs_diff": d, "noise_floors": [brec["noise_floor"], rec["noise_floor"]],
                               "tolerance": tol, "ok": d <= brec["noise_floor"] + rec["noise_floor"] + tol}
        lg, blg = s["logprob_2_hooks"], bs["logprob_2_hooks"]
        d = max(_max_abs(g, blg["grids"][h]) for h, g in lg["grids"].items())
        c["logprob_grids"] = {"max_abs_diff": d, "noise_floors": [blg["noise_floor"], lg["noise_floor"]],
                              "tolerance": LOGPROB_TOL_BF16,
                              "ok": d <= blg["noise_floor"] + lg["noise_floor"] + LOGPROB_TOL_BF16}
        c["ok"] = all(x["ok"] for x in c.values() if isinstance(x, dict))
        out["configs"][name] = c
    out["all_ok"] = all(c["ok"] for c in out["configs"].values())
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--executor", default=None, help="vLLM's distributed executor (mp, ray; default: vLLM's choice)")
    ap.add_argument("--model", choices=["bundled", "llama-1b"], default="llama-1b")
    ap.add_argument("--mode", choices=["eager", "graphs"], default="graphs")
    ap.add_argument("--runner", choices=["v1", "v2"], default="v2")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--kv-gib", type=float, default=4.0)
    ap.add_argument("--throughput", action="store_true")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batch-invariant", default="off")  # read by gpu_validate.run_throughput when it starts an engine
    ap.add_argument("--compare", nargs="+", default=None)
    ap.add_argument("--scratch", default=os.environ.get("CB_SCRATCH", "/tmp"))
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.runner == "v1":
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    if args.compare:
        res = compare(args.compare)
    else:
        res = run_throughput(args) if args.throughput else run_checks(args)
    Path(args.out).write_text(json.dumps(res, indent=2, default=str))
    print(json.dumps({"summary": {k: v for k, v in res.items() if k in ("tp", "pp", "all_ok", "startup_s")}}), flush=True)
    return 0 if res.get("all_ok") else 1


if __name__ == "__main__":
    sys.exit(main())
