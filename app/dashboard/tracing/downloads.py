"""The tracing view's download buttons: which files they offer, their names and their bytes.

Names are those `app.figures.export.export_sweep` gives the same files (`<stem>_<hook>.pdf`,
`<stem>.csv`, `<stem>.manifest.json`, … with the stem `sweep-<sweep id>`), and the bytes are
`export_bytes`' (the manifest: `export_sweep`'s), so a downloaded file matches its entry in a
downloaded manifest, by name and sha256.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

#: download buttons: (label, format); "manifest" is the manifest `export_sweep` writes, the others
#: are `export_bytes` formats
EXPORTS = (("PDF", "pdf"), ("SVG", "svg"), ("PNG", "png"), ("CSV", "csv"), ("NPZ", "npz"),
           ("Manifest JSON", "manifest"), ("ZIP (all files)", "zip"))
FIGURE_FORMATS = ("pdf", "svg", "png")


def export_stem(sweep_id: str | None) -> str:
    """`sweep-<id>`, or `sweep` for a result without an id."""
    return f"sweep-{sweep_id}" if sweep_id else "sweep"


def export_filename(stem: str, fmt: str, hook: str | None) -> str:
    """The name `app.figures.export.export_sweep` gives the same file (`<stem>_<hook>.pdf`,
    `<stem>.csv`, `<stem>.manifest.json`, …)."""
    if fmt in FIGURE_FORMATS:
        return f"{stem}_{hook}.{fmt}" if hook else f"{stem}.{fmt}"
    return f"{stem}.manifest.json" if fmt == "manifest" else f"{stem}.{fmt}"


def export_payload(result: Any, fmt: str, hook: str | None, stem: str) -> bytes:
    """The bytes of one download (`app.figures.export` is imported here, lazily: it pulls in
    matplotlib)."""
    from app.figures import export

    if fmt != "manifest":
        return export.export_bytes(result, fmt, hook=hook)
    with tempfile.TemporaryDirectory(prefix="causalboard-dash-") as tmp:
        export.export_sweep(result, tmp, stem=stem)
        return (Path(tmp) / f"{stem}.manifest.json").read_bytes()


__all__ = ["EXPORTS", "FIGURE_FORMATS", "export_filename", "export_payload", "export_stem"]
