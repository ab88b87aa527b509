"""The dashboard's views in notebook cells: the output's comms, made safe for JupyterLab.

A Panel object shown in a notebook cell is a Bokeh document in the kernel plus its copy in the
browser, kept in step over two Jupyter comms per output (pyviz_comms, opened by the browser when
it draws the output): the *client* comm carries the browser's changes (a slider move, a click) to
the kernel, which acknowledges each message; the *server* comm carries the kernel's changes
(Panel's `push`) to the browser. Two defects of that path, both seen in JupyterLab 4.6 with
ipykernel 7 (tests/test_jupyterlab_browser.py), are fixed here for every output of a view:

* **Comm messages on another thread.** JupyterLab sends comm messages to kernel *subshells* by
  default (its `commsOverSubshells` setting, "perCommTarget"), and ipykernel 7 handles each
  subshell on a thread of its own with its own event loop. Panel then applies the browser's
  changes to the document, runs the view's watchers and starts its tasks on that thread, while
  the kernel's main thread updates the same document: a slider move started the steered stream
  on the subshell's loop, where it stalled part-way (the kernel heard the last step, the text at
  that scale never came), and the browser's messages released the document's held events under
  the main thread's feet. Here the comm's open and every message from the browser are handed to
  the loop of the thread that displayed the view (the kernel's main loop), in arrival order; the
  acknowledgement goes back once the message is handled there, as before.
* **Updates before the browser has opened the comm.** With Run All the next cells change the
  view before the browser has drawn its output. Panel's `push` turns each update into a message
  at once and, the comm being closed, retries each message on its own every 0.1 s; once the comm
  opens they go out in an arbitrary order: a patch that references a new model (a heatmap's
  figure) can arrive before the one that defines it (the browser rejects it,
  "DeserializationError: reference ... isn't known"), an old status text after a newer one.
  Here the server comm stands in with a queue (`PendingSends`) from the moment the output is
  displayed: Panel's pushes land in it in order, and when the browser opens the comm, the queue
  is sent, in order, before anything newer. The browser then holds exactly what a browser that
  was connected all along would hold.
* **A browser message that changes several properties.** Panel's handler of the browser's
  messages (`MimeRenderMixin._on_msg`) applies the patch while the document is held, then
  releases the hold so that each change reaches its Python callbacks; but the first callback
  that updates the view holds the document again (Panel's `hold`), and every later change of the
  same message is held as if the kernel had made it: pushed back to the browser, never handled.
  A slider's move sends `value` and `value_throttled` together (with a few steps batched while
  the kernel acknowledged the previous message), so the kernel kept whichever came first: the
  slider's `value` stopped at +0.70 or +0.80 while the browser showed +0.50. Here the patch is
  applied the same way, and then every change of it is handed to its callbacks, the document
  staying held, so that what the callbacks change is collected and pushed
  (`OutputLink._apply_browser_patch`); what the kernel had changed and not sent yet is pushed
  first, so that it is never taken for the browser's (Panel's handler ran its callbacks too).

`BrowserSync(layout)` does all three for every notebook output showing `layout` (a Panel object):
`attach()` takes over the output's comms and must run before the output reaches the browser, so
the views call it from their `_repr_mimebundle_` (`NotebookOutputs`, a mixin for a
`pn.viewable.Viewer`); `changed()`, called after each update, pushes what the document holds
(direct Bokeh changes, such as a heatmap's `ColumnDataSource.patch`, wait in the document until
Panel's next push). A served page (`panel serve`, the /dashboard mount) has no comm: neither does
anything there.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from typing import Any, Callable

from bokeh.core.serialization import DeserializationError
from bokeh.document.callbacks import invoke_with_curdoc
from panel.io.model import patch_cds_msg
from panel.io.notebook import push
from panel.io.state import state

logger = logging.getLogger("causalboard.dashboard")


class PendingSends:
    """Stands in for a server comm's Jupyter comm until the browser opens it: what Panel sends
    is kept, in order, and sent when it opens."""

    def __init__(self) -> None:
        self.sends: list[tuple[Any, Any, Any]] = []

    def send(self, data: Any = None, metadata: Any = None, buffers: Any = None) -> None:
        self.sends.append((data, metadata, buffers))


class OutputLink:
    """One notebook output's comms, taken over (see the module docstring). `loop` is the loop of
    the thread that displayed the output (None: handle everything where it arrives)."""

    def __init__(self, ref: str, comm: Any, client: Any, loop: asyncio.AbstractEventLoop | None, thread: int):
        self.ref, self.comm, self.client, self.loop, self.thread = ref, comm, client, loop, thread
        self.sent_on_open = 0  #: messages queued before the browser opened the comm, then sent
        self.manager: Any = None  # Panel's CommManager model of the output (assembles the browser's messages)
        if comm is not None and comm._comm is None:
            comm._comm = PendingSends()
            comm.init = self._open_server  # (an instance attribute: pyviz's JupyterComm.init is wrapped)
        if client is not None:
            handler = getattr(client, "_on_msg", None)  # Panel's: partial(viewable._on_msg, ref, manager)
            if (isinstance(handler, functools.partial) and getattr(handler.func, "__name__", "") == "_on_msg"
                    and len(handler.args) == 2 and handler.args[0] == ref):
                self.manager = handler.args[1]
                client._on_msg = self._apply_browser_patch
            if client._comm is None:
                client.manager.register_target(client.id, self._client_opened)
            else:  # displayed elsewhere and opened already: later messages at least
                client._comm.on_msg(self._client_message)

    @property
    def pending(self) -> int:
        """Messages waiting for the browser to open the output's comm."""
        held = getattr(self.comm, "_comm", None)
        return len(held.sends) if isinstance(held, PendingSends) else 0

    # ---- browser -> kernel (the client comm)
    def _client_opened(self, comm: Any, msg: dict) -> None:
        """The browser opened the client comm (on whichever thread the kernel handles it). What
        pyviz_comms' JupyterCommJS._handle_open does, with the message handler and the open
        callback (Panel's: open the server comm) run on the view's loop."""
        self.client._comm = comm
        comm.on_msg(self._client_message)  # at once, so that no message arrives without a handler
        if self.client._on_open:
            self._run(self.client._on_open, msg)

    def _client_message(self, msg: dict) -> None:
        self._run(self.client._handle_msg, msg)  # decodes, applies the patch, acknowledges

    def _apply_browser_patch(self, msg: dict) -> None:
        """Apply one message of the browser (a Bokeh PATCH-DOC) to the output's document and hand
        each of its changes to its Python callbacks (see the module docstring)."""
        view = state._views.get(self.ref)
        if view is None:  # the output is gone
            return
        _viewable, root, doc, comm = view
        patch_cds_msg(root, msg)
        patch = self.manager.assemble(msg)
        push(doc, comm)  # the kernel's own changes not sent yet go first, as the kernel's
        if doc.callbacks.hold_value is None:
            doc.hold("combine")
        setter = comm.id if comm else None
        try:
            patch.apply_to_document(doc, setter)  # held: collected (and combined), callbacks not run yet
        except DeserializationError:
            logger.warning("a notebook output received a message that could not be deserialized")
        held = doc.callbacks._held_events
        browser = [e for e in held if getattr(e, "setter", None) == setter]
        doc.callbacks._held_events = [e for e in held if all(e is not b for b in browser)]
        try:
            for event in browser:  # the document stays held: what the callbacks change is collected and pushed
                if event.callback_invoker is not None:
                    invoke_with_curdoc(doc, event.callback_invoker)
        finally:
            push(doc, comm)

    def _run(self, fn: Callable[..., Any], *args: Any) -> None:
        """Call `fn(*args)` on the view's thread: now when already there, else next on its loop
        (FIFO, so the browser's messages keep their order)."""
        if self.loop is None or threading.get_ident() == self.thread or self.loop.is_closed():
            fn(*args)
        else:
            self.loop.call_soon_threadsafe(fn, *args)

    # ---- kernel -> browser (the server comm)
    def _open_server(self) -> None:
        """Open the server comm (pyviz's `init`), then send what was queued, in order."""
        held = self.comm._comm
        self.comm._comm = None
        del self.comm.init  # the class's init again
        self.comm.init()
        if isinstance(held, PendingSends):
            for data, metadata, buffers in held.sends:
                self.comm._comm.send(data, metadata=metadata, buffers=buffers)
            self.sent_on_open = len(held.sends)


