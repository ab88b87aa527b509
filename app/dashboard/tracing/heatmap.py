"""One hook's live patch-sweep heatmap as a Bokeh figure, updated incrementally.

Layout: positions (token labels `"<index>:<token>"`, whitespace made visible) on the x axis,
layers on the y axis (lowest layer at the bottom). One rectangle per cell; its look comes from
the cell's `CellStatus` (see `CELL_LOOKS`, also shown in the page's key):

* pending — white with grey dots; skipped (unaligned position) — white with grey diagonal lines;
* voided — dark grey with a white cross; within the noise floor — the value's colour, faded,
  with grey dashes; done — the value's colour.

Colours are computed here (not by a Bokeh colour transform) so that a status can override the
colour; the `ColorBar` shows the same scale. The scale suits the metric (`ColorScale`): diverging
blue-white-red centred at 0 for `recovered` and `logit_diff`, sequential Viridis for `logprob` and
`prob`. The range only grows while a sweep streams, and all cells are recoloured when it does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
from bokeh.models import BoxSelectTool, ColorBar, ColumnDataSource, FactorRange, HoverTool, LinearColorMapper
from bokeh.palettes import RdBu11, Viridis256, interp_palette
from bokeh.plotting import figure

from app.sweep.fold import CellStatus, status_grid

DIVERGING = tuple(interp_palette(RdBu11, 255))  # blue (negative) - white (0) - red (positive)
SEQUENTIAL = tuple(Viridis256)
DIVERGING_METRICS = ("recovered", "logit_diff")

#: what each metric's values are (shown in the status and the docs)
METRIC_FORMULAS = {
    "recovered": "recovered = (patched − corrupt) / (clean − corrupt)",
    "logit_diff": "logit_diff = log p(answer) − log p(foil)",
    "logprob": "logprob = log p(answer)",
    "prob": "prob = p(answer)",
}


@dataclass(frozen=True)
class CellLook:
    """How a cell with a given status is drawn; `fill=None` means the value's colour."""

    fill: str | None
    alpha: float
    hatch: str  # Bokeh hatch pattern code (" " = none)
    hatch_color: str
    label: str  # for the key


CELL_LOOKS: dict[CellStatus, CellLook] = {
    CellStatus.PENDING: CellLook("#ffffff", 1.0, ".", "#9e9e9e", "pending (not computed yet)"),
    CellStatus.DONE: CellLook(None, 1.0, " ", "#ffffff", "value"),
    CellStatus.NOISE: CellLook(None, 0.35, '"', "#8c8c8c", "within the noise floor (faded, dashed)"),
    CellStatus.SKIPPED: CellLook("#ffffff", 1.0, "/", "#8c8c8c", "skipped: unaligned position (not run)"),
    CellStatus.VOIDED: CellLook("#4d4d4d", 1.0, "x", "#ffffff", "voided: the patch failed to resolve"),
}


def visible_token(token: str) -> str:
    """A token string with whitespace and control characters made visible (space → ␣,
    newline → ⏎, tab → ⇥, other control characters → \\xNN). Bokeh draws axis labels and
    tooltips as text, so no HTML escaping is needed for them; HTML panes must escape it."""
    out = []
    for ch in token:
        if ch == " ":
            out.append("␣")
        elif ch == "\n":
            out.append("⏎")
        elif ch == "\t":
            out.append("⇥")
        elif ch == "\r":
            out.append("↵")
        elif ord(ch) < 32 or ord(ch) == 127:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "".join(out) or "∅"


def position_labels(positions: Sequence[int], token_strings: Sequence[str], marked: Iterable[int] = ()) -> list[str]:
    """Axis labels `"<position>:<visible token>"` (unique even when a token repeats), with a
    `*` after positions in `marked` (the subject / noised span, as in ROME's figures)."""
    marked = set(marked)
    return [f"{p}:{visible_token(t)}{'*' if p in marked else ''}" for p, t in zip(positions, token_strings)]


class ColorScale:
    """Maps values to palette colours for one metric; `extend` grows the range to cover values."""

    def __init__(self, metric: str, baselines: Iterable[float | None] = ()):
        self.metric = metric
        self.diverging = metric in DIVERGING_METRICS
        self.palette = DIVERGING if self.diverging else SEQUENTIAL
        if self.diverging:
            self.low, self.high = -1.0, 1.0
        elif metric == "prob":
            self.low, self.high = 0.0, 1.0
        else:
            self.low, self.high = math.inf, -math.inf
        self.extend([b for b in baselines if b is not None])

    @property
    def ready(self) -> bool:
        return self.low < self.high

    def extend(self, values: Iterable[float]) -> bool:
        """Grow the range to include `values` (NaN ignored); True when it changed."""
        arr = np.asarray([v for v in values if v is not None], dtype=float)
        arr = arr[np.isfinite(arr)]
        if arr.size == 0:
            return False
        if self.diverging:
            bound = _nice_ceiling(float(np.max(np.abs(arr))))
            if bound <= self.high:
                return False
            self.low, self.high = -bound, bound
            return True
        lo, hi = min(self.low, float(arr.min())), max(self.high, float(arr.max()))
        if lo == hi:
            lo, hi = lo - 0.5, hi + 0.5
        if (lo, hi) == (self.low, self.high):
            return False
        self.low, self.high = lo, hi
        return True

    def color(self, value: float) -> str:
        if not self.ready or math.isnan(value):
            return "#ffffff"
        t = (value - self.low) / (self.high - self.low)
        idx = int(round(min(1.0, max(0.0, t)) * (len(self.palette) - 1)))
        return self.palette[idx]

    def mapper(self) -> LinearColorMapper:
        low, high = (self.low, self.high) if self.ready else (0.0, 1.0)
        return LinearColorMapper(palette=list(self.palette), low=low, high=high, nan_color="#ffffff")


