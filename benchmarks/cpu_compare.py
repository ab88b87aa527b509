"""CPU side by side (the embedded default): stock vLLM's `LLM` vs causalboard's `Engine` on the
bundled model, one engine per process. Alternate processes (the CPU's speed is bimodal per
process; see docs/performance.md), e.g.:

    for i in 1 2 3; do for e in stock cb cb-nobi; do
      .venv/bin/python benchmarks/cpu_compare.py --engine $e 2>/dev/null | grep '^{"bench"' >> /tmp/cpu.jsonl; done; done

Workloads (the performance issue's CPU rows): 256 one-token requests (the bundled model's fact
prompts, cycled), and a decode of 8 requests x 48 tokens (`ignore_eos`), each timed `--reps`
times after a warm-up; one JSON line per figure with every repetition. Both engines run with
their defaults (stock: vLLM's engine core in its own process; causalboard: in-process on CPU,
float32, eager, 32-token KV blocks, batch invariance; `cb-nobi` without it);
VLLM_CPU_KVCACHE_SPACE=1 as in the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=["stock", "cb", "cb-nobi"], required=True,
                    help="cb: causalboard's defaults (batch invariance on: row-invariant linear layers where the "
                         "host's GEMM is not); cb-nobi: batch invariance off (vLLM's kernels as they are)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--requests", type=int, default=256)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from engine_ext import BUNDLED_MODEL_PATH

    tasks = json.loads((BUNDLED_MODEL_PATH / "tasks.json").read_text())
    facts = [f["prompt"] for f in tasks["facts"]]
    prompts = [facts[i % len(facts)] for i in range(args.requests)]
    decode_prompts = facts[:8]
    t0 = time.perf_counter()
    if args.engine == "stock":
        from vllm import LLM, SamplingParams

        llm = LLM(model=str(BUNDLED_MODEL_PATH), dtype="float32", enforce_eager=True, seed=0)
        one, dec = SamplingParams(max_tokens=1, temperature=0.0), SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)

        def run_one() -> int:
            return len(llm.generate(prompts, one, use_tqdm=False))

        def run_decode() -> int:
            return sum(len(o.outputs[0].token_ids) for o in llm.generate(decode_prompts, dec, use_tqdm=False))
        close = lambda: None  # noqa: E731
    else:
        from engine_ext import Engine, GenerationParams

        eng = Engine(device="cpu", batch_invariant=None if args.engine == "cb" else False).start()
        one, dec = GenerationParams(max_tokens=1), GenerationParams(max_tokens=48, ignore_eos=True)

        def run_one() -> int:
            return len(eng.generate(prompts, one))

        def run_decode() -> int:
            return sum(len(g.token_ids) for g in eng.generate(decode_prompts, dec))
        close = eng.close
    start_s = time.perf_counter() - t0
    out = []
    for name, fn, unit in (("one_token_requests", run_one, "req_per_s"), ("decode_8x48", run_decode, "tok_per_s")):
        fn()  # warm-up
        reps = []
        for _ in range(args.reps):
            t = time.perf_counter()
            n = fn()
            reps.append((n, time.perf_counter() - t))
        rates = sorted(n / dt for n, dt in reps)
        out.append({"bench": "cpu_compare", "engine": args.engine, "task": name, unit: round(rates[len(rates) // 2], 1),
                    "reps": [round(n / dt, 1) for n, dt in reps], "start_s": round(start_s, 1), "pid": os.getpid(),
                    "cpu_gemm": eng.info.cpu_gemm if args.engine != "stock" else None,
                    "load": os.getloadavg()[0]})
    close()
    for line in out:
        print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
