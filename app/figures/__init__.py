"""Presentation of sweeps: colour scales, glyphs and labels; matplotlib figures and paper export."""
