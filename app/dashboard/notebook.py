"""The dashboard's views in notebook cells: keeping the browser's copy in step with the kernel.

A Panel object shown in a notebook cell is a Bokeh document in the kernel plus its copy in the
browser, kept in step over a Jupyter comm (Panel's `push`). Two ways the copy goes stale, both
seen in JupyterLab on a loaded machine (tests/test_jupyterlab_browser.py):

* **Updates before the browser has drawn the output.** Run All: the cell after the view starts a
  sweep while the browser is still rendering the view, so the comm is not open yet. Panel queues
  each such update and retries each one every 0.1 s on its own; once the comm opens they can
  arrive out of order: an old status text after a newer one (the status block stuck at
  "starting…"), cell patches before the figure they patch (a heatmap left grey).
* **Direct Bokeh changes.** A heatmap's `ColumnDataSource.patch` is held in the kernel's document
  until Panel's next push; a message from the browser that arrives first (a resize, a
  selection) makes Panel release the hold, and what was held is dropped.

`BrowserSync(layout)` answers both. The view calls `changed()` after each update:

* to each notebook output whose comm is open, what the document holds is pushed at once;
* an output whose comm is still closed is marked stale, and a task on the kernel's loop waits
  (at most `WAIT_S`) until that comm is open and `SETTLE_S` have passed for Panel's queued
  updates to land, then re-sends the kernel's state to it: the current value of every set property of every
  model of the output (a heatmap's whole `data`, the status text, a layout's `children`, ...),
  as one patch. The models themselves stay, so the widgets the user touches keep their
  identity (taking the children out and putting them back instead gave a slider whose later
  moves never reached the kernel).

A served page (`panel serve`, the /dashboard mount) has no comm: `changed()` does nothing there.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from bokeh.document.events import ModelChangedEvent
from panel.io.model import diff
from panel.io.notebook import push
from panel.io.state import state

#: after the last comm opened, how long Panel's queued updates get to land before the re-send
SETTLE_S = 0.5
#: how long a stale layout waits for its browser (a headless kernel never opens the comm)
WAIT_S = 600.0
#: how often the waiting task looks at the comms
POLL_S = 0.2


class BrowserSync:
    """Keeps the browser's copies of one displayed layout (a Panel ListLike: Row, Column) in
    step; each notebook output showing it is handled on its own."""

    def __init__(self, layout: Any):
        self.layout = layout
        self.resends = 0  #: how many outputs were re-sent
        self._stale: dict[str, float] = {}  # output (root ref) -> when it was first updated while closed
        self._task: asyncio.Task | None = None

    def outputs(self) -> list[tuple[str, Any, Any]]:
        """(root ref, document, comm) of each notebook output showing the layout."""
        out = []
        for ref in list(self.layout._models):
            view = state._views.get(ref)
            if view is not None and view[3] is not None:
                out.append((ref, view[2], view[3]))
        return out

    @property
    def stale(self) -> bool:
        """Some output was updated before its comm opened and is not re-sent yet."""
        return bool(self._stale)

    def changed(self) -> None:
        """Call after an update of the view (on the kernel's loop thread)."""
        now = time.monotonic()
        for ref, doc, comm in self.outputs():
            if _is_open(comm):
                push(doc, comm)  # what Bokeh models changed directly goes now, before a browser message can drop it
            else:
                self._stale.setdefault(ref, now)
        if self._stale and (self._task is None or self._task.done()):
            try:
                self._task = asyncio.get_running_loop().create_task(self._wait_and_resend())
            except RuntimeError:  # no loop: nothing will wait; the next update on a loop will
                pass

    async def _wait_and_resend(self) -> None:
        open_since: dict[str, float] = {}
        while self._stale:
            await asyncio.sleep(POLL_S)
            now = time.monotonic()
            for ref, since in list(self._stale.items()):
                view = state._views.get(ref)
                if view is None or now - since > WAIT_S:  # gone, or never drawn (a headless kernel)
                    del self._stale[ref]
                elif _is_open(view[3]):
                    if now - open_since.setdefault(ref, now) >= SETTLE_S:
                        del self._stale[ref]
                        self._resend(ref)
                else:
                    open_since.pop(ref, None)

    def resend(self) -> None:
        """Send the kernel's state to every open output again."""
        for ref, _doc, comm in self.outputs():
            if _is_open(comm):
                self._resend(ref)

    def _resend(self, ref: str) -> None:
        """Every set property of every model under the output's root, as one patch."""
        _viewable, root, doc, comm = state._views[ref]
        events = [ModelChangedEvent(doc, model, attr, value) for model in root.references()
                  for attr, value in model.properties_with_values(include_defaults=False).items()
                  if _resendable(model, attr)]
        msg = diff(doc, events=events)
        if msg is not None:
            push(doc, comm, msg=msg)
        self.resends += 1


def _is_open(comm: Any) -> bool:
    return getattr(comm, "_comm", None) is not None


def _resendable(model: Any, attr: str) -> bool:
    prop = model.lookup(attr).property
    return prop.serialized and not prop.readonly


__all__ = ["POLL_S", "SETTLE_S", "WAIT_S", "BrowserSync"]
