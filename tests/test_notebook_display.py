"""How sweeps show in a notebook, without a browser: a `SweepResult` displays as its summary and
heatmaps (`app/figures/display.py`), and `patch_sweep(progress=True)` in a notebook kernel draws
one HTML bar updated in place (`app/client/progress.py`). The kernel side is real: a
`python3` kernel runs the cells through nbclient against the test server, and the display
messages it sends are what JupyterLab renders (tests/test_jupyterlab_browser.py sees them in a
browser)."""

from __future__ import annotations

import base64
import io
import re

import nbformat
import pytest
from nbclient import NotebookClient
from PIL import Image

from app.client.progress import progress_html
from app.figures.display import DISPLAY_DPI, cell_counts, sweep_html, sweep_mimebundle
from app.sweep.result import SweepResult
from tests.conftest import REPO
from tests.test_export import synthetic_summary


def _images(markup: str) -> list[Image.Image]:
    return [Image.open(io.BytesIO(base64.b64decode(b64))) for b64 in re.findall(r'src="data:image/png;base64,([^"]+)"', markup)]


def test_a_result_displays_its_heatmaps_and_summary_not_its_grids():
    result = SweepResult.from_summary(synthetic_summary())
    bundle = sweep_mimebundle(result)
    assert set(bundle) == {"text/plain", "text/html"}
    text, markup = bundle["text/plain"], bundle["text/html"]
    assert text.startswith("SweepResult(6 layers x 9 positions x hooks ['post_block', 'post_attn']") and "array(" not in text

    # one heatmap per hook, the paper figure at DISPLAY_DPI (one column = 3.5 in wide)
    images = _images(markup)
    assert len(images) == 2 and re.findall(r'data-hook="([^"]+)"', markup) == result.hooks
    for image in images:
        assert image.size[0] == round(3.5 * DISPLAY_DPI) and image.size[1] > 100
        assert len(set(image.convert("RGB").getdata())) > 20  # coloured cells, not a blank canvas
    # the counts are the result's: done + skipped + voided = every cell (nothing pending)
    counts = cell_counts(result)
    assert counts["done"] + counts["skipped"] + counts["voided"] == counts["total"] == 2 * 6 * 9
    assert f'data-done="{counts["done"]}" data-total="{counts["total"]}"' in markup
    assert 'data-cb="noise-floor">0.05<' in markup and "consistent" in markup
    assert "corrupt “The $5 capital of Tarn Vale is” ← clean “The $ capital of North Kell is”" in markup

    # IPython picks the bundle (text/html first), and Panel's HTML pane takes _repr_html_
    from IPython.core.formatters import DisplayFormatter

    shown, _ = DisplayFormatter().format(result)
    assert shown["text/html"] == markup == result._repr_html_() and shown["text/plain"] == text


def test_a_partial_result_shows_its_pending_cells():
    summary = synthetic_summary()
    grids = summary["hook_grids"]
    for g in grids:
        g["grid"] = [[None if i >= 3 else v for v in row] for i, row in enumerate(g["grid"])]
    result = SweepResult.from_summary({**summary, "hook_grids": grids, "cancelled": True, "within_noise": []})
    counts = cell_counts(result)
    assert counts["pending"] > 0 and counts["done"] + counts["pending"] + counts["skipped"] + counts["voided"] == counts["total"]
    markup = sweep_html(result)
    assert f'{counts["pending"]} pending' in markup and "<b>cancelled</b>" in markup
    assert ", cancelled," in sweep_mimebundle(result)["text/plain"]


def test_progress_html_reads_its_state():
    bar = progress_html(12, 40, "running", 1.5, 8.0, "sw-1")
    assert 'data-done="12" data-total="40" data-state="running"' in bar and '<progress value="12" max="40"' in bar
    assert "12/40 cells (30%) · 8.0 cells/s · 1.5 s · running · sw-1" in bar
    assert "0/0 cells (0%) · — cells/s · 0.0 s · starting" in progress_html(0, 0, "starting", 0.0, None)


