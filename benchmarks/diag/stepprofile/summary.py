"""Summaries of `stepprofile` files (see `sitecustomize.py` here): per file, the profiled
microseconds per step and the top functions by own time and by cumulative time, in calls and
microseconds per step.

    python3 benchmarks/diag/stepprofile/summary.py DIR [--top 25]
"""
import argparse
import glob
import os
import pstats


def _name(func: tuple) -> str:
    path, line, name = func
    if path == "~":
        return name
    parts = path.split("/")
    short = "/".join(parts[-2:]) if "engine_ext" in path or "vllm" in path else parts[-1]
    return f"{short}:{line}({name})"


def table(stats: pstats.Stats, steps: int, key: int, top: int) -> list[str]:
    """Rows `calls/step  own µs/step  cumulative µs/step  function`, sorted by field `key`
    (2: own time, 3: cumulative) of pstats' (cc, nc, tt, ct, callers)."""
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][key])[:top]
    return [f"{nc / steps:8.2f} {tt / steps * 1e6:9.1f} {ct / steps * 1e6:9.1f}  {_name(func)}"
            for func, (cc, nc, tt, ct, callers) in rows]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    for path in sorted(glob.glob(os.path.join(args.dir, "*.pstats"))):
        steps = int(os.path.basename(path).rsplit("-", 1)[1].split(".")[0])
        st = pstats.Stats(path)
        print(f"===== {os.path.basename(path)}: {steps} steps, {st.total_tt / steps * 1e6:.1f} µs per step (profiled)")
        for key, label in ((2, "own time"), (3, "cumulative")):
            print(f"-- by {label}: calls/step, own µs/step, cumulative µs/step")
            print("\n".join(table(st, steps, key, args.top)))


if __name__ == "__main__":
    main()
