"""How a patch sweep looks, on screen and on paper: ONE definition, plain data.

The dashboard's Bokeh heatmaps (`app/dashboard/tracing/heatmap.py`) and the exported matplotlib
figures (`app/figures/export.py`) both render from this module, so the same sweep looks the same
in the browser and in the paper: the same colour for the same value, the same token labels, the
same status marks and legend text, the same titles. Nothing here imports Bokeh or matplotlib;
each renderer only translates these values into its library's calls (e.g. a hatch pattern's
density, or matplotlib's `$` escaping).

* **Colour scales** (`color_scale`). `recovered` and `logit_diff` are signed (0 = no effect / no
  preference): the diverging palette, symmetric about 0. `recovered` always spans at least ±1 and
  is clipped at ±`RECOVERED_CLIP` (overshoots are flagged, `extend`), so colours compare across
  sweeps; `logit_diff` spans the largest |value| or |baseline|, rounded up to a round number.
  `prob` spans [0, 1]; `logprob` spans the values and both baselines (the sequential palette).
  A value's colour is `palette[floor(t · N)]` with t its place in the range (clipped to the ends)
  — exactly what a matplotlib `ListedColormap` of the same palette and a Bokeh
  `LinearColorMapper` do, so both libraries can draw a colour bar of the same scale.
* **Token labels** (`token_text`, `token_label`, `position_labels`): spaces as `␣`, newlines as
  `↵`, tabs as `⇥`, other control/format/separator characters as `\\xNN` / `\\uNNNN`, the empty
  token as `∅`; axis labels are cut to `MAX_LABEL_CHARS` with `…`; `*` marks the subject (or
  noised) span. Position numbers go on a second axis, so repeated tokens stay distinct.
* **Cell statuses** (`CELL_LOOKS`): each `app.sweep.fold.CellStatus` has one look (fill, hatch
  pattern, hatch colour), one legend text and one name — the name is the export's CSV `status`
  column and the dashboard tooltip's status (`STATUS_NAMES`).
* **Texts**: titles (`figure_title`), the colour bar's label (`metric_label`), each metric's
  formula (`METRIC_FORMULAS`), layer ticks (`layer_ticks`).
"""

from __future__ import annotations

import math
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from app.sweep.fold import CellStatus
from app.sweep.result import SweepResult
from engine_ext.errors import SpecError

# ---- palettes -------------------------------------------------------------------------------------
#: colours per palette: odd, so that a symmetric range puts 0 exactly on the diverging centre
PALETTE_SIZE = 255
#: ColorBrewer RdBu (11 classes), blue (negative) → near-white (0) → red (positive)
RDBU_ANCHORS = ("#053061", "#2166ac", "#4393c3", "#92c5de", "#d1e5f0", "#f7f7f7",
                "#fddbc7", "#f4a582", "#d6604d", "#b2182b", "#67001f")
#: viridis (van der Walt & Smith), 17 evenly spaced stops: perceptually uniform, monotone in
#: lightness (prints in greyscale), readable with colour-blindness
VIRIDIS_ANCHORS = ("#440154", "#48186a", "#472d7b", "#424086", "#3b528b", "#33638d", "#2c728e", "#26828e",
                   "#21918c", "#1fa088", "#28ae80", "#3fbc73", "#5ec962", "#84d44b", "#addc30", "#d8e219", "#fde725")


def interpolate_palette(anchors: Sequence[str], n: int) -> tuple[str, ...]:
    """`n` colours linearly interpolated (in sRGB) between evenly spaced `anchors`; the first
    and last colour are the first and last anchor."""
    rgb = np.array([[int(a[k:k + 2], 16) for k in (1, 3, 5)] for a in anchors], dtype=float)
    stops = np.linspace(0.0, 1.0, len(anchors))
    t = np.linspace(0.0, 1.0, n)
    channels = np.stack([np.interp(t, stops, rgb[:, c]) for c in range(3)], axis=1)
    return tuple("#%02x%02x%02x" % tuple(int(round(v)) for v in row) for row in channels)


@dataclass(frozen=True)
class Palette:
    """A named list of colours, low values first."""

    name: str
    colors: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.colors)


DIVERGING = Palette("RdBu (causalboard)", interpolate_palette(RDBU_ANCHORS, PALETTE_SIZE))
SEQUENTIAL = Palette("viridis (causalboard)", interpolate_palette(VIRIDIS_ANCHORS, PALETTE_SIZE))

