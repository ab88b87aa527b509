"""The reference fork's wire formats, mapped onto causalboard's specs."""
