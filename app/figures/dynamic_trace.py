"""How a dynamic-steering trace looks, on screen and on paper: plain data, then one matplotlib
figure (the dashboard draws the same rows with Bokeh: `app/dashboard/steering/dynamic.py`).

`trace_rows(generation, policy=0)` turns a generation's result (the JSON of `POST /v1/generate`,
or `Generation.to_dict()`) into one row per generated token: the token's text, the probe's score
on the position that produced it, the threshold it was compared with and whether steering was
engaged (applied) at that position. `plot_trace(rows)` draws the strip plot: the score as a line
with markers, the threshold as a step line, engaged tokens shaded, the generated tokens as the
x-axis labels. The figure reads only those rows, so a saved result regenerates it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from app.figures.presentation import token_label

#: colours (ColorBrewer Set1 red / blue, a light red shading): engaged, score, threshold
ENGAGED_COLOR, SCORE_COLOR, THRESHOLD_COLOR, ENGAGED_FILL = "#e41a1c", "#377eb8", "#4d4d4d", "#fbb4ae"


def trace_rows(generation: dict, policy: int = 0, token_strings: Sequence[str] | None = None) -> list[dict]:
    """One row per generated token: `index`, `token` (its text), `position` (the position whose
    forward produced it), `score`, `threshold`, `engaged`, `scale`. `token_strings`: the
    generated tokens' display strings (default: the ids)."""
    iv = generation.get("intervention") or {}
    dyn = iv.get("dynamic") or {}
    traces = dyn.get("trace") or []
    if not 0 <= policy < len(traces):
        raise ValueError(f"the generation has {len(traces)} policy trace(s); policy {policy} does not exist")
    ids = list(generation.get("token_ids") or [])
    labels = list(token_strings) if token_strings is not None else [str(t) for t in ids]
    rows = []
    for i, e in enumerate(traces[policy][: len(ids)]):
        rows.append({"index": i, "token": labels[i] if i < len(labels) else "", "position": int(e["position"]),
                     "score": float(e["score"]), "threshold": float(e["threshold"]), "engaged": bool(e["engaged"]),
                     "scale": float(e["scale"])})
    return rows


def plot_trace(rows: Sequence[dict], ax: Any = None, *, title: str | None = None):
    """The strip plot of `trace_rows` on `ax` (a new figure when None); returns the figure."""
    import matplotlib.pyplot as plt

    if ax is None:
        fig, ax = plt.subplots(figsize=(max(4.0, 0.35 * len(rows) + 1.5), 2.6), layout="constrained")
    else:
        fig = ax.figure
    x = [r["index"] for r in rows]
    for r in rows:
        if r["engaged"]:
            ax.axvspan(r["index"] - 0.5, r["index"] + 0.5, color=ENGAGED_FILL, lw=0, zorder=0)
    # a threshold set out of reach (always / never engage, e.g. +-1e30) is not drawn
    thr = [r["threshold"] if abs(r["threshold"]) < 1e15 else float("nan") for r in rows]
    ax.step(x, thr, where="mid", color=THRESHOLD_COLOR, lw=1.0, ls="--", label="threshold")
    ax.plot(x, [r["score"] for r in rows], color=SCORE_COLOR, lw=1.2, marker="o", ms=3, label="probe score")
    eng = [r for r in rows if r["engaged"]]
    if eng:
        ax.scatter([r["index"] for r in eng], [r["score"] for r in eng], color=ENGAGED_COLOR, s=14, zorder=3,
                   label="steering engaged")
    ax.set_xticks(x)
    ax.set_xticklabels([token_label(r["token"]) for r in rows], rotation=60, ha="right", fontsize=7)
    ax.set_xlim(-0.5, len(rows) - 0.5)
    ax.set_ylabel("score")
    ax.set_xlabel("generated token")
    ax.legend(fontsize=7, loc="best", frameon=False)
    if title:
        ax.set_title(title, fontsize=9)
    return fig