# ---- metrics --------------------------------------------------------------------------------------
DIVERGING_METRICS = ("recovered", "logit_diff")
SEQUENTIAL_METRICS = ("logprob", "prob")
#: `recovered` colour range: symmetric, at least ±1, at most ±RECOVERED_CLIP
RECOVERED_CLIP = 1.5
#: what each metric's values are (status line, docs)
METRIC_FORMULAS = {
    "recovered": "recovered = (patched − corrupt) / (clean − corrupt)",
    "logit_diff": "logit_diff = log p(answer) − log p(foil)",
    "logprob": "logprob = log p(answer)",
    "prob": "prob = p(answer)",
}


def palette_for(metric: str) -> Palette:
    return DIVERGING if metric in DIVERGING_METRICS else SEQUENTIAL


def baselines_of(result: SweepResult) -> tuple[float | None, ...]:
    """The values a scale must also span: the clean and corrupt baselines when they are in the
    metric's units (every metric but `recovered`, whose baselines are in its basis' units)."""
    if result.metric == "recovered":
        return ()
    return (result.meta.get("clean"), result.meta.get("corrupt"))


# ---- colour scales --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ColorScale:
    """Values → palette colours over [low, high]. `center` (0) is set only for a diverging
    scale whose limits straddle 0 asymmetrically (explicit `vmin`/`vmax`): each side then has its
    own slope (matplotlib's `TwoSlopeNorm`). `below`/`above`: some values lie outside the range
    (drawn in the end colours; a colour bar shows them as arrows, `extend`)."""

    metric: str
    palette: Palette
    low: float
    high: float
    center: float | None = None
    below: bool = False
    above: bool = False

    @property
    def diverging(self) -> bool:
        return self.palette is DIVERGING

    @property
    def extend(self) -> str:
        return {(False, False): "neither", (True, False): "min", (False, True): "max", (True, True): "both"}[(self.below, self.above)]

    def fraction(self, value: float) -> float:
        """Where `value` lies in the range: 0 at `low`, 1 at `high` (not clipped; NaN stays NaN)."""
        if self.center is not None:
            return float(np.interp(value, [self.low, self.center, self.high], [0.0, 0.5, 1.0], left=-np.inf, right=np.inf))
        return (value - self.low) / (self.high - self.low)

    def index(self, value: float) -> int | None:
        """The palette index of `value` (None for NaN): floor(fraction · N), clipped to the ends."""
        if value is None or math.isnan(value):
            return None
        n = len(self.palette)
        x = self.fraction(float(value)) * n
        if math.isnan(x):
            return None
        return 0 if x < 0 else n - 1 if x >= n - 1 else int(x)

    def color(self, value: float) -> str:
        """The colour of `value`; `NO_VALUE_COLOR` for NaN."""
        k = self.index(value)
        return NO_VALUE_COLOR if k is None else self.palette.colors[k]


def value_range(metric: str, values: Iterable[float], baselines: Iterable[float | None] = ()) -> tuple[float, float]:
    """The default (low, high) of `metric`'s scale over `values` (NaN ignored) and `baselines`
    (see the module docstring). It only grows when values are added, so a streaming view
    recolours its cells only when a value falls outside what it showed."""
    arr = np.asarray([v for v in values if v is not None], dtype=float)
    finite = arr[np.isfinite(arr)]
    base = [float(b) for b in baselines if b is not None and math.isfinite(float(b))]
    if metric == "recovered":
        peak = float(np.max(np.abs(finite))) if finite.size else 0.0
        lim = min(max(peak, 1.0), RECOVERED_CLIP)
        return -lim, lim
    if metric in DIVERGING_METRICS:
        peak = max([float(np.max(np.abs(finite))) if finite.size else 0.0] + [abs(b) for b in base])
        lim = nice_ceiling(peak)
        return -lim, lim
    if metric == "prob":
        return 0.0, 1.0
    pool = np.concatenate([finite, np.array(base, dtype=float)])
    if not pool.size:
        return 0.0, 1.0
    lo, hi = float(pool.min()), float(pool.max())
    return (lo - 0.5, hi + 0.5) if hi <= lo else (lo, hi)


def color_scale(metric: str, values: Iterable[float], baselines: Iterable[float | None] = (), *,
                vmin: float | None = None, vmax: float | None = None) -> ColorScale:
    """The colour scale of `metric` for `values` (NaN = no value): `value_range`, unless
    `vmin`/`vmax` override it (one given for a diverging metric mirrors the other about 0).
    Raises `SpecError("vmax", …)` when the range is empty."""
    arr = np.asarray(list(values) if not isinstance(values, np.ndarray) else values, dtype=float).ravel()
    lo, hi = value_range(metric, arr, baselines)
    diverging = metric in DIVERGING_METRICS
    if vmin is not None and vmax is None and diverging and vmin < 0:
        vmax = -vmin
    if vmax is not None and vmin is None and diverging and vmax > 0:
        vmin = -vmax
    lo = float(vmin) if vmin is not None else lo
    hi = float(vmax) if vmax is not None else hi
    if not hi > lo:
        raise SpecError("vmax", f"must be greater than vmin ({lo} >= {hi})")
    center = 0.0 if diverging and lo < 0 < hi and lo != -hi else None
    finite = arr[np.isfinite(arr)]
    return ColorScale(metric, palette_for(metric), lo, hi, center,
                      below=bool(finite.size and finite.min() < lo), above=bool(finite.size and finite.max() > hi))


