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
    """A pyviz_comms JupyterComm as Panel's notebook push sees it: `_comm` is None until the
    browser opened it (`init()`), and `send` goes through `_comm`; what reaches the browser is
    recorded (the JSON parts of each Bokeh message)."""

    def __init__(self, open_: bool):
        from pyviz_comms import Comm

        self.id = Comm().id
        self.sent: list[str] = []
        self._comm = _Wire(self.sent) if open_ else None

    def init(self):
        self._comm = _Wire(self.sent)

    def send(self, data=None, metadata=None, buffers=()):
        self._comm.send(data, metadata=metadata, buffers=buffers)


class _Wire:
    def __init__(self, sent: list[str]):
        self.sent = sent

    def send(self, data=None, metadata=None, buffers=None):
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
    assert not sync.stale


def test_updates_before_the_browser_opened_the_output_reach_it_in_order_once_it_does():
    """Run All: the view changes before the browser opened the output's comm. Panel would retry
    each message on its own (arbitrary order once open); here they wait in order and go first."""
    import panel as pn
    from bokeh.models import ColumnDataSource
    from bokeh.plotting import figure

    from app.dashboard.notebook import BrowserSync, PendingSends

    status = pn.pane.HTML("starting")
    maps = pn.Column(pn.pane.HTML("no heatmap yet"))
    layout = pn.Column(status, maps)
    comm = RecordingComm(open_=False)
    _shown(layout, comm)
    sync = BrowserSync(layout)
    sync.attach()  # as the view's _repr_mimebundle_ does
    assert isinstance(comm._comm, PendingSends)

    source = ColumnDataSource({"x": [0, 1], "y": [0, 0], "value": [0.0, 0.0]})
    fig = figure(width=200, height=200, title="the heatmap")
    fig.rect(x="x", y="y", width=1, height=1, source=source)
    status.object = "running: 0/2 cells"
    maps.objects = [pn.pane.Bokeh(fig)]  # a new figure: its models are defined by this message
    source.patch({"value": [(0, 0.5)]})
    sync.changed()
    status.object = "finished: 2/2 cells"
    source.patch({"value": [(1, 0.75)]})
    sync.changed()
    assert comm.sent == [] and sync.stale  # nothing reaches a browser that has not opened the comm

    comm.init()  # the browser drew the output and opened the comm (pyviz: the client comm's on_open)
    assert not sync.stale and sync.links and next(iter(sync.links.values())).sent_on_open > 0
    patches = [m for m in comm.sent if '"events"' in m]

    def first(text: str) -> int:
        return next(i for i, m in enumerate(patches) if text in m)

    cell_patches = [i for i, m in enumerate(patches) if "ColumnsPatched" in m]
    # in the order the kernel made them: the figure is defined before its cells are patched
    assert first("running: 0/2") <= first("the heatmap") <= cell_patches[0] < first("finished: 2/2") < cell_patches[-1]
    assert "0.75" in patches[cell_patches[-1]] and len(cell_patches) == 2

    status.object = "a later update"  # once open: sent at once, after the queue
    assert any("a later update" in m for m in comm.sent[-3:])


class _ClientComm:
    """pyviz_comms' JupyterCommJS as OutputLink sees it, already open (messages are handed to
    `_handle_msg`, which calls `_on_msg` and then acknowledges)."""

    def __init__(self, on_msg):
        self._on_msg = on_msg
        self._comm = self
        self.handler = None
        self.id, self.manager = "client", None
        self.acks: list[tuple[str, int]] = []

    def on_msg(self, handler):  # the ipykernel comm's on_msg
        self.handler = handler

    def _handle_msg(self, msg):
        import threading

        self._on_msg(msg)
        self.acks.append(("Ready", threading.get_ident()))


def test_browser_messages_run_on_the_views_loop_and_reach_every_callback():
    """A slider move sends `value` and `value_throttled` (several steps batched): every change
    reaches the kernel (Panel's handler dropped all but the first callback's of a message), and a
    message received on another thread (a JupyterLab subshell) is handled on the view's loop."""
    import asyncio
    import functools
    import threading

    import panel as pn
    import param
    from bokeh.models import Slider
    from panel.models.comm_manager import CommManager

    from app.dashboard.notebook import OutputLink

    class Control(param.Parameterized):
        scale = param.Number(default=1.5)

    control = Control()
    slider = pn.widgets.FloatSlider.from_param(control.param.scale, start=-4, end=4, step=0.1)
    heard: list[tuple[float, int]] = []
    control.param.watch(lambda e: heard.append((e.new, threading.get_ident())), "scale")
    layout = pn.Column(slider)
    comm = RecordingComm(open_=True)
    _doc, root = _shown(layout, comm)
    ref = root.ref["id"]
    model = root.select_one({"type": Slider})
    client = _ClientComm(functools.partial(layout._on_msg, ref, CommManager(comm_id=comm.id, plot_id=ref)))

    def message(*steps):
        events = [{"kind": "ModelChanged", "model": {"id": model.id}, "attr": attr, "new": v}
                  for v in steps for attr in ("value", "value_throttled")]
        return {"content": {"data": {"header": {"msgid": "m", "msgtype": "PATCH-DOC"}, "metadata": {},
                                     "content": {"events": events}}}, "buffers": []}

    async def scenario():
        loop_thread = threading.get_ident()
        link = OutputLink(ref, None, client, asyncio.get_running_loop(), loop_thread)
        assert client.handler is not None
        for steps in ((1.4, 1.3), (1.2, 1.1, 1.0), (0.9, 0.8, 0.7, 0.6, 0.5)):  # from a subshell's thread
            worker = threading.Thread(target=client.handler, args=(message(*steps),))
            worker.start()
            worker.join()
        while len(client.acks) < 3:
            await asyncio.sleep(0.01)
        return link, loop_thread

    client._handle_msg = _decoding(client._handle_msg)
    _link, loop_thread = asyncio.run(scenario())
    assert control.scale == 0.5 and slider.value == 0.5 and slider.value_throttled == 0.5
    assert [v for v, _t in heard] == [1.3, 1.0, 0.5]
    assert {t for _v, t in heard} == {loop_thread} and {t for _a, t in client.acks} == {loop_thread}


def _decoding(handle):
    """pyviz_comms' JupyterCommJSBinary.decode in front of `handle` (the message as it arrives)."""
    def decoded(msg):
        return handle(dict(msg["content"]["data"], _buffers={}))

    return decoded
