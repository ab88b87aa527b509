"""Cost of the zero-on-realloc guard on a hybrid model (docs/hybrid-models.md, "Measured cost").

    python -m benchmarks.hybrid_state_hygiene [--model DIR] [--device cpu|cuda] [--requests 64] [--rounds 3]

Serves the model (default: the tiny random Qwen3-Next, built into a temporary folder) and runs,
for each round, the same burst of short requests (every one a new request, so every one gets a
reallocated state slot) with the guard on (`zero`) and off (stock vLLM), alternating which goes
first. Prints one JSON line per burst (mode, requests/s) and a summary with the guard's own time
per zeroed slot (the worker's `seconds / slots_zeroed` counter: host time of the zeroing; on CUDA
that is the time to enqueue it, including the small host-to-device copy of the block index).
No timed assertions anywhere: this is the measurement the docs quote.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from engine_ext import Engine, GenerationParams
    from engine_ext.models.tiny_hybrid import build_tiny_hybrid

    model = args.model or str(build_tiny_hybrid(tempfile.mkdtemp(prefix="tiny-hybrid-")))
    params = GenerationParams(max_tokens=args.max_tokens, ignore_eos=True)
    with Engine(model=model, device=args.device, dtype=args.dtype, enforce_eager=True) as eng:
        vocab = eng.info.vocab_size
        prompts = [[1] + [(13 * i + 7 * j + 5) % (vocab - 3) + 3 for j in range(args.prompt_tokens - 1)]
                   for i in range(args.requests)]
        eng.generate(prompts[:8], params)  # warm-up
        rates: dict[str, list[float]] = {"zero": [], "off": []}
        for r in range(args.rounds):
            for mode in (("zero", "off") if r % 2 == 0 else ("off", "zero")):
                eng._rpc("cb_state_hygiene", {"mode": mode, "reset": True})
                t0 = time.perf_counter()
                eng.generate(prompts, params)
                dt = time.perf_counter() - t0
                rates[mode].append(args.requests / dt)
                print(json.dumps({"round": r, "mode": mode, "requests": args.requests, "seconds": round(dt, 4),
                                  "requests_per_s": round(args.requests / dt, 2)}), flush=True)
        eng._rpc("cb_state_hygiene", {"mode": "zero", "reset": True})
        eng.generate(prompts, params)
        c = eng.state_hygiene()
        info = eng.info
    summary = {
        "model": info.model, "device": info.device, "dtype": info.dtype, "state_layers": c["state_layers"],
        "requests": args.requests, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
        "median_rps_guard_on": round(statistics.median(rates["zero"]), 2),
        "median_rps_guard_off": round(statistics.median(rates["off"]), 2),
        "ratio_on_over_off": round(statistics.median(rates["zero"]) / statistics.median(rates["off"]), 3),
        "slots_zeroed": c["slots_zeroed"], "zeroing_events": c["events"],
        "guard_us_per_slot": round(1e6 * c["seconds"] / max(c["slots_zeroed"], 1), 2),
        "guard_us_per_step": round(1e6 * c["seconds"] / max(c["events"], 1), 2),
    }
    print(json.dumps({"summary": summary}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
