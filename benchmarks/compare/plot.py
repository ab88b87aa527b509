"""Plot causalboard / stock vLLM ratios of several device calls, from their JSON lines.

    .venv/bin/python benchmarks/compare/plot.py \\
        --call "2026-11-24, H100=docs/performance/h100-2026-11-24-baseline-call1.jsonl" \\
        --call "2026-11-25, H100=docs/performance/h100-2026-11-25-S-CB.jsonl" \\
        --call "2026-11-27, H200=docs/performance/gpu-2026-11-27-13th-p1-decode.jsonl@CBmerged" \\
        --out docs/img/performance-ratios.png

(`--before FILE --after FILE` is the same with two calls.) `--absolute FILE --absolute-out PNG`
draws one call's throughputs side by side instead (`absolute_figures`): cells/s of P1 for stock
vLLM, causalboard (batch invariance off and on) and Hugging Face hooks, and decode tok/s — the
harness's line format, one call with the parts S, CB, CBBI and HF. Each ratio is taken within one file (one
device call): causalboard's figure over stock vLLM's figure measured in the same call. Workloads
without a stock figure in a call are left out of that call's bars. A file may hold several
causalboard runs of the decode benchmark under different tags (`CB`, `CBmerged`, ...): `FILE@TAG`
picks one (default: the last `CB*` line of each workload).

Two line formats are read: the harness's (`run_compare.sh`: `S_stock` and `CB*_p1/_p2/_p1http`
lines, `vllm_bench.py`'s `S` lines) and `benchmarks/diag/p1_stacks.py`'s (`{"bench": "p1",
"engine": ..., "variant": ..., "seconds": ...}` per repetition; its workload is 768 requests, and
the figure is 768 over the median of the timed repetitions)."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

#: p1_stacks.py's workload: 768 one-token requests / cells
P1_CELLS = 768
#: p1_stacks.py's variant -> the harness's key
P1_STACKS_KEYS = {("stock", "stock"): "stock P1", ("cb", "nospec"): "cb P1 engine_nospec_768",
                  ("cb", "scored"): "cb P1 engine_scored_only_768", ("cb", "patched"): "cb P1 engine_patched_768",
                  ("cb", "sweep_http"): "cb P1 http"}


def _lines(path: Path):
    """The JSON lines of a call's file (log lines and the like skipped)."""
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            yield json.loads(line)


def _stock_figure(d: dict) -> tuple[str, float] | None:
    """A stock vLLM line of the harness (`S*`: P1 req/s, P2 tok/s per batch) as (key, figure)."""
    if not d.get("bench", "").startswith("S"):
        return None
    if d.get("task") == "p2" and "out_tok_per_s" in d:
        return f"stock P2 b{d['batch']}", d["out_tok_per_s"]
    if d.get("task") == "p1" and "req_per_s" in d:
        return "stock P1", d["req_per_s"]
    return None


def figures(path: Path, cb_tag: str | None = None) -> dict[str, float]:
    """Throughput per workload (tok/s, cells/s, req/s) from one call's JSON lines (`cb_tag`: the
    causalboard decode runs to read, e.g. `CBmerged`; None: any `CB*`, the last one winning)."""
    out: dict[str, float] = {}
    p1_runs: dict[str, list[float]] = {}
    for d in _lines(path):
        b = d.get("bench", "")
        stock = _stock_figure(d)
        if b == "p1" and "engine" in d:  # p1_stacks.py, one line per timed repetition
            key = P1_STACKS_KEYS.get((d["engine"], d["variant"]))
            if key:
                p1_runs.setdefault(key, []).append(d["seconds"])
        elif stock is not None:
            out[stock[0]] = stock[1]
        elif b.endswith("_p2") and (b == f"{cb_tag}_p2" if cb_tag else b.startswith("CB")):
            out[f"cb P2 b{d['batch']} {d['variant']}"] = d["tok_s"]
        elif b.endswith("_p1") and b.startswith("CB"):
            out[f"cb P1 {d['variant']}"] = d["cells_per_s"]
        elif b.endswith("_p1http") and b.startswith("CB"):
            out["cb P1 http"] = d["cells_per_s"]
    for key, seconds in p1_runs.items():
        out[key] = P1_CELLS / statistics.median(seconds)
    return out


