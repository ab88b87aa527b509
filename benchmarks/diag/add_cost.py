"""Client-side cost of submitting one request to vLLM's engine core (issue #13: the engine thread
spends a share of a GPU sweep in `LLMEngine.add_request`): stock vLLM's `LLM.generate` with each
`add_request` timed, on P1c's 2048 one-token requests of a 128-token prompt (`prefix_only` reuse).
Compare with causalboard's own adds, timed by `sweep_http.py --stack-dir` (`client_events`, kind
`add`; the sampler there adds its own GIL waits to the tail, so compare medians).

    python3 benchmarks/diag/add_cost.py --model DIR
Output: one JSON line per repetition: adds, their median / mean / p90 in ms, and the wall time.
"""
import argparse
import json
import random
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    from vllm import LLM, SamplingParams

    from benchmarks.compare.stock_diag import p1c_prefix_only_requests, p1c_prompt

    llm = LLM(model=args.model, dtype="bfloat16", attention_backend="TRITON_ATTN", seed=0,
              gpu_memory_utilization=0.8, enable_prefix_caching=True)
    engine = llm.llm_engine
    times: list[float] = []
    orig = engine.add_request

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return orig(*a, **k)
        finally:
            times.append(time.perf_counter() - t)

    engine.add_request = timed
    tails, base = random.Random(6), p1c_prompt()
    sp = SamplingParams(max_tokens=1, temperature=0.0, logprob_token_ids=[1000, 2000])

    def reqs():
        return p1c_prefix_only_requests(base, tails)

    llm.generate([{"prompt_token_ids": base}], sp, use_tqdm=False)
    llm.generate(reqs(), sp, use_tqdm=False)
    for rep in range(args.reps):
        batch = reqs()
        times.clear()
        t = time.perf_counter()
        llm.generate(batch, sp, use_tqdm=False)
        wall = time.perf_counter() - t
        ms = sorted(x * 1000 for x in times)
        print(json.dumps({"bench": "stock_add_cost", "rep": rep, "adds": len(ms), "median_ms": round(statistics.median(ms), 4),
                          "mean_ms": round(statistics.mean(ms), 4), "p90_ms": round(ms[int(0.9 * len(ms))], 4),
                          "sum_s": round(sum(ms) / 1000, 4), "wall_s": round(wall, 4)}), flush=True)


if __name__ == "__main__":
    main()
