"""Hybrid (Qwen3-Next) check on one GPU: oracle agreement, the 1-token stale-state case, the
sentinel 4-arm check, a patch sweep over HTTP vs the oracle, and the guard's cost. Needs the
MoE-carrying bundle (`BUNDLE_MOE=1`, docs/hybrid-models.md, "GPU") and, for the sweep, uvicorn
carried as for `benchmarks/gpu_sweep.py`.

    source .vbundle/gpu_env.sh
    python3 benchmarks/hybrid_gpu_check.py --out $OUT/hybrid-gpu.json

Builds the tiny random hybrid (`engine_ext.models.tiny_hybrid`) into a scratch folder, serves it
on CUDA (bf16, eager; `--compiled` for torch.compile + CUDA graphs) and prints JSON lines:
captures at every residual-stream site (`pre_attn`, `post_attn`, `post_block` of each layer; not the
MLP-branch sites) vs the transformers oracle (bf16, on the GPU), the 1-token prompt after
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


def _sweep_vs_oracle(eng, ref) -> dict:
    """A post_block patch sweep (corrupt "Zorn" <- clean "Tarn") over the real HTTP API vs the
    oracle patching the same cells by hand (as tests/test_hybrid_models.py does on CPU)."""
    import httpx
    import numpy as np

    from benchmarks.gpu_sweep import _serve
    from engine_ext.reference.hf import RefEdit

    clean, corrupt = "The capital of Tarn is", "The capital of Zorn is"
    cids, ids = eng.tokenize(clean), eng.tokenize(corrupt)
    answer = ref.greedy(cids, 1).token_ids[0]
    url, server = _serve(eng)
    try:
        t0 = time.perf_counter()
        with httpx.Client(base_url=url, timeout=600) as http:
            r = http.post("/v1/patch_sweep", json={"prompt": corrupt, "clean_prompt": clean, "answer_token_id": answer,
                                                   "metric": "logprob", "hook": "post_block"})
        seconds = time.perf_counter() - t0
    finally:
        server.should_exit = True
    if r.status_code != 200:
        return {"status": r.status_code, "error": r.text[:500], "passed": False}
    res = r.json()
    grid = np.array(res["grid"], dtype=float)
    n_layers = grid.shape[0]
    clean_run = ref.run(cids, capture=[(layer, "post_block") for layer in range(n_layers)])
    worst = 0.0
    for layer in range(n_layers):
        for pos in range(len(ids)):
            target = clean_run.captures[(layer, "post_block")].cpu().numpy()[pos:pos + 1]
            want = ref.score(ids, [answer], edits=[RefEdit.patch((layer, "post_block"), [pos], target)])[answer]
            worst = max(worst, abs(grid[layer, pos] - want))
    restored = abs(grid[-1, -1] - res["clean"])
    return {"shape": list(grid.shape), "seconds": round(seconds, 2), "worst_cell_diff_vs_oracle": worst,
            "last_cell_minus_clean": restored, "passed": bool(worst <= 0.1 and restored < 1e-3)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--compiled", action="store_true")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script on the CPU engine")
    ap.add_argument("--skip-hygiene-bench", action="store_true")
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
    with Engine(model=str(path), device=args.device, dtype="bfloat16", enforce_eager=not args.compiled) as eng:
        emit(rows, step="start", seconds=round(time.perf_counter() - t0, 1), info=eng.info.to_dict(), hygiene=eng.state_hygiene())
        ref = HFReference(path, dtype="bfloat16", device=args.device)
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
        emit(rows, step="sweep", **_sweep_vs_oracle(eng, ref))
        report = eng.state_check()
        emit(rows, step="state_check", hygienic=report["hygienic"], mask_misses=report["mask_misses"],
             arms=[{k: a[k] for k in ("arm", "changed", "guard_fired", "slots_zeroed", "slots_filled", "as_expected")}
                   for a in report["arms"]], seconds=report["seconds"])
    from benchmarks import hybrid_state_hygiene

    if not args.skip_hygiene_bench:
        hybrid_state_hygiene.main(["--model", str(path), "--device", args.device, "--requests", "256", "--rounds", "5"])
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