#: (label, causalboard key, stock key)
RATIOS = [
    ("P2 decode b32", "cb P2 b32 vanilla", "stock P2 b32"),
    ("P2 decode b32, steered 1 site", "cb P2 b32 steer_1site", "stock P2 b32"),
    ("P2 decode b32, steered 16 layers", "cb P2 b32 steer_all_layers", "stock P2 b32"),
    ("P2 decode b1", "cb P2 b1 vanilla", "stock P2 b1"),
    ("P2 decode b1, steered 16 layers", "cb P2 b1 steer_all_layers", "stock P2 b1"),
    ("P1 768 requests, no spec", "cb P1 engine_nospec_768", "stock P1"),
    ("P1 768 requests, scored", "cb P1 engine_scored_only_768", "stock P1"),
    ("P1 768 patched cells (engine)", "cb P1 engine_patched_768", "stock P1"),
    ("P1 768-cell sweep over HTTP", "cb P1 http", "stock P1"),
]

COLORS = ("#bbbbbb", "#92c5de", "#2166ac", "#053061")


def ratios(fig: dict[str, float]) -> list[float]:
    """Per row of `RATIOS`: causalboard / stock within `fig`, or 0 where either is missing."""
    return [fig[cb] / fig[st] if st in fig and cb in fig else 0.0 for _, cb, st in RATIOS]


#: `--absolute`'s panels
P1_PANEL = "P1: 768 cells / one-token requests, 16-token prompt (per second)"
B32_PANEL = "P2: decode, batch 32, 256 tokens (tokens per second)"
B1_PANEL = "P2: decode, batch 1, 256 tokens (tokens per second)"
#: (panel, label, key) of `--absolute`'s bars, top to bottom
ABSOLUTE = [
    (P1_PANEL, "stock vLLM, 768 requests", "stock P1"),
    (P1_PANEL, "causalboard, no spec", "CB_bi_off P1 engine_nospec_768"),
    (P1_PANEL, "causalboard, patched cells (engine)", "CB_bi_off P1 engine_patched_768"),
    (P1_PANEL, "causalboard, sweep over HTTP", "CB_bi_off P1 http"),
    (P1_PANEL, "causalboard, sweep over HTTP, batch invariance on", "CB_bi_on P1 http"),
    (P1_PANEL, "HF hooks, 256 cells per forward", "HF batched_256"),
    (P1_PANEL, "HF hooks, 64 cells per forward", "HF batched_64"),
    (P1_PANEL, "HF hooks, one cell per forward", "HF loop_b1"),
    (B32_PANEL, "stock vLLM", "stock P2 b32"),
    (B32_PANEL, "causalboard", "CB_bi_off P2 b32 vanilla"),
    (B32_PANEL, "causalboard, batch invariance on", "CB_bi_on P2 b32 vanilla"),
    (B1_PANEL, "stock vLLM", "stock P2 b1"),
    (B1_PANEL, "causalboard", "CB_bi_off P2 b1 vanilla"),
    (B1_PANEL, "causalboard, batch invariance on", "CB_bi_on P2 b1 vanilla"),
]


def absolute_figures(path: Path) -> dict[str, float]:
    """One call's throughputs by `ABSOLUTE` key, from the harness's lines: stock (`S*`), each
    causalboard tag (`<TAG>_p1`, `_p1http`, `_p2`: keys `<TAG> P1 <variant>`, `<TAG> P1 http`,
    `<TAG> P2 b<batch> <variant>`) and `hf_patch.py`'s variants (`HF <variant>`, cells/s)."""
    out: dict[str, float] = {}
    for d in _lines(path):
        b = d.get("bench", "")
        stock = _stock_figure(d)
        if b == "HF" and d.get("step") == "variant":
            out[f"HF {d['variant']}"] = d["cells_per_s"]
        elif stock is not None:
            out[stock[0]] = stock[1]
        elif b.startswith("CB") and b.endswith("_p2"):
            out[f"{b[:-3]} P2 b{d['batch']} {d['variant']}"] = d["tok_s"]
        elif b.startswith("CB") and b.endswith("_p1http"):
            out[f"{b[:-7]} P1 http"] = d["cells_per_s"]
        elif b.startswith("CB") and b.endswith("_p1"):
            out[f"{b[:-3]} P1 {d['variant']}"] = d["cells_per_s"]
    return out


