"""One hook's live patch-sweep heatmap as a Bokeh figure, updated incrementally.

Everything the figure shows comes from `app.figures.presentation`, which the exported paper
figures (`app.figures.export.plot_sweep`) render too: the palette and range of the metric's colour
scale, the token labels (`*` on the subject), the position numbers on the top axis, the layer
ticks, the title and the colour bar's label, and each `CellStatus`'s look (fill, hatch pattern,
hatch colour) and legend text. So a cell has the same colour on screen and on paper.

Layout: one rectangle per cell, cell (layer index i, position index j) centred at (j, i): token
labels along the bottom, position numbers along the top, layers bottom-up. Colours are computed
here (`ColorScale.color`, not a Bokeh colour transform) so that a status can override them; the
`ColorBar` shows the same scale. While a sweep streams the scale is recomputed from the values
shown: when its range changes, every cell is recoloured.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import numpy as np
from bokeh.models import (BoxSelectTool, ColorBar, ColumnDataSource, FixedTicker, HoverTool, LinearAxis,
                          LinearColorMapper, Range1d)
from bokeh.plotting import figure

from app.figures.presentation import (CELL_LOOKS, LAYER_AXIS_LABEL, POSITION_AXIS_LABEL, STATUS_MEANINGS,
                                      SUBJECT_LEGEND, ColorScale, baselines_of, color_scale, figure_title, layer_ticks,
                                      legend_text, position_labels, result_metric_label, subject_positions, token_text)
from app.sweep.fold import CellStatus, result_statuses, status_grid
from app.sweep.result import SweepResult

#: Bokeh draws a hatch pattern in tiles of this many pixels (screen cells are 30-60 px wide)
HATCH_SCALE = 7.0
#: the columns of a heatmap's data source that change with a cell
CELL_COLUMNS = ("fill", "hatch", "hatch_color", "value", "value_text", "status_text")


def format_value(value: float) -> str:
    return "—" if math.isnan(value) else f"{value:.4g}"


def status_text(status: CellStatus, reason: str = "") -> str:
    """A cell's status as the tooltip shows it: its name (as in the CSV export) and reason."""
    return CELL_LOOKS[status].name + (f" — {reason}" if reason else "")


