"""Read the events of `benchmarks/diag/servetimes/` (one server's HTTP requests, front-end request
registrations and engine-step outputs) and print, per burst of concurrent requests, where its time
went (issue 13: `causalboard serve` against `vllm serve`, decode at batch 32):

    python3 benchmarks/diag/serve_timeline.py DIR [--json]

A burst is a run of /v1/completions requests that overlap in time (http_bench.py sends each batch
all at once and waits for the last answer). Times in ms from the burst's first arrival:
  arrived   the last request's arrival at the application,
  added     the first and the last registration with the front end (`add`),
  first_out the first engine step's outputs taken in (the end of the first step that returned any),
  steps     engine steps whose outputs were taken in, and their median period,
  last_out  the end of taking in the last step's outputs,
  done      the last response sent;
so `added` late against `arrived` is the HTTP handler's cost, a long `first_out` the first step's,
and `done - last_out` the time from the engine's last step to the answers.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def load(folder: Path) -> list[list]:
    events = []
    for f in sorted(folder.glob("servetimes-*.jsonl")):
        events += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return sorted(events, key=lambda e: e[1])


def bursts(events: list[list]) -> list[dict]:
    """Per burst (see the module docstring), its figures in ms."""
    http = [e for e in events if e[0] == "http"]
    groups: list[list[list]] = []
    end = -1
    for e in http:
        if e[1] > end:
            groups.append([])
        groups[-1].append(e)
        end = max(end, e[1] + e[2])
    out = []
    for g in groups:
        t0, t_end = g[0][1], max(e[1] + e[2] for e in g)
        inside = [e for e in events if t0 <= e[1] <= t_end]
        adds = [e for e in inside if e[0] == "add"]
        outs = [e for e in inside if e[0] == "out" and e[3] > 0]
        ms = lambda t: round((t - t0) / 1e6, 2)  # noqa: E731
        periods = [(b[1] - a[1]) / 1e6 for a, b in zip(outs, outs[1:])]
        out.append({
            "requests": len(g), "arrived": ms(g[-1][1]),
            "added": [ms(adds[0][1]), ms(adds[-1][1] + adds[-1][2])] if adds else None,
            "add_us_median": round(statistics.median(e[2] for e in adds) / 1e3, 1) if adds else None,
            "first_out": ms(outs[0][1] + outs[0][2]) if outs else None,
            "steps": len(outs), "period_ms_median": round(statistics.median(periods), 3) if periods else None,
            "out_us_median": round(statistics.median(e[2] for e in outs) / 1e3, 1) if outs else None,
            "last_out": ms(outs[-1][1] + outs[-1][2]) if outs else None,
            "done": ms(t_end),
        })
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--json", action="store_true", help="one JSON line per burst")
    args = ap.parse_args(argv)
    rows = bursts(load(args.dir))
    if not rows:
        print(f"no /v1/completions requests recorded in {args.dir}", file=sys.stderr)
        return 1
    for r in rows:
        if args.json:
            print(json.dumps({"bench": "serve_timeline", **r}))
        else:
            print(f"{r['requests']:4d} req  arrived {r['arrived']:8.2f}  added {r['added']}  first_out {r['first_out']}  "
                  f"steps {r['steps']:4d} x {r['period_ms_median']} ms  last_out {r['last_out']}  done {r['done']:9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
