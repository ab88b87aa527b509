"""How a sweep figure looks: export rcParams, figure sizes, token labels and colour scales.

Pure helpers for `app.figures.export`; nothing here touches files or global matplotlib state
(`export_rc()` is a context manager around `matplotlib.rc_context`).

* **Vector output.** `EXPORT_RC` embeds TrueType fonts in PDF/PS (`fonttype 42`, editable text,
  no Type 3 bitmaps) and keeps SVG text as `<text>` (`svg.fonttype = "none"`). The rcParams
  are read when a figure is *saved*, so saving must happen inside `export_rc()` too.
* **Sizes.** A figure is exactly one column (3.5 in) or two columns (7.0 in) wide; its height
  follows the grid shape (`figure_size`). No `bbox_inches="tight"`: the width printed in the
  paper is the width drawn, so font sizes stay true.
* **Colours.** `recovered` and `logit_diff` are signed (0 = no effect / no preference): a
  diverging map centred at 0. `recovered` uses a symmetric range that always includes ±1 and
  is clipped at ±`RECOVERED_CLIP` (overshoots show as colorbar arrows), so colours compare
  across sweeps. `logprob` and `prob` get a sequential map over the data and both baselines.
"""

from __future__ import annotations

import contextlib
import math
import unicodedata
from dataclasses import dataclass
from typing import Iterator

import matplotlib
import numpy as np
from matplotlib.colors import Colormap, Normalize, TwoSlopeNorm

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
#: `recovered` colour range: symmetric, at least ±1, at most ±RECOVERED_CLIP
RECOVERED_CLIP = 1.5
DIVERGING_METRICS = ("recovered", "logit_diff")
SEQUENTIAL_METRICS = ("logprob", "prob")
DIVERGING_CMAP = "RdBu_r"
SEQUENTIAL_CMAP = "Purples"
#: colour of cells without a value (skipped, voided, pending)
NO_VALUE_COLOR = "#bdbdbd"
MARK_COLOR = "#262626"
HATCH = "////"
#: longest token label (characters) before it is shortened with "…"
MAX_LABEL_CHARS = 14


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


