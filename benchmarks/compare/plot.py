"""Plot causalboard / stock vLLM ratios before and after, from the harness's JSON lines.

    .venv/bin/python benchmarks/compare/plot.py --before docs/performance/h100-2026-11-24-baseline-call1.jsonl \\
        --after docs/performance/h100-2026-11-25-S-CB.jsonl --out docs/img/performance-ratios.png

Each ratio is taken within one file (one device call): causalboard's figure over stock vLLM's
figure measured in the same call. Workloads without a stock figure in a call are left out."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def figures(path: Path) -> dict[str, float]:
    """Throughput per workload (tok/s, cells/s, req/s) from one call's JSON lines."""
    out: dict[str, float] = {}
    for line in path.read_text().splitlines():
        d = json.loads(line)
        b = d.get("bench", "")
        if b.startswith("S_stock") and d.get("task") == "p2":
            out[f"stock P2 b{d['batch']}"] = d["out_tok_per_s"]
        elif b.startswith("S_stock") and d.get("task") == "p1":
            out["stock P1"] = d["req_per_s"]
        elif b.endswith("_p2") and b.startswith("CB"):
            out[f"cb P2 b{d['batch']} {d['variant']}"] = d["tok_s"]
        elif b.endswith("_p1") and b.startswith("CB"):
            out[f"cb P1 {d['variant']}"] = d["cells_per_s"]
        elif b.endswith("_p1http") and b.startswith("CB"):
            out["cb P1 http"] = d["cells_per_s"]
    return out


#: (label, causalboard key, stock key)
RATIOS = [
    ("P2 decode b32", "cb P2 b32 vanilla", "stock P2 b32"),
    ("P2 decode b32, steered 1 site", "cb P2 b32 steer_1site", "stock P2 b32"),
    ("P2 decode b32, steered 16 layers", "cb P2 b32 steer_all_layers", "stock P2 b32"),
    ("P2 decode b1", "cb P2 b1 vanilla", "stock P2 b1"),
    ("P2 decode b1, steered 16 layers", "cb P2 b1 steer_all_layers", "stock P2 b1"),
    ("P1 768 requests, no spec", "cb P1 engine_nospec_768", "stock P1"),
    ("P1 768 patched cells (engine)", "cb P1 engine_patched_768", "stock P1"),
    ("P1 768-cell sweep over HTTP", "cb P1 http", "stock P1"),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", type=Path, required=True)
    ap.add_argument("--after", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    calls = {"before (2026-11-24)": figures(args.before), "after (2026-11-25)": figures(args.after)}
    labels = [r[0] for r in RATIOS]
    fig, ax = plt.subplots(figsize=(7.0, 3.6))
    width = 0.38
    for k, (name, fig_) in enumerate(calls.items()):
        vals = [fig_.get(cb, 0) / fig_[st] if st in fig_ and cb in fig_ else 0 for _, cb, st in RATIOS]
        ys = [i + (k - 0.5) * width for i in range(len(labels))]
        ax.barh(ys, vals, height=width, label=name, color=("#bbbbbb", "#2166ac")[k])
        for y, v in zip(ys, vals):
            if v:
                ax.text(v + 0.01, y, f"{v:.2f}x", va="center", fontsize=7)
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("causalboard / stock vLLM 0.25.1 (same device call, H100)", fontsize=8)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=150)


if __name__ == "__main__":
    main()
