"""`causalboard state-check`: the sentinel 4-arm recurrent-state check of a hybrid model.

    causalboard state-check                         # on the server at --url (env CAUSALBOARD_URL)
    causalboard state-check --model ./my-hybrid     # on a local engine started for the check
    causalboard state-check --probe 1 --probe 1,235,295 --json

Prints one line per arm (did the outputs change against the clean baseline, did the guard fire,
was that what a hygienic engine shows) and the verdict; exits 0 when the served model is hygienic,
1 when it is not (or the check failed), 2 on bad input. docs/hybrid-models.md explains the arms.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8000"
EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


def _fail(code: int, message: str) -> int:
    print(f"causalboard: {message}", file=sys.stderr)
    return code


def parse_probe(text: str) -> list[int]:
    """`1,235,295` -> [1, 235, 295] (token ids)."""
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise ValueError(f"--probe {text!r}: write token ids separated by commas, e.g. 1,235,295") from None
    if not ids or any(t < 0 for t in ids):
        raise ValueError(f"--probe {text!r}: give at least one non-negative token id")
    return ids


def format_report(report: dict) -> str:
    lines = [f"state check on {report['model']} ({report['architecture']}, {report['dtype']}, {report['device']}): "
             f"{len(report['probes'])} probes x {report['max_tokens']} tokens, sentinel std {report['sentinel_std']}"]
    lines.append(f"  {'arm':<18} {'changed':<8} {'guard':<6} {'zeroed':>6} {'filled':>6}  expected")
    for a in report["arms"]:
        lines.append(f"  {a['arm']:<18} {str(a['changed']).lower():<8} {str(a['guard_fired']).lower():<6} "
                     f"{a['slots_zeroed']:>6} {a['slots_filled']:>6}  {'yes' if a['as_expected'] else 'NO'}")
    if report["mask_misses"]:
        lines.append(f"  vLLM's has_initial_state mask alone misses: {report['mask_misses']}")
    lines.append("verdict: " + ("hygienic (reallocated state slots cannot leak into a request)" if report["hygienic"]
                                else "NOT hygienic: do not trust results on this engine (see docs/hybrid-models.md)"))
    return "\n".join(lines)


def cmd_state_check(args: argparse.Namespace) -> int:
    try:
        probes = [parse_probe(p) for p in args.probe] if args.probe else None
    except ValueError as exc:
        return _fail(EXIT_BAD_INPUT, str(exc))
    options: dict[str, Any] = {"max_tokens": args.max_tokens, "sentinel_std": args.sentinel_std, "seed": args.seed}
    if args.model:
        from engine_ext import Engine, SpecError

        try:
            with Engine(model=args.model, device=args.device, dtype=args.dtype, enforce_eager=True) as eng:
                report = eng.state_check(probes, **options)
        except SpecError as exc:
            return _fail(EXIT_BAD_INPUT, str(exc))
    else:
        import httpx

        logging.getLogger("httpx").setLevel(logging.WARNING)
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        body = {**options, **({"probes": probes} if probes else {})}
        try:
            r = httpx.post(args.url.rstrip("/") + "/v1/state_check", json=body, headers=headers, timeout=args.timeout)
        except httpx.TransportError as exc:
            return _fail(EXIT_FAILED, f"cannot talk to the server at {args.url}: {exc or type(exc).__name__}")
        if r.status_code != 200:
            try:
                msg = r.json().get("error") or r.text
            except ValueError:
                msg = r.text
            return _fail(EXIT_BAD_INPUT if 400 <= r.status_code < 500 else EXIT_FAILED,
                         f"the server refused the check ({r.status_code}): {msg}")
        report = r.json()
    print(json.dumps(report) if args.json else format_report(report))
    return EXIT_OK if report["hygienic"] else EXIT_FAILED


def add_parsers(sub: Any) -> None:
    sc = sub.add_parser("state-check", help="sentinel 4-arm recurrent-state check of a hybrid model",
                        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = sc.add_argument_group("where")
    where.add_argument("--url", default=os.environ.get("CAUSALBOARD_URL", DEFAULT_URL), help="server URL (env CAUSALBOARD_URL)")
    where.add_argument("--api-key", default=os.environ.get("CAUSALBOARD_API_KEY"), help="bearer token (env CAUSALBOARD_API_KEY)")
    where.add_argument("--timeout", type=float, default=600.0)
    where.add_argument("--model", help="instead of a server: start an engine on this local hybrid model folder")
    where.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="with --model")
    where.add_argument("--dtype", default="bfloat16", help="with --model (default bfloat16)")
    what = sc.add_argument_group("check")
    what.add_argument("--probe", action="append", metavar="IDS", help="token ids of a probe prompt, e.g. 1,235,295; repeatable "
                                                                     "(default: a 1-token, a 3-token and a longer prompt)")
    what.add_argument("--max-tokens", type=int, default=4)
    what.add_argument("--sentinel-std", type=float, default=1.0)
    what.add_argument("--seed", type=int, default=0)
    what.add_argument("--json", action="store_true", help="print the report as JSON")
    sc.set_defaults(func=cmd_state_check)