def token_label(token: str) -> str:
    """A token made readable and safe as matplotlib text: spaces as "␣", newlines as "↵", tabs
    as "⇥", other control characters as `\\xNN`, the empty token as "∅", long tokens shortened
    with "…", and `$` escaped so that no label is parsed as mathtext."""
    if token == "":
        return "∅"
    out = []
    for ch in token:
        if ch == " ":
            out.append("␣")
        elif ch == "\n":
            out.append("↵")
        elif ch == "\t":
            out.append("⇥")
        elif unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp", "Zs"):
            out.append(f"\\x{ord(ch):02x}" if ord(ch) < 256 else f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    text = "".join(out)
    if len(text) > MAX_LABEL_CHARS:
        text = text[: MAX_LABEL_CHARS - 1] + "…"
    return literal(text)


def literal(text: str) -> str:
    """`text` escaped so matplotlib draws it verbatim (an unescaped pair of `$` would start
    mathtext; every other mathtext special is inert outside `$…$`)."""
    return text.replace("$", r"\$")


@dataclass(frozen=True)
class ColorScale:
    """What `pcolormesh` and the colorbar need: the colormap (with the no-value colour set),
    the norm, and the colorbar's `extend` ("neither", "min", "max" or "both")."""

    cmap: Colormap
    norm: Normalize
    extend: str
    diverging: bool


def color_scale(metric: str, values: np.ndarray, *, baselines: tuple[float | None, ...] = (),
                cmap: str | Colormap | None = None, vmin: float | None = None,
                vmax: float | None = None) -> ColorScale:
    """The colour scale for `metric` over `values` (NaN = no value). `baselines` (clean and
    corrupt values, when they are in the metric's units) are kept inside a sequential range.
    `vmin`/`vmax` override the computed limits; a diverging scale whose limits straddle 0 stays
    centred at 0 (`TwoSlopeNorm`)."""
    diverging = metric in DIVERGING_METRICS
    finite = values[np.isfinite(values)]
    base = [float(b) for b in baselines if b is not None and math.isfinite(float(b))]
    if diverging:
        peak = float(np.max(np.abs(finite))) if finite.size else 0.0
        if metric == "recovered":
            lim = min(max(peak, 1.0), RECOVERED_CLIP)
        else:
            lim = max([peak] + [abs(b) for b in base]) or 1.0
        lo, hi = -lim, lim
    else:
        pool = np.concatenate([finite, np.array(base, dtype=float)])
        lo, hi = (float(pool.min()), float(pool.max())) if pool.size else (0.0, 1.0)
        if hi <= lo:
            lo, hi = lo - 0.5, hi + 0.5
    if vmin is not None and vmax is None and diverging and vmin < 0:
        vmax = -vmin
    if vmax is not None and vmin is None and diverging and vmax > 0:
        vmin = -vmax
    lo = float(vmin) if vmin is not None else lo
    hi = float(vmax) if vmax is not None else hi
    if not hi > lo:
        raise SpecError("vmax", f"must be greater than vmin ({lo} >= {hi})")
    if diverging and lo < 0 < hi:
        norm: Normalize = TwoSlopeNorm(vcenter=0.0, vmin=lo, vmax=hi) if lo != -hi else Normalize(lo, hi)
    else:
        norm = Normalize(lo, hi)
    below = bool(finite.size and finite.min() < lo)
    above = bool(finite.size and finite.max() > hi)
    extend = {(False, False): "neither", (True, False): "min", (False, True): "max", (True, True): "both"}[(below, above)]
    name = cmap if cmap is not None else (DIVERGING_CMAP if diverging else SEQUENTIAL_CMAP)
    colormap = (matplotlib.colormaps[name] if isinstance(name, str) else name).with_extremes(bad=NO_VALUE_COLOR)
    return ColorScale(colormap, norm, extend, diverging)


def metric_label(metric: str, basis: str | None, answer: str | None, foil: str | None) -> str:
    """Colorbar label: "recovered (logprob)", "logit_diff (␣Paris − ␣Rome)", "logprob (␣Paris)"."""
    if metric == "recovered":
        return f"recovered ({basis or 'logprob'})"
    if metric == "logit_diff" and answer is not None and foil is not None:
        return f"logit_diff ({token_label(answer)} − {token_label(foil)})"
    if answer is not None:
        return f"{metric} ({token_label(answer)})"
    return metric


def direction_label(source: dict | None, noised: bool) -> str:
    """What the sweep wrote into the corrupt run, for the title: "clean → corrupt" (restoring
    a stored clean run), "clean → noised", "zero-ablation", "mean-ablation", "vector ‘v’"."""
    kind = (source or {}).get("kind", "run")
    if kind == "zeros":
        return "zero-ablation"
    if kind == "mean":
        return "mean-ablation"
    if kind == "vector":
        return f"vector ‘{literal(str(source.get('name', '?')))}’"
    if kind == "inline":
        return "inline vector"
    return "clean → noised" if noised else "clean → corrupt"


def layer_ticks(n_layers: int, max_ticks: int = 12) -> list[int]:
    """Row indices that get a layer label: every row, or every k-th (always the last one)."""
    step = max(1, math.ceil(n_layers / max_ticks))
    ticks = list(range(0, n_layers, step))
    if n_layers and ticks[-1] != n_layers - 1 and n_layers - 1 - ticks[-1] >= step / 2:
        ticks.append(n_layers - 1)
    return ticks


def position_font_size(width: str | float, n_positions: int) -> float:
    """Token label size (pt): the base tick size, shrunk (to 4.5 pt) when many tokens share
    the axis."""
    plot_w_pt = max(width_inches(width) - 1.0, 0.5) * 72.0
    return max(4.5, min(font_size(width) - 1.0, 0.85 * plot_w_pt / max(n_positions, 1)))
