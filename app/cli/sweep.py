"""`causalboard sweep` and `causalboard export`: run a patch sweep on a server from the shell,
save it, draw it, and re-export saved results.

    causalboard sweep --prompt "Garrow is ruled by" --clean-prompt "Guzar is ruled by" \\
        --answer " Hadrian" --metric recovered --layers 0:6 --out trace.npz --figure trace.pdf
    causalboard export trace.npz --out figures/ --formats pdf,png,csv

Exit codes: 0 ok; 2 bad input (an option that does not parse, or a 4xx from the server — the
message names the request field); 1 anything else (server unreachable, server error, I/O).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from engine_ext.errors import SpecError
from engine_ext.sites import HOOKS, parse_layers, parse_positions, parse_span

from app.sweep.result import SweepResult

DEFAULT_URL = "http://127.0.0.1:8000"
EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
EXPORT_FORMATS = ("pdf", "svg", "png", "csv", "npz", "json")
DEFAULT_EXPORT_FORMATS = ("pdf", "svg", "png", "csv", "npz")


class OptionError(Exception):
    """An option value that does not parse; `field` is the request field it feeds."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


# ---- option parsing (selector syntax: engine_ext.sites) -----------------------------------------
def _selector(parse, text: str, field: str):
    try:
        return parse(text, field)
    except SpecError as exc:
        raise OptionError(exc.field, exc.message) from None


