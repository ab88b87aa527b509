"""How a `SweepResult` shows itself in a notebook: its heatmaps, not a dict.

`SweepResult._repr_mimebundle_` (and `_repr_html_`, which Panel's `pn.panel(result)` uses) call
`sweep_mimebundle` / `sweep_html` here, so a cell that ends with a result, `display(result)` or
`pn.panel(result)` shows:

* one line per fact of the sweep: the prompts (corrupt ← clean, or the noised span), the answer
  and foil, the metric with its formula, cells done / total (and pending, skipped, voided,
  within the noise floor), the noise floor, the checksum and the sweep id;
* the heatmap of every hook, drawn by `app.figures.export.plot_sweep` (the figure a paper gets,
  the colours and marks the dashboard shows) as a PNG at `DISPLAY_DPI`, side by side.

`text/plain` is a one-line summary (the dataclass `repr` holds every grid and the whole summary).
A partial result (a running or cancelled sweep) shows its pending cells in grey. Every value the
tests read carries a `data-cb` attribute, as in the dashboard's status block.
"""

from __future__ import annotations

import base64
import html
import io
import math
from typing import Any

from app.figures.presentation import METRIC_FORMULAS, figure_title, token_text
from app.figures.style import export_rc
from app.sweep.fold import CellStatus, result_statuses
from app.sweep.result import SweepResult

#: resolution of the heatmaps shown in a notebook (a one-column figure, 3.5 in, is 350 px wide)
DISPLAY_DPI = 100


def cell_counts(result: SweepResult) -> dict[str, int]:
    """Cells of every hook by status: total, done (a value, within the noise floor included),
    pending, skipped, voided, within_noise."""
    counts = {"total": 0, "done": 0, "pending": 0, "skipped": 0, "voided": 0, "within_noise": 0}
    for hook in result.hooks:
        status = result_statuses(result, hook)
        counts["total"] += status.size
        for s, key in ((CellStatus.PENDING, "pending"), (CellStatus.SKIPPED, "skipped"),
                       (CellStatus.VOIDED, "voided"), (CellStatus.NOISE, "within_noise")):
            counts[key] += int((status == s).sum())
        counts["done"] += int(((status == CellStatus.DONE) | (status == CellStatus.NOISE)).sum())
    return counts


def sweep_text(result: SweepResult) -> str:
    """The one-line summary (`text/plain`)."""
    c = cell_counts(result)
    parts = [f"{len(result.layers)} layers x {len(result.positions)} positions x hooks {result.hooks}",
             f"metric {result.metric}", f"{c['done']}/{c['total']} cells"]
    if result.meta.get("cancelled"):
        parts.append("cancelled")
    if result.noise_floor is not None:
        parts.append(f"noise floor {result.noise_floor:.3g}")
    top = result.top(1)
    if top:
        t = top[0]
        parts.append(f"top {t['hook']} L{t['layer']} pos {t['position']} {t['token']!r} {t['value']:+.3f}")
    return f"SweepResult({', '.join(parts)})"


def heatmap_png(result: SweepResult, hook: str, dpi: int = DISPLAY_DPI) -> bytes:
    """One hook's `plot_sweep` figure as PNG bytes (one column wide, `dpi`)."""
    from app.figures.export import plot_sweep  # matplotlib only when a result is displayed

    fig = plot_sweep(result, hook)
    buf = io.BytesIO()
    with export_rc():
        fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def sweep_html(result: SweepResult) -> str:
    """The summary lines and the heatmap of every hook (`text/html`)."""
    m = result.meta
    c = cell_counts(result)
    rows = []
    if m.get("noise"):
        noise = m["noise"]
        rows.append(("Prompt", f"{_q(m.get('prompt'))} with noise on {_q(noise.get('span'))} "
                               f"(scale {noise.get('scale')}, {noise.get('samples', 1)} sample(s), seed {noise.get('seed')})"))
    elif m.get("clean_prompt") is not None:
        rows.append(("Prompts", f"corrupt {_q(m.get('prompt'))} ← clean {_q(m.get('clean_prompt'))}"))
    elif m.get("prompt") is not None:
        rows.append(("Prompt", _q(m.get("prompt"))))
    answer = ""
    if m.get("answer_token") is not None:
        answer = f" · answer {_q(token_text(m['answer_token']))}"
        if m.get("foil_token") is not None:
            answer += f" · foil {_q(token_text(m['foil_token']))}"
    basis = f" ({html.escape(m['recovered_basis'])})" if result.metric == "recovered" and m.get("recovered_basis") else ""
    formula = METRIC_FORMULAS.get(result.metric, "").removeprefix(f"{result.metric} = ")
    rows.append(("Metric", f'<span data-cb="metric">{html.escape(result.metric)}</span>{basis}'
                           + (f" = {html.escape(formula)}" if formula else "") + answer))
    cells = (f'<span data-cb="cells" data-done="{c["done"]}" data-total="{c["total"]}">{c["done"]}/{c["total"]} cells</span>'
             + "".join(f" · {c[k]} {k.replace('_', ' ')}" for k in ("pending", "skipped", "voided", "within_noise") if c[k]))
    if m.get("cancelled"):
        cells += " · <b>cancelled</b>"
    rows.append(("Cells", cells))
    if result.noise_floor is not None or m.get("clean") is not None:
        base = []
        if m.get("clean") is not None and m.get("corrupt") is not None:
            base.append(f"clean {_num(m['clean'])} · corrupt {_num(m['corrupt'])}")
        if result.noise_floor is not None:
            base.append(f'noise floor <span data-cb="noise-floor">{result.noise_floor:.3g}</span>')
        rows.append(("Baselines", " · ".join(base)))
    checksum = m.get("checksum") or {}
    if checksum:
        rows.append(("Checksum", "consistent" if checksum.get("consistent") else "<b>INCONSISTENT</b>"))
    if m.get("sweep_id"):
        rows.append(("Sweep", f'<span data-cb="sweep-id">{html.escape(str(m["sweep_id"]))}</span>'))
    lines = "".join(f"<div><b>{html.escape(k)}:</b> {v}</div>" for k, v in rows)
    figures = "".join(
        f'<figure style="margin:0" data-cb="heatmap" data-hook="{html.escape(hook)}">'
        f'<img alt="{html.escape(figure_title(result, hook))}" style="max-width:100%" '
        f'src="data:image/png;base64,{base64.b64encode(heatmap_png(result, hook)).decode()}"/></figure>'
        for hook in result.hooks)
    return (f'<div class="cb-sweep-result" data-cb="sweep-result" style="font-size:13px;line-height:1.5">{lines}'
            f'<div style="display:flex;flex-wrap:wrap;gap:8px;margin-top:6px">{figures}</div></div>')


def sweep_mimebundle(result: SweepResult, include: Any = None, exclude: Any = None) -> dict[str, str]:
    """`_repr_mimebundle_`: `text/html` (summary + heatmaps) and `text/plain` (one line)."""
    bundle = {"text/plain": sweep_text(result)}
    wanted = lambda mime: (not include or mime in include) and (not exclude or mime not in exclude)  # noqa: E731
    if wanted("text/html"):
        bundle["text/html"] = sweep_html(result)
    return bundle


def _q(text: Any) -> str:
    return f"“{html.escape(str(text))}”"


def _num(value: Any) -> str:
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{float(value):.4g}"


__all__ = ["DISPLAY_DPI", "cell_counts", "heatmap_png", "sweep_html", "sweep_mimebundle", "sweep_text"]
