"""The client's timeline per `Engine.generate` that the step-times recorder wrote
(`client-<pid>.jsonl` in its folder: see `sitecustomize.py` here), as medians per variant.

    python3 benchmarks/diag/steptimes/summary.py $OUT/steptimes --variants vanilla,monitor_only,threshold_on,proportional,static_steer

`--variants`: the order in which the benchmark ran its variants in every repetition
(`dynamic_bench.py`: vanilla first, then its `--variants` in its own order, static steering last);
warm-up calls (shorter runs than `--steps`) are left out. One line per variant: first engine step
returned, `cb_collect` sent -> answered, answered -> `generate` returned, the whole call (ms)."""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics


def rows(folder: str, steps: int) -> list[dict]:
    out = []
    for path in sorted(glob.glob(os.path.join(folder, "client-*.jsonl"))):
        with open(path) as f:
            out += [r for r in map(json.loads, f) if r.get("steps") == steps]
    return out


def summarize(records: list[dict], variants: list[str]) -> dict[str, dict[str, float | None]]:
    """Medians per variant; records are assigned to `variants` in turn."""
    by: dict[str, list[dict]] = {v: [] for v in variants}
    for i, r in enumerate(records):
        by[variants[i % len(variants)]].append(r)

    def med(rs: list[dict], f) -> float | None:
        vals = [v for v in map(f, rs) if v is not None]
        return round(statistics.median(vals), 1) if vals else None

    return {v: {"n": len(rs), "first_step_ms": med(rs, _first), "collect_ms": med(rs, _collect),
                "after_reply_ms": med(rs, _after), "generate_ms": med(rs, _end)} for v, rs in by.items() if rs}


def _first(r: dict) -> float | None:
    return r.get("first_step")


def _collect(r: dict) -> float | None:
    return r["collect_reply"] - r["collect_sent"] if "collect_reply" in r else None


def _after(r: dict) -> float | None:
    return r["end"] - r["collect_reply"] if "collect_reply" in r else None


def _end(r: dict) -> float | None:
    return r.get("end")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folder")
    ap.add_argument("--variants", required=True, help="comma-separated, in the order each repetition ran them")
    ap.add_argument("--steps", type=int, default=256, help="engine steps of a timed call (the benchmark's --tokens)")
    args = ap.parse_args()
    for name, rec in summarize(rows(args.folder, args.steps), args.variants.split(",")).items():
        print(json.dumps({"variant": name, **rec}))


if __name__ == "__main__":
    main()