def result_scale(result: SweepResult, hook: str, *, vmin: float | None = None, vmax: float | None = None) -> ColorScale:
    """The colour scale of one hook's grid of `result` (both renderers use this)."""
    return color_scale(result.metric, result.grids[hook], baselines_of(result), vmin=vmin, vmax=vmax)


def nice_ceiling(x: float) -> float:
    """A round number ≥ x (1, 1.5, 2, 2.5, 3, 4, 5, 7.5, 10 × 10^k), 1 for x ≤ 0: ranges grow in
    steps instead of with every new extreme value."""
    if x <= 0 or not math.isfinite(x):
        return 1.0
    exp = math.floor(math.log10(x))
    for m in (1, 1.5, 2, 2.5, 3, 4, 5, 7.5, 10):
        if m * 10**exp >= x:
            return float(m * 10**exp)
    return float(10 ** (exp + 1))


# ---- cell statuses --------------------------------------------------------------------------------
#: the colour of a cell without a value (pending or skipped)
NO_VALUE_COLOR = "#bdbdbd"
#: dark marks (hatching of skipped cells, the subject's asterisk in a legend)
MARK_COLOR = "#262626"


@dataclass(frozen=True)
class CellLook:
    """How cells of one status are drawn. `fill=None`: the value's colour. `hatch`: a pattern
    both renderers draw — "" none, "/" diagonal lines, "x" a diagonal cross, "." dots (each
    renderer picks the density that suits its cell size). `name`: the status' name in exports
    and tooltips. `legend`: the legend / key text. `swatch`: the legend swatch's fill."""

    name: str
    fill: str | None
    hatch: str
    hatch_color: str
    legend: str
    swatch: str


#: every status, in legend order
CELL_LOOKS: dict[CellStatus, CellLook] = {
    CellStatus.DONE: CellLook("ok", None, "", MARK_COLOR, "value", "#d6604d"),
    CellStatus.NOISE: CellLook("within_noise", None, ".", "#8c8c8c", "within noise floor", "#fddbc7"),
    CellStatus.SKIPPED: CellLook("skipped", NO_VALUE_COLOR, "/", MARK_COLOR, "skipped (unaligned)", NO_VALUE_COLOR),
    CellStatus.VOIDED: CellLook("voided", "#4d4d4d", "x", "#ffffff", "voided (patch failed)", "#4d4d4d"),
    CellStatus.PENDING: CellLook("pending", NO_VALUE_COLOR, "", MARK_COLOR, "pending (no value yet)", NO_VALUE_COLOR),
}
#: the name of each status (the export's CSV `status` column, the manifest's `by_status`, tooltips)
STATUS_NAMES: dict[CellStatus, str] = {status: look.name for status, look in CELL_LOOKS.items()}
#: what each status means (the screen key's tooltips; docs/dashboard.md, docs/export.md)
STATUS_MEANINGS: dict[CellStatus, str] = {
    CellStatus.DONE: "the cell's value",
    CellStatus.NOISE: "a value whose effect is within the noise floor (|value| for recovered, |value − corrupt| otherwise)",
    CellStatus.SKIPPED: "not run: the position is unaligned between the clean and corrupt prompts",
    CellStatus.VOIDED: "run, but its patch could not be applied (e.g. the source run was evicted); value withdrawn",
    CellStatus.PENDING: "not computed yet (or never: the sweep was cancelled)",
}
SUBJECT_MARK = "*"
SUBJECT_LEGEND = "subject token (*)"


def legend_text(status: CellStatus, noise_threshold: float | None = None) -> str:
    """The legend text of `status`; the within-noise entry names the threshold when known."""
    text = CELL_LOOKS[status].legend
    if status is CellStatus.NOISE and isinstance(noise_threshold, (int, float)) and math.isfinite(noise_threshold):
        text += f" (±{noise_threshold:.2g})"
    return text


def noise_threshold(meta: dict) -> float | None:
    """The effect size the within-noise marks mean: the server's threshold (the noise floor,
    raised to a tiny minimum effect), else the noise floor."""
    value = meta.get("within_noise_threshold")
    return meta.get("noise_floor") if value is None else value


