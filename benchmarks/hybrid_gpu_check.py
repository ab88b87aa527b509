"""Hybrid (Qwen3-Next) check on one GPU: oracle agreement, the 1-token stale-state case, the
sentinel 4-arm check and the guard's cost. For the lead to run once the GPU bundle carries the
MoE kernels and the two extra deps (docs/hybrid-models.md, "GPU"); not run so far.

    source .vbundle/gpu_env.sh
    python3 benchmarks/hybrid_gpu_check.py --out $OUT/hybrid-gpu.json

Builds the tiny random hybrid (`engine_ext.models.tiny_hybrid`) into a scratch folder, serves it
on CUDA (bf16, eager; `--compiled` for torch.compile + CUDA graphs) and prints JSON lines:
captures at every site vs the transformers oracle (bf16, on the GPU), the 1-token prompt after
other requests with the guard on / off, the 4-arm report, then
`benchmarks.hybrid_state_hygiene`'s guard-on/off bursts.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def emit(out: list, **row) -> None:
    out.append(row)
    print(json.dumps(row), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--compiled", action="store_true")
    args = ap.parse_args()

    import numpy as np

    from engine_ext import Engine, GenerationParams
    from engine_ext.models.tiny_hybrid import build_tiny_hybrid
    from engine_ext.reference.hf import HFReference

    rows: list = []
    path = build_tiny_hybrid(tempfile.mkdtemp(prefix="tiny-hybrid-"))
    sites = [(layer, hook) for layer in range(4) for hook in ("pre_attn", "post_attn", "post_block")]
    greedy = GenerationParams(max_tokens=4, ignore_eos=True, logprobs=0)
    t0 = time.perf_counter()
    with Engine(model=str(path), device="cuda", dtype="bfloat16", enforce_eager=not args.compiled) as eng:
        emit(rows, step="start", seconds=round(time.perf_counter() - t0, 1), info=eng.info.to_dict(), hygiene=eng.state_hygiene())
        ref = HFReference(path, dtype="bfloat16", device="cuda")
        prompt = "The capital of Tarn is"
        ids = eng.tokenize(prompt)
        gen = eng.capture(prompt, [f"L{layer}.{hook}" for layer, hook in sites], "all_prompt")
        run = ref.run(ids, capture=sites)
        rel = {}
        for layer, hook in sites:
            mine = np.stack([gen.captures[(layer, hook, p)] for p in range(len(ids))]).astype(np.float64)
            want = run.captures[(layer, hook)].cpu().numpy().astype(np.float64)
            rel[f"L{layer}.{hook}"] = float(np.linalg.norm(mine - want) / max(np.linalg.norm(want), 1e-9))
        g, r = eng.generate(ids, greedy), ref.generate(ids, 4, stop_at_eos=False)
        emit(rows, step="oracle", rel_l2=rel, worst_rel_l2=max(rel.values()), greedy_equal=g.token_ids == r.token_ids,
             max_logprob_diff=float(np.max(np.abs(np.array(g.logprobs) - np.array(r.logprobs)))))
        bos = ids[:1]
        fresh = eng.generate(bos, greedy)
        stale = {}
        for mode in ("zero", "off"):
            eng._rpc("cb_state_hygiene", {"mode": mode})
            outs = []
            for p in ("Garrow is ruled by", "a b c d e f g", "The capital of Port Grisk is"):
                eng.generate(p, GenerationParams(max_tokens=3, ignore_eos=True))
                outs.append(eng.generate(bos, greedy).token_ids)
            stale[mode] = outs
        eng._rpc("cb_state_hygiene", {"mode": "zero"})
        emit(rows, step="one_token_prompt", fresh=fresh.token_ids, guard_on=stale["zero"], guard_off=stale["off"],
             guard_on_equal_fresh=all(o == fresh.token_ids for o in stale["zero"]))
        report = eng.state_check()
        emit(rows, step="state_check", hygienic=report["hygienic"], mask_misses=report["mask_misses"],
             arms=[{k: a[k] for k in ("arm", "changed", "guard_fired", "slots_zeroed", "slots_filled", "as_expected")}
                   for a in report["arms"]], seconds=report["seconds"])
    from benchmarks import hybrid_state_hygiene

    hybrid_state_hygiene.main(["--model", str(path), "--device", "cuda", "--requests", "256", "--rounds", "5"])
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
