"""The progress bar of `patch_sweep(..., progress=True)` (both clients): where it is drawn.

* **In a notebook kernel** (IPython's `ZMQInteractiveShell`: JupyterLab, Notebook, VS Code,
  nbclient) it is ONE HTML output of the cell, updated in place through an IPython display
  handle: an HTML `<progress>` bar with cells done / total, cells per second, elapsed time and
  the sweep's state, then the final line (finished, cancelled, failed). It needs no widget
  extension, so the saved notebook shows the last state as it is (an ipywidgets bar is saved as
  a reference to a widget model that no longer exists).
* **Anywhere else** it is a tqdm bar on stderr (the CLI's `causalboard sweep`).

Updates are throttled to one per `MIN_UPDATE_S` (the last one always shows). Every value the
tests read carries a `data-cb` attribute (`sweep-progress` with `data-done`, `data-total` and
`data-state`).
"""

from __future__ import annotations

import html
import sys
import time
from typing import Any

from app.sweep.fold import SweepFold

#: the HTML bar is redrawn at most this often (seconds)
MIN_UPDATE_S = 0.25


def in_notebook_kernel() -> bool:
    """True inside a Jupyter kernel (where an HTML display can be updated in place)."""
    shell = sys.modules.get("IPython") and sys.modules["IPython"].get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def progress_html(done: int, total: int, state: str, elapsed_s: float, cells_per_s: float | None,
                  sweep_id: str | None = None) -> str:
    """The bar as HTML (pure)."""
    pct = 100.0 * done / total if total else (100.0 if state == "done" else 0.0)
    rate = f"{cells_per_s:.1f} cells/s" if cells_per_s else "— cells/s"
    words = {"starting": "starting (clean run and baselines)…", "running": "running", "done": "finished",
             "cancelled": "cancelled", "failed": "failed"}[state]
    ident = f" · {html.escape(sweep_id)}" if sweep_id else ""
    return (f'<div data-cb="sweep-progress" data-done="{done}" data-total="{total}" data-state="{state}" '
            f'style="display:flex;align-items:center;gap:8px;font-size:13px">'
            f'<span>sweep</span><progress value="{done}" max="{max(total, 1)}" style="width:260px"></progress>'
            f"<span>{done}/{total} cells ({pct:.0f}%) · {rate} · {elapsed_s:.1f} s · {words}{ident}</span></div>")


class SweepProgress:
    """Follows a sweep's `SweepFold`: `show(fold)` after each event, `close(fold)` at the end
    (off unless `enabled`)."""

    def __init__(self, enabled: bool, *, notebook: bool | None = None):
        self.enabled = enabled
        self.notebook = in_notebook_kernel() if notebook is None else notebook
        self.bar: Any = None  # the tqdm bar
        self.handle: Any = None  # the IPython display handle
        self._shown_at = 0.0

    def show(self, fold: SweepFold, *, final: bool = False) -> None:
        if not self.enabled:
            return
        if self.notebook:
            self._show_html(fold, final)
        elif fold.result is not None:  # nothing to count before the axes are known
            self._show_tqdm(fold)

    def close(self, fold: SweepFold | None = None) -> None:
        if not self.enabled:
            return
        if self.notebook and fold is not None:
            self._show_html(fold, True)
        if self.bar is not None:
            self.bar.close()

    # ---- a notebook cell
    def _show_html(self, fold: SweepFold, final: bool) -> None:
        now = time.monotonic()
        if not final and self.handle is not None and now - self._shown_at < MIN_UPDATE_S:
            return
        self._shown_at = now
        from IPython.display import HTML, display

        if fold.errors:
            state = "failed"
        elif fold.finished:
            state = "cancelled" if fold.cancelled else "done"
        elif final:
            state = "failed"  # the stream ended without a summary
        else:
            state = "starting" if fold.result is None else "running"
        body = HTML(progress_html(fold.cells_done, fold.cells_total, state, fold.elapsed_s, fold.cells_per_s,
                                  fold.sweep_id))
        if self.handle is None:
            self.handle = display(body, display_id=True)
        else:
            self.handle.update(body)

    # ---- a terminal
    def _show_tqdm(self, fold: SweepFold) -> None:
        total = fold.cells_total
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="cell", desc="sweep", file=sys.stderr, leave=True)
        if self.bar.total != total:
            self.bar.total = total
        if fold.cells_done > self.bar.n:
            self.bar.update(fold.cells_done - self.bar.n)


__all__ = ["MIN_UPDATE_S", "SweepProgress", "in_notebook_kernel", "progress_html"]
