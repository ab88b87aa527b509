"""The matplotlib side of a sweep figure: export rcParams, figure sizes, and the translation of
`app.figures.presentation` (colour scales, hatch patterns, text) into matplotlib objects.

What a figure shows — colours, ranges, token labels, status marks, legend texts — is defined in
`app/figures/presentation.py`, shared with the dashboard. Pure helpers for `app.figures.export`;
nothing here touches files or global matplotlib state (`export_rc()` is a context manager around
`matplotlib.rc_context`).

* **Vector output.** `EXPORT_RC` embeds TrueType fonts in PDF/PS (`fonttype 42`, editable text,
  no Type 3 bitmaps) and keeps SVG text as `<text>` (`svg.fonttype = "none"`). The rcParams
  are read when a figure is *saved*, so saving must happen inside `export_rc()` too.
* **Sizes.** A figure is exactly one column (3.5 in) or two columns (7.0 in) wide; its height
  follows the grid shape (`figure_size`). No `bbox_inches="tight"`: the width printed in the
  paper is the width drawn, so font sizes stay true.
* **Colours.** `colormap(scale)` is a `ListedColormap` of the presentation palette, so a cell's
  colour is the one the dashboard gives the same value; `norm(scale)` its range.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import matplotlib
from matplotlib.colors import Colormap, ListedColormap, Normalize, TwoSlopeNorm

from app.figures.presentation import MAX_LABEL_CHARS, NO_VALUE_COLOR, ColorScale
from engine_ext.errors import SpecError

#: rcParams for every exported figure (fonts embedded as TrueType, SVG text kept as text)
EXPORT_RC: dict = {
    "pdf.fonttype": 42,
    "ps.fonttype": 42,
    "svg.fonttype": "none",
    "font.family": "DejaVu Sans",
    "axes.linewidth": 0.6,
    "xtick.major.width": 0.5,
    "ytick.major.width": 0.5,
    "xtick.major.size": 2.0,
    "ytick.major.size": 2.0,
    "hatch.linewidth": 0.5,
    "legend.handlelength": 1.2,
    "legend.handletextpad": 0.4,
    "legend.columnspacing": 1.0,
    "legend.borderpad": 0.2,
    "savefig.dpi": 300,
    "savefig.bbox": None,
}

#: named figure widths in inches (one / two columns of a typical two-column paper)
WIDTHS = {"single": 3.5, "double": 7.0}
#: base font size (pt) per width name
FONT_SIZES = {"single": 7.0, "double": 8.0}
PNG_DPI = 300
#: hatch pattern -> how many times matplotlib repeats it (its density is per inch: 6 lines for
#: one "/", and a paper cell is 0.06-0.3 in wide)
HATCH_REPEAT = {"/": 4, "x": 3, ".": 3}


@contextlib.contextmanager
def export_rc(width: str | float = "single") -> Iterator[None]:
    """`matplotlib.rc_context` with `EXPORT_RC` and the base font size for `width`."""
    size = font_size(width)
    with matplotlib.rc_context({**EXPORT_RC, "font.size": size, "axes.titlesize": size,
                                "axes.labelsize": size, "legend.fontsize": size - 1,
                                "xtick.labelsize": size - 1, "ytick.labelsize": size - 1}):
        yield


def width_inches(width: str | float) -> float:
    """Figure width: "single" (3.5 in), "double" (7.0 in) or a number of inches in [1, 20]."""
    if isinstance(width, str):
        if width not in WIDTHS:
            raise SpecError("width", f"must be 'single', 'double' or inches, got {width!r}")
        return WIDTHS[width]
    if isinstance(width, bool) or not isinstance(width, (int, float)) or not 1.0 <= float(width) <= 20.0:
        raise SpecError("width", f"must be 'single', 'double' or inches in [1, 20], got {width!r}")
    return float(width)


def colorbar_fraction(width: str | float) -> float:
    """Colorbar width as a fraction of the heatmap's width (about 0.1 in at any figure width)."""
    return 0.1 / max(width_inches(width) - 1.0, 0.5)


def font_size(width: str | float) -> float:
    inches = width_inches(width)
    return FONT_SIZES["single"] if inches < 5.0 else FONT_SIZES["double"]


def figure_size(width: str | float, n_layers: int, n_positions: int, longest_label: int,
                has_title: bool, legend_rows: int) -> tuple[float, float]:
    """(width, height) in inches. Cells are about square, capped so that a deep model stays on
    one page; the fixed parts (title, rotated token labels, legend) are estimated from the font
    size, and constrained layout places them exactly."""
    w = width_inches(width)
    pt = font_size(width) / 72.0  # inches per point
    plot_w = max(w - 1.0, 0.5)  # minus y label, layer ticks and colorbar
    cell = min(max(plot_w / max(n_positions, 1), 0.06), 0.3)
    plot_h = min(max(n_layers * cell, 0.9), 0.6 * w + 1.0)
    label_pt = (font_size(width) - 1.0) / 72.0
    # 45° token labels: sin 45° x characters x ~0.6 em, plus the top axis' position numbers
    labels_h = 0.71 * min(longest_label, MAX_LABEL_CHARS + 1) * 0.6 * label_pt + 3 * pt
    fixed = labels_h + 2.2 * pt + (2.0 * pt if has_title else 0.0) + legend_rows * 1.6 * pt + 0.12
    return w, round(plot_h + fixed, 2)


def literal(text: str) -> str:
    """`text` escaped so matplotlib draws it verbatim (an unescaped pair of `$` would start
    mathtext; every other mathtext special is inert outside `$…$`)."""
    return text.replace("$", r"\$")


def hatch(pattern: str) -> str | None:
    """A presentation hatch pattern ("/", "x", ".") at the density a paper cell needs; None for none."""
    return pattern * HATCH_REPEAT.get(pattern, 3) if pattern else None


def colormap(scale: ColorScale, cmap: str | Colormap | None = None) -> Colormap:
    """The scale's palette as a matplotlib colormap (`ListedColormap`: `palette[floor(t · N)]`,
    as the dashboard colours cells), or `cmap` instead; NaN cells get `NO_VALUE_COLOR`."""
    if cmap is None:
        base: Colormap = ListedColormap(list(scale.palette.colors), name=scale.palette.name)
    else:
        base = matplotlib.colormaps[cmap] if isinstance(cmap, str) else cmap
    return base.with_extremes(bad=NO_VALUE_COLOR)


def norm(scale: ColorScale) -> Normalize:
    """The scale's range as a matplotlib norm (`TwoSlopeNorm` when it has an asymmetric centre)."""
    if scale.center is not None:
        return TwoSlopeNorm(vcenter=scale.center, vmin=scale.low, vmax=scale.high)
    return Normalize(scale.low, scale.high)


def position_font_size(width: str | float, n_positions: int) -> float:
    """Token label size (pt): the base tick size, shrunk (to 4.5 pt) when many tokens share
    the axis."""
    plot_w_pt = max(width_inches(width) - 1.0, 0.5) * 72.0
    return max(4.5, min(font_size(width) - 1.0, 0.85 * plot_w_pt / max(n_positions, 1)))
