"""Figures and data files of a patch sweep, for papers and for the dashboard's download buttons.

    fig = plot_sweep(result, "post_block")                 # one hook's heatmap (a Figure)
    manifest = export_sweep(result, "figs/", stem="varnia") # every file + varnia.manifest.json
    data = export_bytes(result, "svg", hook="post_attn")    # one download, in memory
    result = regenerate("figs/varnia.manifest.json", out_dir="figs2/")

Data first, figure second (as ROME did): `export_sweep` writes the numbers (`<stem>.csv`,
`<stem>.npz`) and a manifest with everything the sweep was run with (model, prompts, tokens,
sites, metric, alpha, answer/foil, noise, alignment, checksum, versions, the full summary) and
the sha256 of every written file; each figure is a pure function of that data, so
`regenerate` redraws it from the manifest alone — byte for byte (figure metadata carry no
creation date and SVG ids are seeded from the data).

Figures are vector (`pcolormesh`, vector colorbar, no rasterized artist) with embedded
TrueType fonts (PDF) and text kept as text (SVG); PNGs are 300 dpi. They are drawn on a plain
`matplotlib.figure.Figure` with the Agg canvas, never through pyplot, so no global backend or
rcParams change. Save a figure from `plot_sweep` with `save_figure` (not `fig.savefig`): the
font-embedding rcParams are read when saving.

What a figure shows (palette and range per metric, token labels, the look and legend text of
each cell status, titles) is `app.figures.presentation`, which the dashboard's heatmaps render
too: an exported figure has the colours, labels and marks the screen showed.

Cell statuses (CSV `status` column and figure marks) are `app.sweep.fold.result_statuses` of the
summary's fields, under their names in `presentation.STATUS_NAMES`:

* `ok` — a value; `within_noise` — a value listed in `within_noise` (its effect is within the
  noise floor; dotted);
* `skipped` — no value, its position is listed in `skipped` without a layer (an unaligned
  position, not run; grey, hatched);
* `voided` — no value, listed in `skipped` with a layer (the engine voided that cell; dark, crossed);
* `pending` — no value and no reason (a running or cancelled sweep; plain grey).
"""

from __future__ import annotations

import csv
import datetime as _dt
import hashlib
import io
import json
import math
import platform
import tempfile
import zipfile
from importlib import metadata as _metadata
from pathlib import Path
from typing import Any, Iterable

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle

from engine_ext.errors import SpecError

from app.figures.presentation import (CELL_LOOKS, LAYER_AXIS_LABEL, NO_VALUE_COLOR, STATUS_NAMES, SUBJECT_LEGEND,
                                     figure_title, layer_ticks, legend_text, noise_threshold, position_labels,
                                     result_metric_label, result_scale, subject_positions)
from app.figures.style import (PNG_DPI, colorbar_fraction, colormap, export_rc, figure_size, font_size, hatch, literal, norm,
                               position_font_size, width_inches)
from app.sweep.fold import CellStatus, result_statuses
from app.sweep.result import SweepResult

FIGURE_FORMATS = ("pdf", "svg", "png")
DATA_FORMATS = ("csv", "npz", "json")
DEFAULT_FORMATS = ("pdf", "svg", "png", "csv", "npz")
#: formats `export_bytes` serves ("zip" = every default format plus the manifest)
BYTES_FORMATS = FIGURE_FORMATS + DATA_FORMATS + ("zip",)
#: the cell status names (CSV `status` column, manifest `by_status`): `presentation.STATUS_NAMES`
STATUSES = tuple(STATUS_NAMES.values())
CSV_COLUMNS = ("hook", "layer", "position", "token", "value", "status")
MANIFEST_FORMAT = "causalboard.sweep-export/1"
MEDIA_TYPES = {"pdf": "application/pdf", "svg": "image/svg+xml", "png": "image/png", "csv": "text/csv",
               "npz": "application/octet-stream", "json": "application/json", "zip": "application/zip"}


# ---- cell statuses -------------------------------------------------------------------------------
def cell_statuses(result: SweepResult, hook: str | None = None) -> np.ndarray:
    """Status of every cell of `hook` (layers x positions array of str, values in `STATUSES`):
    `app.sweep.fold.result_statuses` under their names (`app.figures.presentation.STATUS_NAMES`)."""
    hook = _check_hook(result, hook)
    return np.vectorize(STATUS_NAMES.__getitem__, otypes=[object])(result_statuses(result, hook))


