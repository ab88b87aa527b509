"""The causal-tracing form as plain data: defaults from a model's `tasks.json` and the
`POST /v1/patch_sweep` body a form describes (pure; no Panel).

The layer and position fields take the selector syntax of `engine_ext.sites` (`0-5`, `0:6:2`,
`3,4`, `span:Garrow#0`, ...), the same strings the CLI and the docs use.

Bad syntax raises `SpecError(field, message)`; the view shows it next to the form. Everything
else (unknown tokens, out-of-range layers, …) is left to the server, whose 400 names the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine_ext.bundled import BUNDLED_MODEL_PATH
from engine_ext.errors import SpecError
from engine_ext.sites import parse_layers, parse_positions

METRICS = ("recovered", "logit_diff", "logprob", "prob")
CORRUPT_PROMPT, NOISE_SPAN = "corrupt prompt", "noise on a span"

#: the bundled model's tasks
BUNDLED_TASKS = BUNDLED_MODEL_PATH / "tasks.json"


@dataclass
class SweepForm:
    """What the causal-tracing form holds (defaults: a fact pair of the bundled model)."""

    clean_prompt: str = "Guzar is ruled by"
    corrupt_prompt: str = "Garrow is ruled by"
    corruption: str = CORRUPT_PROMPT
    subject: str = "Garrow"  # subject span of the corrupt prompt, marked * in figures ("" = none)
    noise_span: str = "Guzar"
    noise_scale: float = 3.0
    noise_samples: int = 1
    noise_seed: int = 0
    answer: str = "Hadrian"
    foil: str = "Leopold"
    layers: str = "all"
    positions: str = "all"
    hooks: list[str] = field(default_factory=lambda: ["post_block"])
    metric: str = "recovered"
    alpha: float = 1.0
    max_concurrency: int = 64

    def to_request(self) -> dict:
        """The sweep request body (without `stream`/`keep_source`, which the view adds)."""
        if not self.answer.strip():
            raise SpecError("answer", "give the answer token (sent verbatim: it must be exactly one token)")
        if not self.hooks:
            raise SpecError("hooks", "select at least one hook")
        if self.metric not in METRICS:
            raise SpecError("metric", f"one of {', '.join(METRICS)}")
        body: dict[str, Any] = {"hooks": list(self.hooks), "metric": self.metric, "alpha": float(self.alpha),
                                "answer_token": self.answer, "max_concurrency": int(self.max_concurrency)}
        if self.foil.strip():
            body["foil_token"] = self.foil
        elif self.metric == "logit_diff":
            raise SpecError("foil", "logit_diff needs a foil token")
        if self.corruption == NOISE_SPAN:
            if not self.clean_prompt.strip():
                raise SpecError("clean_prompt", "give the prompt to corrupt with noise")
            if not self.noise_span.strip():
                raise SpecError("noise_span", "give the text (in the clean prompt) that gets noise")
            body["prompt"] = self.clean_prompt
            body["noise"] = {"span": self.noise_span, "scale": float(self.noise_scale),
                             "samples": int(self.noise_samples), "seed": int(self.noise_seed)}
        else:
            if not self.clean_prompt.strip():
                raise SpecError("clean_prompt", "give the clean prompt")
            if not self.corrupt_prompt.strip():
                raise SpecError("corrupt_prompt", "give the corrupt prompt")
            body["prompt"] = self.corrupt_prompt
            body["clean_prompt"] = self.clean_prompt
            if self.subject.strip():
                body["subject"] = {"span": self.subject, "occurrence": 0}
        layers = parse_layers(self.layers)
        if layers is not None:
            body["layers"] = layers
        body["positions"] = parse_positions(self.positions)
        return body


def zoom_request(base: dict, layers: list[int], positions: list[int], source_run: str) -> dict:
    """The request of a zoom sweep: `base` (the replaced sweep's request) restricted to the
    selected layers x positions and reusing its kept clean run (`source_run`); the clean prompt
    stays so positions are aligned the same way, and `keep_source` keeps a re-captured run."""
    out = {k: v for k, v in base.items() if k not in ("layers", "positions", "source_run")}
    out.update(layers=list(layers), positions=list(positions), source_run=source_run, keep_source=True)
    return out


def default_form(tasks_path: str | Path | dict | None = None) -> SweepForm:
    """A form filled with the first fact pair of `tasks_path` (a tasks.json file or its parsed
    content, as `GET /v1/model/tasks` serves it; default: the bundled model's tasks.json) whose clean and corrupt prompts have equal length and that the model gets
    right; plain `SweepForm()` when the file is missing or has no pairs."""
    if isinstance(tasks_path, dict):
        pairs = tasks_path.get("pairs") or []
    else:
        path = Path(tasks_path) if tasks_path is not None else BUNDLED_TASKS
        try:
            pairs = json.loads(path.read_text()).get("pairs") or []
        except (OSError, ValueError, AttributeError):
            return SweepForm()
    good = [p for p in pairs if p.get("equal_length") and p.get("hf_top1", True)] or pairs
    if not good:
        return SweepForm()
    p = good[0]
    return SweepForm(clean_prompt=p["clean_prompt"], corrupt_prompt=p["corrupt_prompt"], subject=p.get("subject_corrupt") or "",
                     noise_span=p.get("subject_clean") or "", answer=p["answer"], foil=p.get("foil") or "")


__all__ = ["CORRUPT_PROMPT", "METRICS", "NOISE_SPAN", "SweepForm", "default_form", "zoom_request"]