def _nice_ceiling(x: float) -> float:
    """A round number ≥ x (1, 1.5, 2, 2.5, 3, 4, 5, 7.5, 10 × 10^k) so the range grows in steps."""
    if x <= 0:
        return 1.0
    exp = math.floor(math.log10(x))
    for m in (1, 1.5, 2, 2.5, 3, 4, 5, 7.5, 10):
        if m * 10**exp >= x:
            return m * 10**exp
    return 10 ** (exp + 1)


def format_value(value: float) -> str:
    return "—" if math.isnan(value) else f"{value:.4g}"


class SweepHeatmap:
    """The figure of one hook. `update(cells)` restyles the given cells with ONE
    `ColumnDataSource.patch` (or replaces the data when the colour range grew). Must be called
    with the Bokeh document lock held (from a periodic callback) when served."""

    def __init__(self, hook: str, layers: Sequence[int], positions: Sequence[int], token_strings: Sequence[str],
                 metric: str, *, baselines: Iterable[float | None] = (), title: str | None = None,
                 marked: Iterable[int] = ()):
        self.hook, self.layers, self.positions, self.metric = hook, list(layers), list(positions), metric
        self.labels = position_labels(self.positions, token_strings, marked)
        self.tokens = [visible_token(t) for t in token_strings]
        self.scale = ColorScale(metric, baselines)
        n_l, n_p = len(self.layers), len(self.positions)
        self._values = np.full((n_l, n_p), np.nan)
        self._status = status_grid((n_l, n_p))
        self._reasons: dict[tuple[int, int], str] = {}
        self.source = ColumnDataSource(self._columns())
        self.mapper = self.scale.mapper()
        self.figure = self._figure(title or f"{hook}")

    # ---- construction ------------------------------------------------------------------------
    def _figure(self, title: str):
        n_l, n_p = len(self.layers), len(self.positions)
        width = int(min(1100, max(400, 160 + 50 * n_p)))
        height = int(min(700, max(220, 120 + 34 * n_l)))
        fig = figure(
            title=title, x_range=FactorRange(*self.labels), y_range=FactorRange(*[str(l) for l in self.layers]),
            width=width, height=height, tools="reset,save", toolbar_location="above",
            x_axis_label="position:token (* subject)", y_axis_label="layer",
        )
        renderer = fig.rect(
            "x", "y", 1, 1, source=self.source, fill_color="fill", fill_alpha="alpha", hatch_pattern="hatch",
            hatch_color="hatch_color", hatch_scale=7.0, hatch_weight=1.2, line_color="#ffffff", line_width=1,
            nonselection_fill_alpha=0.25, nonselection_hatch_alpha=0.25, selection_line_color="#000000",
            selection_line_width=2,
        )
        box = BoxSelectTool(renderers=[renderer], dimensions="both")  # selects the cells whose centre is inside
        fig.add_tools(box, HoverTool(renderers=[renderer], tooltips=[
            ("layer", "@layer"), ("position", "@position"), ("token", "@token"),
            ("value", "@value_text"), ("status", "@status_text"),
        ]))
        fig.toolbar.active_drag = box
        fig.grid.visible = False
        fig.axis.major_tick_line_color = None
        fig.axis.axis_line_color = None
        if n_p > 8 or max((len(s) for s in self.labels), default=0) > 8:
            fig.xaxis.major_label_orientation = 0.9
        self.color_bar = ColorBar(color_mapper=self.mapper, title=self.metric, title_text_font_size="9pt", width=12)
        fig.add_layout(self.color_bar, "right")
        return fig

    def _look(self, i: int, j: int) -> tuple[str, float, str, str, str, str]:
        status, value = self._status[i, j], float(self._values[i, j])
        look = CELL_LOOKS[status]
        fill = look.fill if look.fill is not None else self.scale.color(value)
        reason = self._reasons.get((i, j))
        text = status.value + (f" — {reason}" if reason else "")
        return fill, look.alpha, look.hatch, look.hatch_color, format_value(value), text

    def _columns(self) -> dict[str, list]:
        cols: dict[str, list] = {k: [] for k in ("x", "y", "hook", "layer", "position", "token", "fill", "alpha", "hatch",
                                                 "hatch_color", "value", "value_text", "status_text")}
        for i, layer in enumerate(self.layers):
            for j, pos in enumerate(self.positions):
                fill, alpha, hatch, hcolor, vtext, stext = self._look(i, j)
                cols["x"].append(self.labels[j])
                cols["y"].append(str(layer))
                cols["hook"].append(self.hook)
                cols["layer"].append(layer)
                cols["position"].append(pos)
                cols["token"].append(self.tokens[j])
                cols["fill"].append(fill)
                cols["alpha"].append(alpha)
                cols["hatch"].append(hatch)
                cols["hatch_color"].append(hcolor)
                cols["value"].append(float(self._values[i, j]))
                cols["value_text"].append(vtext)
                cols["status_text"].append(stext)
        return cols

    # ---- updating ----------------------------------------------------------------------------
    def update(self, cells: Iterable[tuple[int, int, float, CellStatus, str]]) -> int:
        """Set (layer index, position index, value, status, reason) for each given cell and push
        the change to the browser; returns how many cells changed."""
        changed = []
        for i, j, value, status, reason in cells:
            self._values[i, j] = value
            self._status[i, j] = status
            if reason:
                self._reasons[(i, j)] = reason
            else:
                self._reasons.pop((i, j), None)
            changed.append((i, j))
        if not changed:
            return 0
        shown = self._values[self._has_value()]
        if self.scale.extend(shown.tolist()):
            self.mapper.update(low=self.scale.low, high=self.scale.high)
            self.source.data = self._columns()
            return len(changed)
        n_p = len(self.positions)
        patch: dict[str, list] = {k: [] for k in ("fill", "alpha", "hatch", "hatch_color", "value", "value_text", "status_text")}
        for i, j in changed:
            idx = i * n_p + j
            fill, alpha, hatch, hcolor, vtext, stext = self._look(i, j)
            for key, val in zip(("fill", "alpha", "hatch", "hatch_color", "value_text", "status_text"),
                                (fill, alpha, hatch, hcolor, vtext, stext)):
                patch[key].append((idx, val))
            patch["value"].append((idx, float(self._values[i, j])))
        self.source.patch(patch)
        return len(changed)

    def selected_block(self) -> tuple[list[int], list[int]] | None:
        """The rectangle spanned by the selected cells as (layers, positions): every layer
        and every position (token index) from the smallest to the largest selected one, so a
        zoom over a coarse sweep becomes finer. None when nothing is selected."""
        indices = list(self.source.selected.indices or [])
        if not indices:
            return None
        n_p = len(self.positions)
        rows = [self.layers[k // n_p] for k in indices]
        cols = [self.positions[k % n_p] for k in indices]
        return list(range(min(rows), max(rows) + 1)), list(range(min(cols), max(cols) + 1))

    def filled_cells(self) -> int:
        """Cells showing a value (done or within noise)."""
        return int(np.count_nonzero(self._has_value()))

    def _has_value(self) -> np.ndarray:
        return (self._status == CellStatus.DONE) | (self._status == CellStatus.NOISE)


def legend_html() -> str:
    """The key explaining every cell look (HTML with inline SVG swatches)."""
    items = []
    for status, look in CELL_LOOKS.items():
        items.append(f'<span class="cb-key-item" title="{status.value}">{_swatch(status, look)}&nbsp;{look.label}</span>')
    return ('<div class="cb-key" style="display:flex;flex-wrap:wrap;gap:14px;font-size:12px;align-items:center">'
            "<b>Key:</b>" + "".join(items) + "</div>")


def _swatch(status: CellStatus, look: CellLook) -> str:
    fill = look.fill or ("#d6604d" if status == CellStatus.DONE else "#f4a582")
    pattern = {
        ".": '<circle cx="3" cy="3" r="1" fill="{c}"/><circle cx="9" cy="9" r="1" fill="{c}"/><circle cx="9" cy="3" r="1" fill="{c}"/><circle cx="3" cy="9" r="1" fill="{c}"/>',
        "/": '<path d="M0 12 L12 0 M-3 3 L3 -3 M9 15 L15 9" stroke="{c}" stroke-width="1.2"/>',
        "x": '<path d="M2 2 L10 10 M10 2 L2 10" stroke="{c}" stroke-width="1.4"/>',
        '"': '<path d="M1 3 H5 M7 3 H11 M1 9 H5 M7 9 H11" stroke="{c}" stroke-width="1.2"/>',
        " ": "",
    }[look.hatch].format(c=look.hatch_color)
    return (f'<svg width="16" height="16" viewBox="0 0 12 12" style="vertical-align:middle;border:1px solid #bbb">'
            f'<rect width="12" height="12" fill="{fill}" fill-opacity="{look.alpha}"/>{pattern}</svg>')


__all__ = ["CELL_LOOKS", "ColorScale", "METRIC_FORMULAS", "SweepHeatmap", "legend_html", "position_labels", "visible_token"]
