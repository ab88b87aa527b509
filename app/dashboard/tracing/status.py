"""The tracing view's status block as HTML: phase, progress, noise floor, alignment, checksum,
baselines, sweep id, notes and errors (pure: reads a `SweepState` and the view's phase).

Every value the browser tests read carries a `data-cb` attribute (`phase`, `progress` with
`data-done`/`data-total`/`data-final`, `noise-floor`, `alignment`, `checksum`, `sweep-id`).
Token text goes through `app.figures.presentation.token_text` (as on the heatmaps' axes) and
everything is HTML-escaped.
"""

from __future__ import annotations

import html
import math

from app.dashboard.tracing.state import SweepState
from app.figures.presentation import METRIC_FORMULAS, token_text
from app.sweep.fold import CellStatus

#: the view's run phases (`TracingView.phase`)
PHASES = ("idle", "running", "done", "cancelled", "failed")
#: how each phase reads in the status line
PHASE_TEXT = {"idle": "idle", "running": "running", "done": "finished", "cancelled": "cancelled", "failed": "failed"}
DIRECTION = "denoising: clean activations patched into the corrupt run"


def phase_text(state: SweepState, phase: str) -> str:
    """The phase as the status line words it (before the `start` event too)."""
    if state.result is None:
        return {"running": "starting (capturing the clean run and baselines)…",
                "cancelled": "cancelled before the first cell"}.get(phase, PHASE_TEXT[phase])
    return PHASE_TEXT[phase]


def status_html(state: SweepState, phase: str, *, zoomed: bool = False, kept_run: str | None = None) -> str:
    """The whole status block."""
    r = state.result
    if r is None:
        rows = [("Sweep", span("phase", phase_text(state, phase)))]
        rows += [("Error", _error(e)) for e in state.errors]
        return _block(rows)
    rate = state.cells_per_s
    progress = (f'<span data-cb="progress" data-done="{state.cells_done}" data-total="{state.cells_total}" '
                f'data-final="{int(state.finished)}">{state.cells_done}/{state.cells_total} cells</span>'
                f" · {('%.1f cells/s' % rate) if rate else '— cells/s'} · {state.elapsed_s:.1f} s · "
                + span("phase", phase_text(state, phase)))
    if state.cells_voided:
        progress += f" · {state.cells_voided} voided"
    if state.noise_floor is None:
        noise = span("noise-floor", "not measured" if state.finished or phase in ("cancelled", "failed") else "pending")
    else:
        noise = (span("noise-floor", f"{state.noise_floor:.4g}") + f" ({html.escape(r.metric)} units) · "
                 f"{state.count(CellStatus.NOISE)} cells within it")
    rows = [
        ("Progress", progress),
        ("Noise floor", noise),
        ("Alignment", alignment_html(state)),
        ("Checksum", span("checksum", state.checksum_text())),
        ("Baselines", baselines_html(state)),
        ("Sweep", sweep_html(state, zoomed, kept_run)),
    ]
    rows += [("Note", html.escape(w)) for w in state.warnings]
    rows += [("Error", _error(e)) for e in state.errors]
    return _block(rows)


def alignment_html(state: SweepState) -> str:
    r = state.result
    if r.meta.get("noise"):
        pos = r.meta["noise"].get("positions") or []
        return span("alignment", f"same prompt (noise on positions {', '.join(map(str, pos))})")
    a = state.alignment
    if not a:
        return span("alignment", "identity (stored run)")
    unaligned = list(a.unaligned_positions)
    toks = r.meta.get("token_strings") or []
    if unaligned:
        shown = ", ".join(f"{p}:{token_text(toks[p])}" if p < len(toks) else str(p) for p in unaligned)
        un = f"unaligned (skipped) positions: {shown}"
    else:
        un = "no unaligned positions"
    return span("alignment", f"clean {a.n_clean} / corrupt {a.n_corrupt} tokens · prefix {a.prefix_len} · "
                             f"suffix {a.suffix_len} · {un}")


def baselines_html(state: SweepState) -> str:
    r = state.result
    basis = r.meta.get("recovered_basis") or r.metric

    def fmt(v: float | None) -> str:
        return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.4g}"

    ans, foil = r.meta.get("answer_token"), r.meta.get("foil_token")
    out = f"clean {html.escape(basis)} {fmt(state.clean)} · corrupt {fmt(state.corrupt)}"
    if ans is not None:
        out += f" · answer “{html.escape(token_text(ans))}”"
    if foil is not None:
        out += f" · foil “{html.escape(token_text(foil))}”"
    formula = METRIC_FORMULAS.get(r.metric)
    if formula:
        out += f" · {html.escape(formula)}"
    return out


def sweep_html(state: SweepState, zoomed: bool, kept_run: str | None) -> str:
    r = state.result
    parts = [f"id {span('sweep-id', r.meta.get('sweep_id') or '?')}", html.escape(DIRECTION)]
    if zoomed:
        parts.append("zoom of the previous sweep")
    if kept_run:
        parts.append(f"clean run kept for zoom: {html.escape(kept_run)}")
    return " · ".join(parts)


def span(name: str, text: str) -> str:
    return f'<span data-cb="{name}">{html.escape(str(text))}</span>'


def _error(text: str) -> str:
    return f'<span style="color:#b00">{html.escape(text)}</span>'


def _block(rows: list[tuple[str, str]]) -> str:
    body = "".join(f'<div><b>{html.escape(k)}:</b> {v}</div>' for k, v in rows)
    return f'<div class="cb-status" style="font-size:13px;line-height:1.55">{body}</div>'


__all__ = ["PHASES", "PHASE_TEXT", "phase_text", "status_html"]
