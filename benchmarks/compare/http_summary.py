#!/usr/bin/env python3
"""Summarise http_bench.py result files of one device call (gpu_http_call.sh's $OUT/http-*.out):
per task and server variant, each server process's median, the median over its processes, and
causalboard over stock as a throughput ratio, both from those medians and as the geometric mean of
the rounds' paired ratios (`ROUNDS=N`: stock and each variant alternated, files `...-rN.out`).

One process per server decides a decode figure by the process it drew (docs/performance.md,
"Twenty-second session"), so compare servers over several processes when the ratio matters.

    python3 benchmarks/compare/http_summary.py OUT/http-*.out     # one JSON line per task and variant
"""
from __future__ import annotations

import json
import math
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def task_key(line: dict) -> str | None:
    """`p1`, `p2_b32`, `p2_b1`, ... for a result line; None for start-up and other lines."""
    if "median_s" not in line or "task" not in line:
        return None
    return line["task"] + (f"_b{line['batch']}" if "batch" in line else "")


def read(paths: list[str]) -> dict[str, dict[str, dict[int, float]]]:
    """{task: {variant: {round: median seconds}}}; the variant is the file's name less `http-` and `-rN`."""
    out: dict[str, dict[str, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    for p in paths:
        m = re.fullmatch(r"http-(.+?)(?:-r(\d+))?\.out", Path(p).name)
        if not m:
            continue
        variant, rnd = m.group(1), int(m.group(2) or 1)
        for raw in Path(p).read_text(errors="replace").splitlines():
            if not raw.startswith("{"):
                continue
            try:
                line = json.loads(raw)
            except json.JSONDecodeError:
                continue
            key = task_key(line)
            if key:
                out[key][variant][rnd] = float(line["median_s"])
    return out


def summarise(results: dict[str, dict[str, dict[int, float]]]) -> list[dict]:
    rows = []
    for task, variants in sorted(results.items()):
        stock = variants.get("stock", {})
        for variant, by_round in sorted(variants.items()):
            row = {"bench": "http_summary", "task": task, "server": variant,
                   "process_medians_s": [by_round[r] for r in sorted(by_round)],
                   "median_s": round(statistics.median(by_round.values()), 4)}
            if variant != "stock" and stock:
                row["vs_stock"] = round(statistics.median(stock.values()) / row["median_s"], 3)
                paired = [stock[r] / by_round[r] for r in sorted(by_round) if r in stock]
                if paired:
                    row["paired_ratios"] = [round(x, 3) for x in paired]
                    row["paired_geomean"] = round(math.exp(statistics.fmean(math.log(x) for x in paired)), 3)
            rows.append(row)
    return rows


def main() -> None:
    for row in summarise(read(sys.argv[1:])):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
