"""`SweepState`: what the tracing view shows about one sweep — the sweep's event fold
(`app.sweep.fold.SweepFold`: grids, cell statuses, progress, noise floor, checksum, changed cells)
plus the text of the view's status line. Pure (no Panel, no Bokeh, no I/O)."""

from __future__ import annotations

from app.sweep.fold import SweepFold


class SweepState(SweepFold):
    """A `SweepFold` with the view's wording of its data."""

    def checksum_text(self) -> str:
        """'pending', 'consistent (N ranks)', 'mismatch (tp0/pp0 ≠ tp1/pp0)' or
        'unavailable (<error>)' — from the latest `checksum` event or the summary."""
        c = self.checksum
        if c is None:
            return "pending"
        if c.consistent is True:
            return f"consistent ({c.ranks} rank{'s' if c.ranks != 1 else ''})" if c.ranks is not None else "consistent"
        if c.consistent is False:
            names = [rank for ranks in (c.mismatches or {}).values() for rank in ranks]
            return f"mismatch ({' ≠ '.join(names)})" if names else "mismatch"
        return f"unavailable ({c.error})" if c.error else "unknown"


__all__ = ["SweepState"]