@pytest.mark.timeout(600)
def test_in_a_kernel_a_sweep_shows_one_updating_bar_and_its_result_shows_heatmaps(server_url, tmp_path):
    """A real kernel: `patch_sweep(progress=True)` sends one HTML display and updates it in place
    (display_id) up to "finished" with every cell; the result, as the cell's value, is its heatmaps."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(
        "from app.client import CausalboardClient\n"
        f"client = CausalboardClient({server_url!r})\n"
        "result = client.patch_sweep(prompt='Garrow is ruled by', clean_prompt='Guzar is ruled by', answer_token=' Hadrian',\n"
        "                            metric='recovered', hooks=['post_block'], progress=True)\n"
        "result")]
    updates: list[dict] = []

    client = NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(REPO)}})
    # nbclient folds update_display_data into the output it updates; count the updates as they arrive
    original = client._update_display_id

    def spy(display_id, msg):
        if msg["header"]["msg_type"] == "update_display_data":
            updates.append(msg["content"])
        return original(display_id, msg)

    client._update_display_id = spy
    client.execute()
    outputs = nb.cells[0].outputs
    assert not [o for o in outputs if o.output_type == "error"], outputs
    bars = [o for o in outputs if o.output_type == "display_data" and "sweep-progress" in o.data.get("text/html", "")]
    assert len(bars) == 1, [o.output_type for o in outputs]  # one bar, updated in place
    final = bars[0].data["text/html"]
    total = int(re.search(r'data-total="(\d+)"', final).group(1))
    assert total > 0 and f'data-done="{total}"' in final and 'data-state="done"' in final
    assert updates and all("sweep-progress" in u["data"]["text/html"] for u in updates)

    shown = next(o for o in outputs if o.output_type == "execute_result")
    assert shown.data["text/plain"].startswith("SweepResult(") and len(_images(shown.data["text/html"])) == 1
    assert f'data-done="{total}" data-total="{total}"' in shown.data["text/html"]


# ---- a view's copy in the browser (app/dashboard/notebook.py), kernel side --------------------------
class RecordingComm:
    """A Jupyter comm as Panel's notebook push sees it: `_comm` is None until the browser opened
    it; what is sent is recorded (the JSON parts of each Bokeh message)."""

    def __init__(self, open_: bool):
        from pyviz_comms import Comm

        self.id = Comm().id
        self._comm = object() if open_ else None
        self.sent: list[str] = []

    def send(self, data=None, metadata=None, buffers=()):
        if data is not None:
            self.sent.append(data)


def _shown(layout, comm):
    """Render `layout` as a notebook output does: its root in a held document, registered with
    its comm (panel.io.notebook.render_mimebundle)."""
    from bokeh.document import Document
    from panel.io.model import add_to_doc

    doc = Document()
    root = layout.get_root(doc, comm)
    add_to_doc(root, doc, True)
    return doc, root


def test_direct_bokeh_changes_reach_an_open_output_at_once():
    import panel as pn
    from bokeh.models import ColumnDataSource
    from bokeh.plotting import figure

    from app.dashboard.notebook import BrowserSync

    source = ColumnDataSource({"x": [0, 1], "y": [0, 0], "value": [0.0, 0.0]})
    fig = figure(width=200, height=200)
    fig.rect(x="x", y="y", width=1, height=1, source=source)
    layout = pn.Column(pn.pane.Bokeh(fig))
    comm = RecordingComm(open_=True)
    _shown(layout, comm)
    sync = BrowserSync(layout)
    source.patch({"value": [(1, 0.75)]})  # as SweepHeatmap.update does
    assert not any("ColumnsPatched" in m for m in comm.sent)  # held in the document: a browser message would drop it
    sync.changed()
    assert any("ColumnsPatched" in m and "0.75" in m for m in comm.sent)
    assert not sync.stale and sync.resends == 0


def test_a_view_updated_before_its_output_opened_is_resent_once_it_is_open():
    import asyncio

    import panel as pn

    from app.dashboard import notebook

    status = pn.pane.HTML("starting")
    layout = pn.Column(status, pn.widgets.FloatSlider(value=0.5, start=0, end=1))
    comm = RecordingComm(open_=False)
    _shown(layout, comm)
    sync = notebook.BrowserSync(layout)

    async def scenario():
        status.object = "finished: 40/40 cells"  # Panel queues it (comm closed) and retries it on its own
        sync.changed()
        assert sync.stale
        await asyncio.sleep(3 * notebook.POLL_S)
        assert sync.resends == 0 and not comm.sent  # still closed: nothing sent, nothing re-sent
        comm._comm = object()  # the browser drew the output and opened the comm
        await asyncio.sleep(notebook.SETTLE_S + 3 * notebook.POLL_S)

    asyncio.run(scenario())
    assert sync.resends == 1 and not sync.stale
    # Panel's queued update landed first; then one patch with the kernel's current state of every
    # model: the status text, the slider's value
    patches = [m for m in comm.sent if '"kind":"ModelChanged"' in m]
    assert len(patches) == 2 and patches[0].count('"kind":"ModelChanged"') == 1
    resent = patches[1]
    assert resent.count('"kind":"ModelChanged"') > 5 and "finished: 40/40 cells" in resent
    assert re.search(r'"(attr":"value","new|value)":0\.5', resent)