def _names(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def build_request(args: argparse.Namespace) -> dict:
    """The `POST /v1/patch_sweep` body for the parsed options (only options given are sent, so
    the server's defaults apply)."""
    req: dict[str, Any] = {"prompt": args.prompt}
    for opt, key in (("clean_prompt", "clean_prompt"), ("source_run", "source_run"), ("source_module", "source_module"),
                     ("answer", "answer_token"), ("answer_id", "answer_token_id"), ("foil", "foil_token"),
                     ("foil_id", "foil_token_id"), ("metric", "metric"), ("recovered_basis", "recovered_basis"),
                     ("clean_baseline", "clean_baseline"), ("alpha", "alpha"), ("hook", "hook"), ("model", "model"),
                     ("max_concurrency", "max_concurrency"), ("noise_floor_samples", "noise_floor_samples"),
                     ("prefix_reuse", "prefix_reuse")):
        value = getattr(args, opt)
        if value is not None:
            req[key] = value
    if args.hooks is not None:
        req["hooks"] = _names(args.hooks)
        if not req["hooks"]:
            raise OptionError("hooks", "is empty (use e.g. --hooks pre_attn,post_block)")
    if args.mask is not None:
        dims = _selector(parse_layers, args.mask, "mask")  # the same integer selector syntax
        if dims is None:
            raise OptionError("mask", "name the dimensions (e.g. --mask 12,40,815 or 0-63); 'all' is the same as no mask")
        req["mask"] = {"indices": dims}
    if args.layers is not None:
        layers = _selector(parse_layers, args.layers, "layers")
        if layers is not None:
            req["layers"] = layers
    if args.positions:
        req["positions"] = _selector(parse_positions, ",".join(args.positions), "positions")
    if args.subject is not None:
        req["subject"] = _selector(parse_span, args.subject, "subject")
    noise = _noise(args)
    if noise is not None:
        req["noise"] = noise
    if args.keep_source:
        req["keep_source"] = True
    return req


def _noise(args: argparse.Namespace) -> dict | None:
    tuning = {k: getattr(args, f"noise_{k}") for k in ("scale", "seed", "samples")}
    if args.noise_span is None and args.noise_positions is None:
        if any(v is not None for v in tuning.values()):
            raise OptionError("noise", "--noise-scale/--noise-seed/--noise-samples need --noise-span or --noise-positions")
        return None
    noise: dict[str, Any] = {}
    if args.noise_span is not None:
        noise.update(_selector(parse_span, args.noise_span, "noise.span"))
    if args.noise_positions is not None:
        positions = _selector(parse_positions, args.noise_positions, "noise.positions")
        if isinstance(positions, str) or any(not isinstance(p, int) for p in positions):
            raise OptionError("noise.positions", "give token indices, e.g. 1,2 or 1-3")
        noise["positions"] = positions
    noise.update({k: v for k, v in tuning.items() if v is not None})
    return noise


# ---- the text summary ---------------------------------------------------------------------------
def _fmt(value: Any) -> str:
    return "n/a" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def format_summary(result: SweepResult, top_k: int = 5) -> str:
    """A few lines for a terminal: what ran, baselines, noise floor, the top cells with their
    tokens, skipped positions and voided cells."""
    meta = result.meta
    all_tokens = meta.get("token_strings") or []

    def token(pos: Any) -> str:
        return repr(all_tokens[pos]) if isinstance(pos, int) and 0 <= pos < len(all_tokens) else ""

    metric = result.metric
    if metric == "recovered" and meta.get("recovered_basis"):
        metric += f" (of {meta['recovered_basis']})"
    if meta.get("metric_requested") and meta["metric_requested"] != result.metric:
        metric += f" [asked for {meta['metric_requested']}]"
    head = f"sweep {meta.get('sweep_id', '')}".rstrip()
    if meta.get("model"):
        head += f" on {meta['model']}"
    cells = meta.get("cells_total")
    timing = f" in {meta['elapsed_s']:.1f} s" if isinstance(meta.get("elapsed_s"), (int, float)) else ""
    lines = [
        f"{head}: metric {metric}, hook{'s' if len(result.hooks) > 1 else ''} {', '.join(result.hooks)}, "
        f"{_count(len(result.layers), 'layer')} x {_count(len(result.positions), 'position')}"
        + (f" ({cells} cells, {meta.get('cells_voided', 0)} voided)" if cells is not None else "") + timing,
        f"clean {_fmt(meta.get('clean'))}   corrupt {_fmt(meta.get('corrupt'))}   noise floor {_fmt(result.noise_floor)}",
    ]
    top = result.top(top_k)
    if top:
        lines.append("top cells:")
        multi = len(result.hooks) > 1
        for n, c in enumerate(top, 1):
            where = f"{c['hook']} " if multi else ""
            lines.append(f"  {n}. {where}L{c['layer']} pos {c['position']} {c['token']!r}: {c['value']:.4g}")
    else:
        lines.append("top cells: none (no cell has a value)")
    unaligned = [s for s in result.skipped if "layer" not in s]
    voided = [s for s in result.skipped if "layer" in s]
    if unaligned:
        lines.append("skipped positions: " + "; ".join(f"{s['position']} {token(s['position'])} ({s['reason']})".replace("  ", " ")
                                                      for s in unaligned))
    if voided:
        lines.append(f"voided cells ({len(voided)}): " + "; ".join(
            f"{s.get('hook', '')} L{s['layer']} pos {s['position']} ({s['reason']})" for s in voided[:5]) + (" ..." if len(voided) > 5 else ""))
    if meta.get("cancelled"):
        lines.append("cancelled: the sweep stopped before every cell ran")
    for note in meta.get("notes") or []:
        lines.append(f"note: {note}")
    return "\n".join(lines)


# ---- commands ----------------------------------------------------------------------------------
def _fail(code: int, message: str) -> int:
    print(f"causalboard: {message}", file=sys.stderr)
    return code


def _server_error(exc: Exception) -> int:
    from app.client import CausalboardError

    assert isinstance(exc, CausalboardError)
    field = f" (field: {exc.field})" if exc.field else ""
    code = EXIT_BAD_INPUT if 400 <= exc.status < 500 else EXIT_FAILED
    return _fail(code, f"the server refused the request: {exc.message}{field}" if code == EXIT_BAD_INPUT
                 else f"the sweep failed: {exc}{field}")


def _save_figures(result: SweepResult, path: str, width: str | float) -> list[Path]:
    """Draw `path` (one hook) or `<stem>_<hook><suffix>` per hook next to it (several hooks)."""
    from app.figures.export import plot_sweep, save_figure

    target = Path(path)
    fmt = target.suffix.lower().lstrip(".")
    paths = {result.hooks[0]: target} if len(result.hooks) == 1 else {
        h: target.with_name(f"{target.stem}_{h}{target.suffix}") for h in result.hooks}
    for hook, p in paths.items():
        save_figure(plot_sweep(result, hook=hook, width=width), p, fmt)
    return list(paths.values())


def _width(text: str) -> str | float:
    """`single`, `double` or a width in inches."""
    try:
        return float(text)
    except ValueError:
        return text


def cmd_sweep(args: argparse.Namespace) -> int:
    import httpx

    from app.client import CausalboardClient, CausalboardError

    logging.getLogger("httpx").setLevel(logging.WARNING)
    for opt, suffixes in (("out", (".json", ".npz")), ("figure", (".pdf", ".svg", ".png"))):
        path = getattr(args, opt)
        if path is not None and Path(path).suffix.lower() not in suffixes:
            return _fail(EXIT_BAD_INPUT, f"--{opt}: {path!r} must end in {' or '.join(suffixes)}")
    try:
        request = build_request(args)
    except OptionError as exc:
        return _fail(EXIT_BAD_INPUT, str(exc))
    try:
        with CausalboardClient(args.url, api_key=args.api_key or None, timeout=args.timeout) as client:
            # always streamed: the bar needs the events, and a broken stream is resumed
            result = client.patch_sweep(on_event=lambda ev: None, progress=not args.no_progress, **request)
    except CausalboardError as exc:
        return _server_error(exc)
    except httpx.TransportError as exc:
        return _fail(EXIT_FAILED, f"cannot talk to the server at {args.url}: {exc or type(exc).__name__}")
    print(json.dumps(result.to_summary()) if args.json else format_summary(result, args.top))
    try:
        if args.out:
            result.save(args.out)
            print(f"causalboard: wrote {args.out}", file=sys.stderr)
        if args.figure:
            for path in _save_figures(result, args.figure, args.figure_width):
                print(f"causalboard: wrote {path}", file=sys.stderr)
    except ImportError as exc:
        return _fail(EXIT_FAILED, f"cannot draw the figure: {exc}")
    except OSError as exc:
        return _fail(EXIT_FAILED, f"cannot write output: {exc}")
    except SpecError as exc:  # e.g. a bad --figure-width
        return _fail(EXIT_BAD_INPUT, f"cannot draw the figure: {exc}")
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    formats = _names(args.formats)
    unknown = [f for f in formats if f not in EXPORT_FORMATS]
    if unknown or not formats:
        problem = f"unknown format {unknown[0]!r}" if unknown else "is empty"
        return _fail(EXIT_BAD_INPUT, f"--formats: {problem} (choose from {','.join(EXPORT_FORMATS)})")
    try:
        result = SweepResult.load(args.result)
    except FileNotFoundError:
        return _fail(EXIT_BAD_INPUT, f"{args.result}: no such file")
    except (ValueError, KeyError, OSError) as exc:
        return _fail(EXIT_BAD_INPUT, f"{args.result}: not a saved sweep result ({exc})")
    try:
        from app.figures.export import export_sweep
    except ImportError as exc:
        return _fail(EXIT_FAILED, f"export is not available: {exc}")
    hooks = _names(args.hooks) if args.hooks else None
    try:
        manifest = export_sweep(result, args.out, stem=args.stem, formats=tuple(formats), hooks=hooks, width=_width(args.width))
    except SpecError as exc:  # a bad stem, hook or width
        return _fail(EXIT_BAD_INPUT, str(exc))
    except OSError as exc:
        return _fail(EXIT_FAILED, f"cannot write to {args.out}: {exc}")
    out = Path(args.out)
    for name in sorted(manifest.get("files") or {}):
        print(out / name)
    print(out / f"{args.stem}.manifest.json")
    return EXIT_OK


def add_parsers(sub: Any) -> None:
    """Register `sweep` and `export` on the CLI's subparsers."""
    sw = sub.add_parser("sweep", help="run a patch sweep on a causalboard server",
                        description="Run POST /v1/patch_sweep and print, save and draw the result.")
    conn = sw.add_argument_group("server")
    conn.add_argument("--url", default=os.environ.get("CAUSALBOARD_URL", DEFAULT_URL), help="server URL (env CAUSALBOARD_URL)")
    conn.add_argument("--api-key", default=os.environ.get("CAUSALBOARD_API_KEY"), help="bearer token (env CAUSALBOARD_API_KEY)")
    conn.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the next event")
    what = sw.add_argument_group("what to patch")
    what.add_argument("--prompt", required=True, help="the corrupt (destination) prompt")
    what.add_argument("--clean-prompt", help="clean prompt (captured automatically)")
    what.add_argument("--source-run", help="id of a stored clean run")
    what.add_argument("--source-module", help='ablation source: "zeros", "mean" or a registered vector name')
    what.add_argument("--keep-source", action="store_true", help="keep the auto-captured clean run on the server")
    what.add_argument("--layers", help="all (default), 0-5, 0,2,4 or 0:6:2 (see docs/concepts.md, selectors)")
    what.add_argument("--positions", action="append", metavar="SPEC",
                      help="all (default), 3,4,5, 0-5 or span:TEXT[#N]; repeatable (joined with commas)")
    what.add_argument("--hook", help="post_block (server default) or another of " + ", ".join(h for h in HOOKS if h != "post_block"))
    what.add_argument("--hooks", help="several hooks, comma-separated (one grid each)")
    what.add_argument("--alpha", type=float, help="(1-alpha)*h + alpha*source (default 1)")
    what.add_argument("--mask", metavar="DIMS", help="patch only these dimensions, e.g. 12,40,815 or 0-63 (see docs/concepts.md, dimension masks)")
    what.add_argument("--subject", metavar="TEXT[#N]", help="subject span of the prompt, marked in figures")
    what.add_argument("--model", help="the served model's name (checked by the server)")
    metric = sw.add_argument_group("metric")
    ans = metric.add_mutually_exclusive_group()
    ans.add_argument("--answer", help="answer token text (exactly one token, e.g. ' Hadrian')")
    ans.add_argument("--answer-id", type=int, help="answer token id")
    foil = metric.add_mutually_exclusive_group()
    foil.add_argument("--foil", help="foil token text (for logit_diff)")
    foil.add_argument("--foil-id", type=int, help="foil token id")
    metric.add_argument("--metric", help="logprob (default), logit_diff, recovered or prob")
    metric.add_argument("--recovered-basis", help="logprob (default), logit_diff or prob")
    metric.add_argument("--clean-baseline", type=float, help="clean basis value (for a stored run without clean prompt)")
    noise = sw.add_argument_group("noise corruption (ROME-style; no clean prompt needed)")
    noise.add_argument("--noise-span", metavar="TEXT[#N]", help="corrupt the tokens of this span of --prompt")
    noise.add_argument("--noise-positions", metavar="I,J|A-B", help="corrupt these token positions instead")
    noise.add_argument("--noise-scale", type=float, help="noise std in units of the embedding std (default 3)")
    noise.add_argument("--noise-samples", type=int, help="noise draws averaged (default 1)")
    noise.add_argument("--noise-seed", type=int, help="seed of the first draw (default 0)")
    run = sw.add_argument_group("running")
    run.add_argument("--max-concurrency", type=int, help="cells in flight at once")
    run.add_argument("--noise-floor-samples", type=int, help="unpatched re-runs that measure the noise floor")
    run.add_argument("--prefix-reuse", action=argparse.BooleanOptionalAction, default=None,
                     help="read the prompt's cached KV below each cell's patch position (default: the server's choice)")
    out = sw.add_argument_group("output")
    out.add_argument("--out", metavar="PATH", help="save the result (.json or .npz)")
    out.add_argument("--figure", metavar="PATH", help="draw the heatmap (.pdf, .svg or .png; PATH_<hook> per hook when several)")
    out.add_argument("--figure-width", type=_width, default="single", help="single (3.5 in, default), double (7 in) or inches")
    out.add_argument("--top", type=int, default=5, help="top cells to list (default 5)")
    out.add_argument("--json", action="store_true", help="print the summary JSON instead of the text summary")
    out.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    sw.set_defaults(func=cmd_sweep)

    ex = sub.add_parser("export", help="write figures and data files for a saved sweep result",
                        description="Export a saved sweep (RESULT.json or .npz) with app.figures.export.export_sweep.")
    ex.add_argument("result", help="a result saved by `causalboard sweep --out` or SweepResult.save")
    ex.add_argument("--out", required=True, metavar="DIR", help="output folder")
    ex.add_argument("--formats", default=",".join(DEFAULT_EXPORT_FORMATS),
                    help=f"comma-separated, from {','.join(EXPORT_FORMATS)} (default {','.join(DEFAULT_EXPORT_FORMATS)})")
    ex.add_argument("--stem", default="sweep", help="file name stem (default: sweep)")
    ex.add_argument("--hooks", help="hooks to draw, comma-separated (default: every hook)")
    ex.add_argument("--width", default="single", help="figure width: single (3.5 in), double (7 in) or inches")
    ex.set_defaults(func=cmd_export)