def plot_absolute(path: Path, out: Path, title: str) -> None:
    """`ABSOLUTE`'s bars from one call (`absolute_figures`), one panel per workload; bars whose
    figure the call lacks are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig_vals = absolute_figures(path)
    panels = list(dict.fromkeys(p for p, _, _ in ABSOLUTE))
    rows = {p: [(label, fig_vals[k]) for q, label, k in ABSOLUTE if q == p and k in fig_vals] for p in panels}
    panels = [p for p in panels if rows[p]]
    if not panels:
        raise SystemExit(f"{path}: none of the figures --absolute draws")
    fig, axes = plt.subplots(len(panels), 1, figsize=(7.0, 0.9 + sum(0.32 * len(rows[p]) + 0.5 for p in panels)),
                             squeeze=False, gridspec_kw={"height_ratios": [len(rows[p]) for p in panels]})
    for ax, p in zip(axes[:, 0], panels):
        labels = [lab for lab, _ in rows[p]]
        vals = [v for _, v in rows[p]]
        colors = ["#bbbbbb" if lab.startswith("stock") else "#d6604d" if lab.startswith("HF") else "#2166ac"
                  for lab in labels]
        ax.barh(range(len(vals)), vals, color=colors)
        for i, v in enumerate(vals):
            ax.text(v, i, f" {v:,.0f}", va="center", fontsize=6)
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_title(p, fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
        ax.set_xlim(0, max(vals) * 1.18)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=150)


def parse_call(spec: str) -> tuple[str, Path, str | None]:
    """`LABEL=FILE[@TAG]` -> (label, file, tag)."""
    label, sep, rest = spec.partition("=")
    if not sep or not rest:
        raise SystemExit(f"--call wants LABEL=FILE[@TAG], got {spec!r}")
    file, _, tag = rest.partition("@")
    return label, Path(file), tag or None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--call", action="append", default=[], help="LABEL=FILE[@TAG], in order (up to 4)")
    ap.add_argument("--before", type=Path)
    ap.add_argument("--after", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--absolute", type=Path, help="one call's harness lines (parts S, CB, CBBI, HF): throughputs")
    ap.add_argument("--absolute-out", type=Path)
    ap.add_argument("--absolute-title", default="")
    args = ap.parse_args()
    if args.absolute:
        if not args.absolute_out:
            raise SystemExit("--absolute wants --absolute-out PNG")
        plot_absolute(args.absolute, args.absolute_out, args.absolute_title)
    if not args.out:
        if args.absolute:
            return
        raise SystemExit("--out PNG is required (or --absolute FILE --absolute-out PNG)")
    calls = [parse_call(c) for c in args.call]
    if args.before and args.after:
        calls = [("before (2026-11-24)", args.before, None), ("after (2026-11-25)", args.after, None)] + calls
    if not calls or len(calls) > len(COLORS):
        raise SystemExit(f"give 1 to {len(COLORS)} calls (--call LABEL=FILE[@TAG], or --before/--after)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r[0] for r in RATIOS]
    fig, ax = plt.subplots(figsize=(7.0, 0.55 * len(labels) + 0.35 * len(calls)))
    width = 0.8 / len(calls)
    for k, (name, path, tag) in enumerate(calls):
        vals = ratios(figures(path, tag))
        ys = [i + (k - (len(calls) - 1) / 2) * width for i in range(len(labels))]
        ax.barh(ys, vals, height=width, label=name, color=COLORS[k])
        for y, v in zip(ys, vals):
            if v:
                ax.text(v + 0.01, y, f"{v:.2f}x", va="center", fontsize=6)
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("causalboard / stock vLLM 0.25.1 (each call's ratio within that call)", fontsize=8)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=150)


if __name__ == "__main__":
    main()
