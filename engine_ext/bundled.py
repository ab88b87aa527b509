"""Where the project's own trained tiny model lives (shipped in the repository, no download)."""

from __future__ import annotations

import json
from pathlib import Path

BUNDLED_MODEL_NAME = "causalboard-tiny"
BUNDLED_MODEL_PATH = Path(__file__).resolve().parent / "bundled" / BUNDLED_MODEL_NAME


def bundled_model_path() -> Path:
    """Path of the bundled model; raises FileNotFoundError with a hint if it is missing."""
    if not (BUNDLED_MODEL_PATH / "config.json").is_file():
        raise FileNotFoundError(
            f"the bundled model is missing at {BUNDLED_MODEL_PATH}; rebuild it with `make model`"
        )
    return BUNDLED_MODEL_PATH


def bundled_tasks() -> dict | None:
    """The bundled model's `tasks.json` (fact pairs, IOI prompts, steering contrasts: the
    defaults of the dashboard's forms and of the notebooks); None when it is not there."""
    try:
        return json.loads((BUNDLED_MODEL_PATH / "tasks.json").read_text())
    except (OSError, ValueError):
        return None
