"""Screen and paper agree: one saved sweep drawn by the dashboard (the Bokeh heatmap's data
source, what the browser receives) and by the export (the matplotlib figure a paper gets) uses the
same colour for every cell, the same status look and name, the same token/position/layer labels,
the same title, colour-bar label and legend texts (both come from `app.figures.presentation`).

The sweep is `tests/test_export.py`'s synthetic summary (two hooks, an unaligned position, a
voided cell, within-noise cells, subject tokens, a `$` token), saved to NPZ and loaded back, in
each metric's units."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest
from matplotlib.colors import to_hex
from matplotlib.collections import QuadMesh

from app.dashboard.tracing.heatmap import SweepHeatmap, legend_html
from app.figures import export
from app.figures.presentation import CELL_LOOKS, NO_VALUE_COLOR, SUBJECT_LEGEND
from app.sweep.fold import CellStatus
from app.sweep.result import SweepResult
from tests.conftest import REPO
from tests.test_export import HOOKS, synthetic_summary

#: the synthetic values are `recovered`-like (-0.3 .. 1.3): other metrics get them mapped into
#: their own units, with matching baselines (clean, corrupt)
METRICS = {
    "recovered": (lambda v: v, (None, None)),
    "logit_diff": (lambda v: 6.0 * v - 2.0, (4.0, -2.0)),
    "logprob": (lambda v: -6.0 + 5.5 * v, (-0.5, -6.0)),
    "prob": (lambda v: min(1.0, max(0.0, v)), (0.9, 0.01)),
}


def saved_sweep(metric: str, tmp_path) -> SweepResult:
    to_metric, (clean, corrupt) = METRICS[metric]
    s = synthetic_summary()
    s["hook_grids"] = [{**g, "grid": [[None if v is None else to_metric(v) for v in row] for row in g["grid"]]}
                       for g in s["hook_grids"]]
    s["grid"] = s["hook_grids"][0]["grid"]
    s["hook_grids"][0]["grid"][5][8] = to_metric(1.9)  # beyond recovered's clip: an end colour on both
    if metric != "recovered":
        s.update(metric=metric, metric_requested=metric, clean=clean, corrupt=corrupt, foil_token=" Rome", foil_token_id=400)
    return SweepResult.load(SweepResult.from_summary(s).save(tmp_path / f"{metric}.npz"))


def paper_cells(fig) -> tuple[np.ndarray, np.ndarray]:
    """(fill hex, hatch pattern) of every cell (layers x positions) as the matplotlib figure draws
    it: the mesh's colour, unless a patch over the cell fills it; the patch's hatch pattern."""
    ax = fig.axes[0]
    mesh = next(c for c in ax.collections if isinstance(c, QuadMesh))
    rgba = mesh.to_rgba(mesh.get_array())
    n_l, n_p = rgba.shape[:2]
    fill = np.array([[to_hex(rgba[i, j]) for j in range(n_p)] for i in range(n_l)], dtype=object)
    hatch = np.full((n_l, n_p), "", dtype=object)
    for p in ax.patches:
        j, y0, h = int(p.get_x()), int(p.get_y()), int(p.get_height())
        for i in range(y0, y0 + h):
            if p.get_fill() and p.get_facecolor()[3] > 0:
                fill[i, j] = to_hex(p.get_facecolor())
            if p.get_hatch():
                hatch[i, j] = p.get_hatch()[0]  # the pattern, repeated for density
    return fill, hatch


def screen_cells(hm: SweepHeatmap) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(fill, hatch pattern, status name) of every cell as the Bokeh data source holds them."""
    d = hm.source.data
    shape = (len(hm.layers), len(hm.positions))
    fill = np.array(d["fill"], dtype=object).reshape(shape)
    hatch = np.array([h.strip() for h in d["hatch"]], dtype=object).reshape(shape)
    status = np.array([s.split(" — ")[0] for s in d["status_text"]], dtype=object).reshape(shape)
    return fill, hatch, status


def unescape(text: str) -> str:
    return text.replace(r"\$", "$")


@pytest.mark.parametrize("metric", list(METRICS))
def test_screen_and_paper_draw_a_saved_sweep_alike(metric, tmp_path):
    result = saved_sweep(metric, tmp_path)
    for hook in HOOKS:
        hm = SweepHeatmap.from_result(result, hook)
        fig = export.plot_sweep(result, hook)
        ax = fig.axes[0]
        s_fill, s_hatch, s_status = screen_cells(hm)
        p_fill, p_hatch = paper_cells(fig)

        # colours: cell by cell, and the same range on both colour bars
        assert (s_fill == p_fill).all(), [(i, j, s_fill[i, j], p_fill[i, j]) for i, j in zip(*np.nonzero(s_fill != p_fill))]
        mesh = next(c for c in ax.collections if isinstance(c, QuadMesh))
        assert (hm.mapper.low, hm.mapper.high) == (mesh.norm.vmin, mesh.norm.vmax)
        assert hm.mapper.palette == [to_hex(c) for c in mesh.get_cmap()(np.arange(mesh.get_cmap().N))]
        # statuses: the CSV's names on both, drawn with the same looks
        assert (s_status == export.cell_statuses(result, hook)).all()
        assert (s_hatch == p_hatch).all()
        present = {st for st, look in CELL_LOOKS.items() if (s_status == look.name).any()}
        assert {CellStatus.DONE, CellStatus.SKIPPED, CellStatus.NOISE} <= present
        assert (CellStatus.VOIDED in present) == (hook == "post_attn")
        assert set(p_fill[s_status == "skipped"]) == {NO_VALUE_COLOR}

        # labels: tokens (with * on the subject), positions, layers, title, colour-bar label
        assert [unescape(t.get_text()) for t in ax.get_xticklabels()] == hm.labels
        assert [hm.token_axis.major_label_overrides[j] for j in range(len(hm.positions))] == hm.labels
        assert "␣Tarn*" in hm.labels and "␣$" in hm.labels
        top = next(a for a in ax.child_axes if a.get_xticklabels())
        assert [t.get_text() for t in top.get_xticklabels()] == [hm.position_axis.major_label_overrides[j]
                                                                 for j in range(len(hm.positions))]
        assert ({int(t.get_position()[1] - 0.5): t.get_text() for t in ax.get_yticklabels()}
                == hm.layer_axis.major_label_overrides)
        assert ax.get_ylabel() == hm.layer_axis.axis_label
        assert unescape(ax.get_title(loc="left")) == hm.figure.title.text
        assert unescape(mesh.colorbar.ax.get_ylabel()) == hm.color_bar.title

        # legend: every entry of the paper's legend is worded as on the screen's key
        key = re.sub(r"&nbsp;", " ", legend_html(result.meta.get("noise_floor")))
        for text in (t.get_text() for t in fig.legends[0].get_texts()):
            assert text in key, text
        assert SUBJECT_LEGEND in key


def test_the_presentation_is_plain_data():
    """No renderer (Bokeh, matplotlib, Panel) and no engine behind `app.figures.presentation`."""
    code = ("import sys, app.figures.presentation; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('matplotlib', 'bokeh', 'panel', 'vllm', 'torch')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
