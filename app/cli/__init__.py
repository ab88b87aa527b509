"""The `causalboard` command line: `serve`, `generate`, `sweep`, `export`, `version` (`main.py`;
the sweep and export commands in `sweep.py`)."""