class SweepHeatmap:
    """The figure of one hook. `update(cells)` restyles the given cells with ONE
    `ColumnDataSource.patch` (or replaces the data when the colour range changed). Must be
    called with the Bokeh document lock held (from a periodic callback) when served."""

    def __init__(self, hook: str, layers: Sequence[int], positions: Sequence[int], token_strings: Sequence[str],
                 metric: str, *, baselines: Iterable[float | None] = (), title: str | None = None,
                 subject: Iterable[int] = (), colorbar_label: str | None = None):
        self.hook, self.layers, self.positions, self.metric = hook, list(layers), list(positions), metric
        self.labels = position_labels(self.positions, token_strings, subject)
        self.tokens = [token_text(t) for t in token_strings]
        self.baselines = tuple(baselines)
        n_l, n_p = len(self.layers), len(self.positions)
        self._values = np.full((n_l, n_p), np.nan)
        self._status = status_grid((n_l, n_p))
        self._reasons: dict[tuple[int, int], str] = {}
        self.scale = self._scale()
        self.source = ColumnDataSource(self._columns())
        self.mapper = LinearColorMapper(palette=list(self.scale.palette.colors), low=self.scale.low,
                                        high=self.scale.high, nan_color=CELL_LOOKS[CellStatus.PENDING].fill)
        self.figure = self._figure(title or hook, colorbar_label or metric)

    @classmethod
    def from_result(cls, result: SweepResult, hook: str, *, zoom: bool = False,
                    statuses: np.ndarray | None = None, reasons: dict[tuple[int, int], str] | None = None) -> "SweepHeatmap":
        """The heatmap of one hook of `result`, titled and labelled as the exported figure
        (`presentation.figure_title`, `result_metric_label`), showing its values with `statuses`
        (default: those the result's data imply, `app.sweep.fold.result_statuses`)."""
        hm = cls(hook, result.layers, result.positions, result.token_strings, result.metric,
                 baselines=baselines_of(result), title=figure_title(result, hook, zoom=zoom),
                 subject=subject_positions(result), colorbar_label=result_metric_label(result))
        statuses = result_statuses(result, hook) if statuses is None else statuses
        grid = result.grids[hook]
        reasons = reasons or {}
        hm.update((i, j, float(grid[i, j]), statuses[i, j], reasons.get((i, j), ""))
                  for i in range(grid.shape[0]) for j in range(grid.shape[1]))
        return hm

    # ---- construction ------------------------------------------------------------------------
    def _figure(self, title: str, colorbar_label: str):
        n_l, n_p = len(self.layers), len(self.positions)
        width = int(min(1100, max(400, 160 + 50 * n_p)))
        height = int(min(700, max(240, 150 + 34 * n_l)))
        fig = figure(
            title=title, x_range=Range1d(-0.5, n_p - 0.5), y_range=Range1d(-0.5, n_l - 0.5),
            width=width, height=height, tools="reset,save", toolbar_location="above",
            y_axis_label=LAYER_AXIS_LABEL,
        )
        renderer = fig.rect(
            "x", "y", 1, 1, source=self.source, fill_color="fill", hatch_pattern="hatch", hatch_color="hatch_color",
            hatch_scale=HATCH_SCALE, hatch_weight=1.2, line_color="#ffffff", line_width=1,
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
        columns = list(range(n_p))
        self.token_axis = tokens = fig.below[0]
        tokens.ticker = FixedTicker(ticks=columns)
        tokens.major_label_overrides = dict(zip(columns, self.labels))
        if n_p > 8 or max((len(s) for s in self.labels), default=0) > 8:
            tokens.major_label_orientation = 0.8
        self.position_axis = LinearAxis(
            ticker=FixedTicker(ticks=columns), major_label_overrides={j: str(p) for j, p in zip(columns, self.positions)},
            axis_label=POSITION_AXIS_LABEL, axis_label_text_font_size="9pt", major_label_text_font_size="9pt")
        fig.add_layout(self.position_axis, "above")
        rows = layer_ticks(n_l)
        self.layer_axis = fig.left[0]
        self.layer_axis.ticker = FixedTicker(ticks=rows)
        self.layer_axis.major_label_overrides = {i: str(self.layers[i]) for i in rows}
        for axis in (tokens, self.position_axis, self.layer_axis):
            axis.major_tick_line_color = None
            axis.minor_tick_line_color = None
            axis.axis_line_color = None
        self.color_bar = ColorBar(color_mapper=self.mapper, title=colorbar_label, title_text_font_size="9pt", width=12)
        fig.add_layout(self.color_bar, "right")
        return fig

    def _scale(self) -> ColorScale:
        return color_scale(self.metric, self._values[self._has_value()], self.baselines)

    def _look(self, i: int, j: int) -> tuple[str, str, str, str, str]:
        status, value = self._status[i, j], float(self._values[i, j])
        look = CELL_LOOKS[status]
        fill = look.fill if look.fill is not None else self.scale.color(value)
        return fill, look.hatch or " ", look.hatch_color, format_value(value), status_text(status, self._reasons.get((i, j), ""))

    def _columns(self) -> dict[str, list]:
        cols: dict[str, list] = {k: [] for k in ("x", "y", "hook", "layer", "position", "token", *CELL_COLUMNS)}
        for i, layer in enumerate(self.layers):
            for j, pos in enumerate(self.positions):
                fill, hatch, hcolor, vtext, stext = self._look(i, j)
                cols["x"].append(j)
                cols["y"].append(i)
                cols["hook"].append(self.hook)
                cols["layer"].append(layer)
                cols["position"].append(pos)
                cols["token"].append(self.tokens[j])
                cols["fill"].append(fill)
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
        scale = self._scale()
        if (scale.low, scale.high) != (self.scale.low, self.scale.high):
            self.scale = scale
            self.mapper.update(low=scale.low, high=scale.high)
            self.source.data = self._columns()
            return len(changed)
        self.scale = scale
        n_p = len(self.positions)
        patch: dict[str, list] = {k: [] for k in CELL_COLUMNS}
        for i, j in changed:
            idx = i * n_p + j
            fill, hatch, hcolor, vtext, stext = self._look(i, j)
            for key, val in zip(CELL_COLUMNS, (fill, hatch, hcolor, float(self._values[i, j]), vtext, stext)):
                patch[key].append((idx, val))
        self.source.patch(patch)
        return len(changed)

    def selected_block(self) -> tuple[list[int], list[int]] | None:
        """The rectangle spanned by the selected cells as (layers, positions): every layer
        and every position (token index) from the smallest to the largest selected one, so a
        zoom over a coarse sweep becomes finer. None when nothing is selected."""
        return block_of(self.source.selected.indices or [], self.layers, self.positions)

    def filled_cells(self) -> int:
        """Cells showing a value (done or within noise)."""
        return int(np.count_nonzero(self._has_value()))

    def _has_value(self) -> np.ndarray:
        return (self._status == CellStatus.DONE) | (self._status == CellStatus.NOISE)


def block_of(indices: Sequence[int], layers: Sequence[int], positions: Sequence[int]) -> tuple[list[int], list[int]] | None:
    """The (layers, positions) rectangle spanned by data-source row `indices` of a heatmap with
    these axes (rows run position-fastest); None for no indices."""
    if not indices:
        return None
    n_p = len(positions)
    rows = [layers[k // n_p] for k in indices]
    cols = [positions[k % n_p] for k in indices]
    return list(range(min(rows), max(rows) + 1)), list(range(min(cols), max(cols) + 1))


def legend_html(noise_threshold: float | None = None) -> str:
    """The key: every cell look (an inline SVG swatch and its legend text, the status' meaning
    as a tooltip) and the subject mark, as the exported figure's legend words them."""
    items = [f'<span class="cb-key-item" title="{SUBJECT_LEGEND}"><b>*</b>&nbsp;{SUBJECT_LEGEND}</span>']
    for status, look in CELL_LOOKS.items():
        items.append(f'<span class="cb-key-item" data-status="{look.name}" title="{STATUS_MEANINGS[status]}">'
                     f'{_swatch(status)}&nbsp;{legend_text(status, noise_threshold)}</span>')
    return ('<div class="cb-key" style="display:flex;flex-wrap:wrap;gap:14px;font-size:12px;align-items:center">'
            "<b>Key:</b>" + "".join(items) + "</div>")


_PATTERNS = {
    ".": '<circle cx="3" cy="3" r="1" fill="{c}"/><circle cx="9" cy="9" r="1" fill="{c}"/>'
         '<circle cx="9" cy="3" r="1" fill="{c}"/><circle cx="3" cy="9" r="1" fill="{c}"/>',
    "/": '<path d="M0 12 L12 0 M-3 3 L3 -3 M9 15 L15 9" stroke="{c}" stroke-width="1.2"/>',
    "x": '<path d="M2 2 L10 10 M10 2 L2 10" stroke="{c}" stroke-width="1.4"/>',
    "": "",
}


def _swatch(status: CellStatus) -> str:
    look = CELL_LOOKS[status]
    pattern = _PATTERNS[look.hatch].format(c=look.hatch_color)
    return (f'<svg width="16" height="16" viewBox="0 0 12 12" style="vertical-align:middle;border:1px solid #bbb">'
            f'<rect width="12" height="12" fill="{look.fill or look.swatch}"/>{pattern}</svg>')


__all__ = ["CELL_COLUMNS", "SweepHeatmap", "block_of", "format_value", "legend_html", "status_text"]