# ---- token labels ---------------------------------------------------------------------------------
#: longest axis label (characters) before it is shortened with "…"
MAX_LABEL_CHARS = 14
_GLYPHS = {" ": "␣", "\n": "↵", "\t": "⇥"}


def token_text(token: str) -> str:
    """A token with whitespace and invisible characters made visible (space ␣, newline ↵,
    tab ⇥, other control/format/separator characters `\\xNN` or `\\uNNNN`; empty token ∅).
    Plain text, not escaped for HTML or for matplotlib."""
    if token == "":
        return "∅"
    out = []
    for ch in token:
        if ch in _GLYPHS:
            out.append(_GLYPHS[ch])
        elif unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp", "Zs"):
            out.append(f"\\x{ord(ch):02x}" if ord(ch) < 256 else f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return "".join(out)


def token_label(token: str) -> str:
    """`token_text`, shortened to `MAX_LABEL_CHARS` with "…" (axis labels)."""
    text = token_text(token)
    return text[: MAX_LABEL_CHARS - 1] + "…" if len(text) > MAX_LABEL_CHARS else text


def position_labels(positions: Sequence[int], token_strings: Sequence[str], subject: Iterable[int] = ()) -> list[str]:
    """The token axis' labels: `token_label` of each position's token, `*` after the positions
    in `subject`."""
    marked = set(subject)
    return [token_label(t) + (SUBJECT_MARK if p in marked else "") for p, t in zip(positions, token_strings)]


# ---- texts ----------------------------------------------------------------------------------------
LAYER_AXIS_LABEL = "layer"
POSITION_AXIS_LABEL = "position"


def metric_label(metric: str, basis: str | None, answer: str | None, foil: str | None) -> str:
    """The colour bar's label: "recovered (logprob)", "logit_diff (␣Paris − ␣Rome)", "logprob (␣Paris)"."""
    if metric == "recovered":
        return f"recovered ({basis or 'logprob'})"
    if metric == "logit_diff" and answer is not None and foil is not None:
        return f"logit_diff ({token_label(answer)} − {token_label(foil)})"
    if answer is not None:
        return f"{metric} ({token_label(answer)})"
    return metric


def direction_label(source: dict | None, noised: bool) -> str:
    """What the sweep wrote into the corrupt run: "clean → corrupt" (restoring a stored clean
    run), "clean → noised", "zero-ablation", "mean-ablation", "vector ‘v’", "inline vector"."""
    kind = (source or {}).get("kind", "run")
    if kind == "zeros":
        return "zero-ablation"
    if kind == "mean":
        return "mean-ablation"
    if kind == "vector":
        return f"vector ‘{(source or {}).get('name', '?')}’"
    if kind == "inline":
        return "inline vector"
    return "clean → noised" if noised else "clean → corrupt"


def figure_title(result: SweepResult, hook: str, *, zoom: bool = False) -> str:
    """"<hook> · <direction>", plus " · zoom" for a zoom sweep."""
    m = result.meta
    return f"{hook} · {direction_label(m.get('source'), bool(m.get('noise')))}" + (" · zoom" if zoom else "")


def result_metric_label(result: SweepResult) -> str:
    m = result.meta
    return metric_label(result.metric, m.get("recovered_basis"), m.get("answer_token"), m.get("foil_token"))


def subject_positions(result: SweepResult) -> set[int]:
    return set(result.meta.get("subject_positions") or [])


def layer_ticks(n_layers: int, max_ticks: int = 12) -> list[int]:
    """Row indices that get a layer label: every row, or every k-th (always the last one)."""
    step = max(1, math.ceil(n_layers / max_ticks))
    ticks = list(range(0, n_layers, step))
    if n_layers and ticks[-1] != n_layers - 1 and n_layers - 1 - ticks[-1] >= step / 2:
        ticks.append(n_layers - 1)
    return ticks


__all__ = [
    "CELL_LOOKS", "CellLook", "ColorScale", "DIVERGING", "DIVERGING_METRICS", "LAYER_AXIS_LABEL", "MARK_COLOR",
    "MAX_LABEL_CHARS", "METRIC_FORMULAS", "NO_VALUE_COLOR", "POSITION_AXIS_LABEL", "Palette", "RECOVERED_CLIP",
    "SEQUENTIAL", "SEQUENTIAL_METRICS", "STATUS_MEANINGS", "STATUS_NAMES", "SUBJECT_LEGEND", "SUBJECT_MARK",
    "baselines_of", "color_scale", "direction_label", "figure_title", "interpolate_palette", "layer_ticks",
    "legend_text", "metric_label", "nice_ceiling", "noise_threshold", "palette_for", "position_labels",
    "result_metric_label", "result_scale", "subject_positions", "token_label", "token_text", "value_range",
]