class BrowserSync:
    """Keeps the browser's copies of one displayed layout (a Panel object) in step; each
    notebook output showing it is handled on its own."""

    def __init__(self, layout: Any):
        self.layout = layout
        self.links: dict[str, OutputLink] = {}  #: root ref of each output -> its comms

    def outputs(self) -> list[tuple[str, Any, Any]]:
        """(root ref, document, comm) of each notebook output showing the layout."""
        out = []
        for ref in list(self.layout._models):
            view = state._views.get(ref)
            if view is not None and view[3] is not None:
                out.append((ref, view[2], view[3]))
        return out

    def attach(self) -> None:
        """Take over the comms of the outputs not taken over yet. Call it as soon as the layout
        was rendered into an output (before the browser can open its comms): on the thread whose
        loop the view uses."""
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        for ref, _doc, comm in self.outputs():
            if ref in self.links:
                continue
            viewable = state._views[ref][0]
            client = getattr(viewable, "_comms", {}).get(ref, (None, None))[1]
            if not (hasattr(comm, "_comm") and hasattr(comm, "init")):
                comm = None  # not a pyviz comm (e.g. the ipywidgets route): leave it to Panel
            if client is not None and not (hasattr(client, "_handle_msg") and hasattr(client, "manager")):
                client = None
            self.links[ref] = OutputLink(ref, comm, client, loop, threading.get_ident())

    @property
    def stale(self) -> bool:
        """Some output has updates waiting for its browser to open the comm."""
        return any(link.pending for link in self.links.values())

    def changed(self) -> None:
        """Call after an update of the view (on the view's thread): pushes what the document
        holds to each output, or to its queue while the browser has not opened it."""
        self.attach()
        for _ref, doc, comm in self.outputs():
            push(doc, comm)


class NotebookOutputs:
    """Mixin for a `pn.viewable.Viewer` shown in notebook cells: each output of it is taken over
    by a `BrowserSync` (the view's `browser` when it shows `browser.layout`) as it is rendered."""

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> Any:
        view = self._create_view()
        bundle = view._repr_mimebundle_(include, exclude)
        sync = getattr(self, "browser", None)
        if not isinstance(sync, BrowserSync) or sync.layout is not view:
            sync = BrowserSync(view)
        sync.attach()
        return bundle


__all__ = ["BrowserSync", "NotebookOutputs", "OutputLink", "PendingSends"]