# ---- the figure ----------------------------------------------------------------------------------
def plot_sweep(result: SweepResult, hook: str | None = None, ax: Any = None, *, width: str | float = "single",
               cmap: Any = None, vmin: float | None = None, vmax: float | None = None, title: str | None = None,
               show_marks: bool = True) -> Figure:
    """Heatmap of one hook's grid (default: the first hook): rows = layers (layer 0 at the
    bottom), columns = swept positions labelled with their tokens (position numbers on the top
    axis), colorbar labelled with the metric (and its basis). Colours, labels, status marks and
    legend texts are `app.figures.presentation`'s, as on the dashboard. With `show_marks`:
    subject tokens bold with "*", every cell status drawn with its look (skipped hatched, voided
    dark with a cross, within-noise dotted; `presentation.CELL_LOOKS`) and a legend for the
    statuses present. `title=None` gives "<hook> · <direction>", "" none.

    Without `ax` the figure is `width` wide ("single" 3.5 in, "double" 7.0 in, or inches) and as
    tall as the grid needs; with `ax` it draws into that axes and returns its figure. Save with
    `save_figure` so fonts are embedded."""
    hook = _check_hook(result, hook)
    width_inches(width)
    status = result_statuses(result, hook)
    subject = subject_positions(result) if show_marks else set()
    labels = [literal(label) for label in position_labels(result.positions, result.token_strings, subject)]
    bold = {j for j, pos in enumerate(result.positions) if pos in subject}
    handles = _legend_handles(result, status, bool(bold), show_marks)
    title = literal(figure_title(result, hook)) if title is None else literal(title)
    with export_rc(width):
        own = ax is None
        if own:
            ncols = _legend_columns(width, len(handles))
            size = figure_size(width, len(result.layers), len(result.positions), max(map(len, labels), default=1),
                               bool(title), math.ceil(len(handles) / ncols) if handles else 0)
            fig = Figure(figsize=size, layout="constrained")
            FigureCanvasAgg(fig)
            fig.get_layout_engine().set(w_pad=0.02, h_pad=0.02, wspace=0.0, hspace=0.0)
            ax = fig.add_subplot()
        fig = ax.figure
        _draw_grid(ax, result, hook, cmap, vmin, vmax, width if own else None)
        _draw_axes(ax, result, labels, bold, width)
        if show_marks:
            _draw_marks(ax, status)
        if handles:
            ncols = _legend_columns(width, len(handles))
            if own:  # constrained layout makes room for it under the token labels
                fig.legend(handles=handles, loc="outside lower center", ncols=ncols, frameon=False)
            else:  # someone else's figure: stay inside the axes
                ax.legend(handles=handles, loc="upper right", ncols=1, framealpha=0.85)
        if title:
            ax.set_title(title, loc="left", pad=3.0)
    return fig


def save_figure(fig: Figure, target: str | Path | io.IOBase, fmt: str, *, metadata: dict | None = None,
                salt: str = "causalboard") -> None:
    """Save `fig` as `fmt` (pdf, svg, png) with the export rcParams: TrueType fonts embedded,
    SVG text kept as text, PNG at 300 dpi, no creation date (reproducible bytes; `salt` seeds
    SVG element ids). `metadata`: Title / Description (Subject in PDF) text."""
    if fmt not in FIGURE_FORMATS:
        raise SpecError("format", f"figure format must be one of {', '.join(FIGURE_FORMATS)}, got {fmt!r}")
    meta = dict(metadata or {})
    description = meta.pop("Description", None)
    if fmt == "pdf":
        md = {"Creator": "causalboard", "CreationDate": None, **meta}
        if description:
            md["Subject"] = description
    elif fmt == "svg":
        md = {"Creator": "causalboard", "Date": None, **meta}
        if description:
            md["Description"] = description
    else:
        md = {**meta, **({"Description": description} if description else {})}
    with export_rc(), matplotlib.rc_context({"svg.hashsalt": salt}):
        fig.savefig(target, format=fmt, dpi=PNG_DPI, metadata=md)


