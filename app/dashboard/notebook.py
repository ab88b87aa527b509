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

`BrowserSync(layout, redraw)` answers both. The view calls `changed()` after each update:

* every comm of the layout's notebook outputs open: what the document holds is pushed at once;
* one still closed: the layout is marked stale, and a task on the kernel's loop waits (at most
  `WAIT_S`) until every comm is open and `SETTLE_S` have passed for Panel's queued updates to
  land, then re-sends the whole layout from the kernel's state: `redraw()` (the view rebuilds
  what it draws with Bokeh directly), then the layout's children are taken out and put back, so
  Panel sends them as new models with their current values.

A served page (`panel serve`, the /dashboard mount) has no comm: `changed()` does nothing there.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

from panel.io.notebook import push
from panel.io.state import state

#: after the last comm opened, how long Panel's queued updates get to land before the re-send
SETTLE_S = 0.5
#: how long a stale layout waits for its browser (a headless kernel never opens the comm)
WAIT_S = 600.0
#: how often the waiting task looks at the comms
POLL_S = 0.2


class BrowserSync:
    """Keeps the browser's copy of one displayed layout (a Panel ListLike: Row, Column) in step."""

    def __init__(self, layout: Any, redraw: Callable[[], None] | None = None):
        self.layout = layout
        self.redraw = redraw
        self.resends = 0  #: how many times the layout was re-sent
        self._stale_since: float | None = None
        self._task: asyncio.Task | None = None

    def outputs(self) -> list[tuple[Any, Any]]:
        """(document, comm) of each notebook output showing the layout."""
        out = []
        for ref in list(self.layout._models):
            view = state._views.get(ref)
            if view is not None and view[3] is not None:
                out.append((view[2], view[3]))
        return out

    @property
    def stale(self) -> bool:
        return self._stale_since is not None

    def changed(self) -> None:
        """Call after an update of the view (on the kernel's loop thread)."""
        outputs = self.outputs()
        if not outputs:
            return
        if all(_is_open(comm) for _doc, comm in outputs):
            for doc, comm in outputs:
                push(doc, comm)  # what Bokeh models changed directly goes now, before a browser message can drop it
            if not self.stale:
                return
        elif not self.stale:
            self._stale_since = time.monotonic()
        if self._task is None or self._task.done():
            try:
                self._task = asyncio.get_running_loop().create_task(self._wait_and_resend())
            except RuntimeError:  # no loop: nothing will wait; the next update on a loop will
                pass

    async def _wait_and_resend(self) -> None:
        open_since = None
        while self.stale and time.monotonic() - self._stale_since < WAIT_S:
            await asyncio.sleep(POLL_S)
            outputs = self.outputs()
            if outputs and all(_is_open(comm) for _doc, comm in outputs):
                open_since = open_since or time.monotonic()
                if time.monotonic() - open_since >= SETTLE_S:
                    self._stale_since = None
                    self.resend()
                    return
            else:
                open_since = None
        self._stale_since = None

    def resend(self) -> None:
        """Send the whole layout again, from the kernel's state."""
        if self.redraw is not None:
            self.redraw()
        children = list(self.layout.objects)
        self.layout.objects = []
        self.layout.objects = children
        self.resends += 1


def _is_open(comm: Any) -> bool:
    return getattr(comm, "_comm", None) is not None


__all__ = ["POLL_S", "SETTLE_S", "WAIT_S", "BrowserSync"]