# ---- files ---------------------------------------------------------------------------------------
def export_sweep(result: SweepResult, out_dir: str | Path, stem: str = "sweep",
                 formats: Iterable[str] = DEFAULT_FORMATS, hooks: Iterable[str] | None = None,
                 width: str | float = "single") -> dict:
    """Write `<stem>_<hook>.<pdf|svg|png>` per hook, `<stem>.csv` (long format, one row per
    hook x layer x position), `<stem>.npz` (`SweepResult.save`), optionally `<stem>.json` (the
    summary), and `<stem>.manifest.json`; returns the manifest (see `build_manifest`)."""
    formats = _check_formats(formats, DEFAULT_FORMATS + ("json",))
    hooks = _check_hooks(result, hooks)
    stem = _check_stem(stem)
    width_inches(width)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[tuple[Path, str, str | None]] = []
    figure_formats = [f for f in formats if f in FIGURE_FORMATS]
    if figure_formats:
        for hook in hooks:
            written += _write_figures(result, hook, out, stem, figure_formats, width)
    if "csv" in formats:
        path = out / f"{stem}.csv"
        path.write_bytes(sweep_csv(result, hooks))
        written.append((path, "csv", None))
    for fmt in ("npz", "json"):
        if fmt in formats:
            written.append((result.save(out / f"{stem}.{fmt}"), fmt, None))
    params = {"stem": stem, "formats": list(formats), "hooks": hooks, "width": width, "png_dpi": PNG_DPI}
    manifest = build_manifest(result, params, {p.name: _file_entry(p, fmt, hook) for p, fmt, hook in written})
    (out / f"{stem}.manifest.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
    return manifest


def export_bytes(result: SweepResult, fmt: str, hook: str | None = None, width: str | float = "single") -> bytes:
    """One download: a figure of `hook` (pdf, svg, png; default the first hook), the CSV or NPZ
    of every hook, the summary JSON, or a zip of every default format plus the manifest. The
    bytes equal those `export_sweep` writes for the same result."""
    if fmt not in BYTES_FORMATS:
        raise SpecError("format", f"must be one of {', '.join(BYTES_FORMATS)}, got {fmt!r}")
    if fmt in FIGURE_FORMATS:
        hook = _check_hook(result, hook)
        fig = _export_figure(result, hook, width)
        buf = io.BytesIO()
        save_figure(fig, buf, fmt, metadata=_figure_metadata(result, hook), salt=_svg_salt(result, hook))
        return buf.getvalue()
    if fmt == "csv":
        return sweep_csv(result)
    with tempfile.TemporaryDirectory(prefix="causalboard-export-") as tmp:
        if fmt in ("npz", "json"):
            return result.save(Path(tmp) / f"sweep.{fmt}").read_bytes()
        export_sweep(result, tmp, stem="sweep", width=width)
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
            for path in sorted(Path(tmp).iterdir()):
                zf.write(path, path.name)
        return buf.getvalue()


def sweep_csv(result: SweepResult, hooks: Iterable[str] | None = None) -> bytes:
    """Long-format CSV (UTF-8): `hook, layer, position, token, value, status`, one row per
    hook x layer x position in axis order; `value` empty where there is none, full precision
    otherwise; `token` is the position's raw token string."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    tokens = result.token_strings
    for hook in _check_hooks(result, hooks):
        grid, status = result.grids[hook], cell_statuses(result, hook)
        for i, layer in enumerate(result.layers):
            for j, pos in enumerate(result.positions):
                v = grid[i, j]
                writer.writerow((hook, layer, pos, tokens[j], "" if math.isnan(v) else repr(float(v)), status[i, j]))
    return buf.getvalue().encode()


def build_manifest(result: SweepResult, params: dict, files: dict[str, dict]) -> dict:
    """The manifest: provenance of the sweep (model, prompts and tokens, sites, positions,
    metric, alpha, answer/foil, baselines, noise, alignment, skipped cells, checksum, versions),
    the export parameters, `files` (name -> sha256, bytes, format, hook) and the full summary
    (`summary`, from which `regenerate` rebuilds the result)."""
    m = result.meta
    summary = result.to_summary()
    manifest = {
        "format": MANIFEST_FORMAT,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "sweep_id": m.get("sweep_id"),
        "model": m.get("model"),
        "prompt": m.get("prompt"),
        "clean_prompt": m.get("clean_prompt"),
        "prompt_token_ids": m.get("prompt_token_ids"),
        "token_strings": m.get("token_strings"),
        "clean_token_ids": m.get("clean_token_ids"),
        "clean_token_strings": m.get("clean_token_strings"),
        "sites": {"layers": list(result.layers), "hooks": list(result.hooks),
                  "names": [f"L{layer}.{hook}" for hook in result.hooks for layer in result.layers]},
        "positions": list(result.positions),
        "position_tokens": result.token_strings,
        "subject_positions": m.get("subject_positions"),
        "metric": result.metric,
        "metric_requested": m.get("metric_requested", result.metric),
        "recovered_basis": m.get("recovered_basis"),
        "clean": m.get("clean"),
        "corrupt": m.get("corrupt"),
        "alpha": m.get("alpha"),
        "answer_token_id": m.get("answer_token_id"),
        "answer_token": m.get("answer_token"),
        "foil_token_id": m.get("foil_token_id"),
        "foil_token": m.get("foil_token"),
        "source": m.get("source"),
        "noise": m.get("noise"),
        "noise_floor": m.get("noise_floor"),
        "noise_floor_detail": m.get("noise_floor_detail"),
        "within_noise": m.get("within_noise"),
        "within_noise_threshold": m.get("within_noise_threshold"),
        "alignment": m.get("alignment"),
        "skipped": m.get("skipped", []),
        "checksum": m.get("checksum"),
        "cells": {"total": m.get("cells_total"), "done": m.get("cells_done"), "voided": m.get("cells_voided"),
                  "cancelled": m.get("cancelled"), "by_status": _status_counts(result)},
        "notes": m.get("notes", []),
        "versions": {"sweep": m.get("versions"), "export": _export_versions()},
        "export": params,
        "files": files,
        "summary": summary,
    }
    return _json_safe(manifest)


def regenerate(manifest_path: str | Path, out_dir: str | Path | None = None) -> SweepResult:
    """The `SweepResult` a manifest was written from (rebuilt from its `summary`). With
    `out_dir`, also redraw its figures there (same stem, hooks, formats and width; identical
    bytes for the same matplotlib version)."""
    path = Path(manifest_path)
    try:
        manifest = json.loads(path.read_text())
        summary = manifest["summary"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SpecError("manifest", f"{path} is not a causalboard export manifest ({exc})") from exc
    result = SweepResult.from_summary(summary)
    if out_dir is not None:
        params = manifest.get("export") or {}
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        formats = [f for f in params.get("formats", FIGURE_FORMATS) if f in FIGURE_FORMATS]
        for hook in _check_hooks(result, params.get("hooks")):
            _write_figures(result, hook, out, _check_stem(params.get("stem", "sweep")), formats,
                           params.get("width", "single"))
    return result


def check_files(manifest_path: str | Path) -> list[str]:
    """Names of the manifest's files that are missing next to it or whose sha256 differs
    (empty when every file is intact)."""
    path = Path(manifest_path)
    manifest = json.loads(path.read_text())
    bad = []
    for name, entry in (manifest.get("files") or {}).items():
        f = path.parent / name
        if not f.is_file() or _sha256(f) != entry.get("sha256"):
            bad.append(name)
    return bad


# ---- drawing helpers -----------------------------------------------------------------------------
def _draw_grid(ax: Any, result: SweepResult, hook: str, cmap: Any, vmin: float | None, vmax: float | None,
               own_width: str | float | None) -> Any:
    """The heatmap and its colorbar. In a figure of our own (`own_width` set) the colorbar is an
    inset exactly as tall as the grid; in someone else's axes it takes space from that axes."""
    grid = result.grids[hook]
    scale = result_scale(result, hook, vmin=vmin, vmax=vmax)
    n_layers, n_positions = grid.shape
    # edgecolors="face": no hairline gaps between quads in PDF viewers
    mesh = ax.pcolormesh(np.arange(n_positions + 1), np.arange(n_layers + 1), np.ma.masked_invalid(grid),
                         cmap=colormap(scale, cmap), norm=norm(scale), edgecolors="face", linewidth=0.0, rasterized=False)
    ax.set_xlim(0, n_positions)
    ax.set_ylim(0, n_layers)
    label = literal(result_metric_label(result))
    if own_width is not None:
        cax = ax.inset_axes([1.03, 0.0, colorbar_fraction(own_width), 1.0])
        cbar = ax.figure.colorbar(mesh, cax=cax, extend=scale.extend, label=label)
    else:
        cbar = ax.figure.colorbar(mesh, ax=ax, extend=scale.extend, label=label, fraction=0.05, pad=0.02)
    cbar.solids.set_rasterized(False)  # matplotlib rasterizes colorbars of >= 50 colours by default
    cbar.outline.set_linewidth(0.5)
    cbar.ax.tick_params(width=0.5, length=2.0)
    return mesh


def _draw_axes(ax: Any, result: SweepResult, labels: list[str], bold: set[int], width: str | float) -> None:
    n_layers, n_positions = len(result.layers), len(result.positions)
    size = position_font_size(width, n_positions)
    centres = np.arange(n_positions) + 0.5
    ax.set_xticks(centres, labels, rotation=45, ha="right", rotation_mode="anchor", fontsize=size)
    for j, text in enumerate(ax.get_xticklabels()):
        if j in bold:
            text.set_fontweight("bold")
    rows = layer_ticks(n_layers)
    base = font_size(width)  # explicit sizes: a caller's axes may predate our rcParams
    ax.set_yticks([i + 0.5 for i in rows], [str(result.layers[i]) for i in rows], fontsize=base - 1.0)
    ax.set_ylabel(LAYER_AXIS_LABEL, fontsize=base)
    top = ax.secondary_xaxis("top")
    top.set_xticks(centres, [str(p) for p in result.positions], fontsize=max(size - 1.0, 4.0))
    top.tick_params(length=1.5, pad=1.0, width=0.4)
    top.spines["top"].set_visible(False)
    ax.tick_params(axis="both", which="both", length=2.0)


def _draws_over_the_mesh(status: CellStatus) -> bool:
    """Whether cells of `status` need a patch over the heatmap: a hatch, or a fill other than
    the value's colour and the mesh's no-value colour."""
    look = CELL_LOOKS[status]
    return bool(look.hatch) or look.fill not in (None, NO_VALUE_COLOR)


def _draw_marks(ax: Any, status: np.ndarray) -> None:
    """Each cell status' look over the mesh: one patch per vertical run of cells with that status
    (an unaligned position is a whole column), filled with the look's fill (none: the value's
    colour shows) and hatched with its pattern."""
    n_layers, n_positions = status.shape
    for st, look in CELL_LOOKS.items():
        if not _draws_over_the_mesh(st):
            continue
        for j in range(n_positions):
            for start, stop in _runs([i for i in range(n_layers) if status[i, j] == st]):
                ax.add_patch(Rectangle((j, start), 1, stop - start, facecolor=look.fill or "none", edgecolor="none",
                                       hatch=hatch(look.hatch), hatchcolor=look.hatch_color, linewidth=0.0))


def _legend_handles(result: SweepResult, status: np.ndarray, has_subject: bool, show_marks: bool) -> list:
    """One legend entry per status present other than a plain value (presentation order and
    texts), after the subject's."""
    if not show_marks:
        return []
    handles: list = []
    if has_subject:
        handles.append(Line2D([], [], ls="none", marker=r"$\ast$", color="black", ms=4.0, label=SUBJECT_LEGEND))
    threshold = noise_threshold(result.meta)
    for st, look in CELL_LOOKS.items():
        if st is CellStatus.DONE or not np.any(status == st):
            continue
        handles.append(Patch(facecolor=look.fill or look.swatch, edgecolor="none", hatch=hatch(look.hatch),
                             hatchcolor=look.hatch_color, label=legend_text(st, threshold)))
    return handles


def _legend_columns(width: str | float, n: int) -> int:
    return max(1, min(n, 2 if width_inches(width) < 5.0 else 4))


def _runs(indices: list[int]) -> list[tuple[int, int]]:
    """Contiguous runs of sorted indices as half-open (start, stop) pairs."""
    runs: list[tuple[int, int]] = []
    for j in indices:
        if runs and runs[-1][1] == j:
            runs[-1] = (runs[-1][0], j + 1)
        else:
            runs.append((j, j + 1))
    return runs


# ---- file helpers --------------------------------------------------------------------------------
def _write_figures(result: SweepResult, hook: str, out: Path, stem: str, formats: list[str],
                   width: str | float) -> list[tuple[Path, str, str]]:
    fig = _export_figure(result, hook, width)
    written = []
    for fmt in formats:
        path = out / f"{stem}_{hook}.{fmt}"
        save_figure(fig, path, fmt, metadata=_figure_metadata(result, hook), salt=_svg_salt(result, hook))
        written.append((path, fmt, hook))
    return written


def _export_figure(result: SweepResult, hook: str, width: str | float) -> Figure:
    """`plot_sweep` with its layout fixed: constrained layout refines positions on every draw,
    so each save of a live figure would differ slightly; one layout pass, then frozen, makes
    every format and every regeneration draw the same geometry."""
    fig = plot_sweep(result, hook, width=width)
    with export_rc(width):
        fig.draw_without_rendering()
    fig.set_layout_engine("none")
    return fig


def _figure_metadata(result: SweepResult, hook: str) -> dict:
    m = result.meta
    parts = [f"model={m.get('model')}", f"sweep_id={m.get('sweep_id')}", f"hook={hook}",
             f"metric={result.metric}", f"prompt={m.get('prompt')!r}", f"clean_prompt={m.get('clean_prompt')!r}",
             f"answer={m.get('answer_token')!r}", f"alpha={m.get('alpha')}", f"noise_floor={m.get('noise_floor')}",
             f"checksum_consistent={(m.get('checksum') or {}).get('consistent')}"]
    return {"Title": f"causalboard patch sweep: {hook} ({result.metric})", "Description": "; ".join(parts)}


def _svg_salt(result: SweepResult, hook: str) -> str:
    """Seed for SVG element ids: the same data gives the same bytes, distinct figures distinct ids."""
    digest = hashlib.sha256(json.dumps(_json_safe(result.to_summary()), sort_keys=True).encode()).hexdigest()
    return f"{digest[:16]}-{hook}"


def _file_entry(path: Path, fmt: str, hook: str | None) -> dict:
    return {"sha256": _sha256(path), "bytes": path.stat().st_size, "format": fmt, "hook": hook}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _status_counts(result: SweepResult) -> dict:
    counts = {s: 0 for s in STATUSES}
    for hook in result.hooks:
        for s, n in zip(*np.unique(cell_statuses(result, hook).astype(str), return_counts=True)):
            counts[str(s)] += int(n)
    return counts


def _export_versions() -> dict:
    def version(dist: str) -> str | None:
        try:
            return _metadata.version(dist)
        except _metadata.PackageNotFoundError:
            return None

    return {"causalboard": version("causalboard"), "matplotlib": matplotlib.__version__,
            "numpy": np.__version__, "python": platform.python_version()}


def _json_safe(obj: Any) -> Any:
    """Plain JSON: numpy scalars/arrays to Python, non-finite floats to None, tuples to lists."""
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return _json_safe(obj.tolist())
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


# ---- argument checks -----------------------------------------------------------------------------
def _check_hook(result: SweepResult, hook: str | None) -> str:
    if hook is None:
        return result.hooks[0]
    if hook not in result.grids:
        raise SpecError("hook", f"{hook!r} is not a hook of this sweep ({', '.join(result.hooks)})")
    return hook


def _check_hooks(result: SweepResult, hooks: Iterable[str] | None) -> list[str]:
    if hooks is None:
        return list(result.hooks)
    hooks = [hooks] if isinstance(hooks, str) else list(hooks)
    for k, hook in enumerate(hooks):
        if hook not in result.grids:
            raise SpecError(f"hooks[{k}]", f"{hook!r} is not a hook of this sweep ({', '.join(result.hooks)})")
    if not hooks:
        raise SpecError("hooks", "must name at least one hook")
    return hooks


def _check_formats(formats: Iterable[str], allowed: tuple[str, ...]) -> list[str]:
    formats = [formats] if isinstance(formats, str) else list(formats)
    for k, fmt in enumerate(formats):
        if fmt not in allowed:
            raise SpecError(f"formats[{k}]", f"must be one of {', '.join(allowed)}, got {fmt!r}")
    if not formats:
        raise SpecError("formats", "must name at least one format")
    return list(dict.fromkeys(formats))


def _check_stem(stem: str) -> str:
    if not isinstance(stem, str) or not stem or stem in (".", "..") or any(c in stem for c in "/\\\0"):
        raise SpecError("stem", f"must be a plain file name stem, got {stem!r}")
    return stem
