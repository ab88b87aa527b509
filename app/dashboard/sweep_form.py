"""The causal-tracing form as plain data: defaults from a model's `tasks.json`, parsing of the
layer/position fields, and the `POST /v1/patch_sweep` body a form describes (pure; no Panel).

Field syntax (shown as placeholders in the form):

* layers: `all` (empty = all), `0-5` (inclusive), `0,2,4`, `0:6:2` (range start:stop:step,
  stop exclusive), or a comma-separated mix of numbers and `a-b` ranges.
* positions: `all` / `all_prompt` (empty = all), token indices and `a-b` ranges, and
  `span:<text>` (or `span:<text>#<occurrence>`) entries, separated by commas.

Bad syntax raises `FormError(field, message)`; the view shows it next to the form. Everything
else (unknown tokens, out-of-range layers, …) is left to the server, whose 400 names the field.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HOOKS = ("pre_attn", "post_attn", "post_block")
METRICS = ("recovered", "logit_diff", "logprob", "prob")
CORRUPT_PROMPT, NOISE_SPAN = "corrupt prompt", "noise on a span"

#: the bundled model's tasks (read as a file: the dashboard never imports engine_ext)
BUNDLED_TASKS = Path(__file__).resolve().parents[2] / "engine_ext" / "bundled" / "causalboard-tiny" / "tasks.json"


class FormError(ValueError):
    """A form field the dashboard cannot turn into a request."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


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
            raise FormError("answer", "give the answer token (sent verbatim: it must be exactly one token)")
        if not self.hooks:
            raise FormError("hooks", "select at least one hook")
        if self.metric not in METRICS:
            raise FormError("metric", f"one of {', '.join(METRICS)}")
        body: dict[str, Any] = {"hooks": list(self.hooks), "metric": self.metric, "alpha": float(self.alpha),
                                "answer_token": self.answer, "max_concurrency": int(self.max_concurrency)}
        if self.foil.strip():
            body["foil_token"] = self.foil
        elif self.metric == "logit_diff":
            raise FormError("foil", "logit_diff needs a foil token")
        if self.corruption == NOISE_SPAN:
            if not self.clean_prompt.strip():
                raise FormError("clean_prompt", "give the prompt to corrupt with noise")
            if not self.noise_span.strip():
                raise FormError("noise_span", "give the text (in the clean prompt) that gets noise")
            body["prompt"] = self.clean_prompt
            body["noise"] = {"span": self.noise_span, "scale": float(self.noise_scale),
                             "samples": int(self.noise_samples), "seed": int(self.noise_seed)}
        else:
            if not self.clean_prompt.strip():
                raise FormError("clean_prompt", "give the clean prompt")
            if not self.corrupt_prompt.strip():
                raise FormError("corrupt_prompt", "give the corrupt prompt")
            body["prompt"] = self.corrupt_prompt
            body["clean_prompt"] = self.clean_prompt
            if self.subject.strip():
                body["subject"] = {"span": self.subject, "occurrence": 0}
        layers = parse_layers(self.layers)
        if layers is not None:
            body["layers"] = layers
        body["positions"] = parse_positions(self.positions)
        return body


def parse_layers(text: str) -> list[int] | dict | None:
    """None (= all layers), a list of layer numbers, or `{"start","stop","step"}`."""
    t = text.strip().lower()
    if t in ("", "all"):
        return None
    m = re.fullmatch(r"(\d+)?:(\d+)(?::(\d+))?", t)
    if m:
        start, stop, step = int(m.group(1) or 0), int(m.group(2)), int(m.group(3) or 1)
        if step < 1 or stop <= start:
            raise FormError("layers", "start:stop:step needs stop > start and step ≥ 1")
        return {"start": start, "stop": stop, "step": step}
    out: list[int] = []
    for part in _parts(t, "layers"):
        out.extend(_int_or_range(part, "layers"))
    return sorted(dict.fromkeys(out))


def parse_positions(text: str) -> str | list:
    """`"all_prompt"` or a list of token indices and `{"span", "occurrence"}` objects."""
    t = text.strip()
    if t.lower() in ("", "all", "all_prompt"):
        return "all_prompt"
    out: list[int | dict] = []
    for part in _parts(t, "positions"):
        if part.lower().startswith("span:"):
            span = part[5:]
            occurrence = 0
            m = re.fullmatch(r"(.*)#(\d+)", span)
            if m:
                span, occurrence = m.group(1), int(m.group(2))
            if not span.strip():
                raise FormError("positions", "span: needs text, e.g. span:Garrow")
            out.append({"span": span, "occurrence": occurrence})
        else:
            out.extend(_int_or_range(part, "positions"))
    return out


def _parts(text: str, field_name: str) -> list[str]:
    parts = [p.strip() for p in text.split(",")]
    if any(not p for p in parts):
        raise FormError(field_name, "empty entry between commas")
    return parts


def _int_or_range(part: str, field_name: str) -> list[int]:
    m = re.fullmatch(r"(\d+)\s*-\s*(\d+)", part)
    if m:
        a, b = int(m.group(1)), int(m.group(2))
        if b < a:
            raise FormError(field_name, f"range {part!r} runs backwards")
        return list(range(a, b + 1))
    if re.fullmatch(r"\d+", part):
        return [int(part)]
    raise FormError(field_name, f"{part!r} is not a number, a range a-b" + (", or span:<text>" if field_name == "positions" else ""))


def zoom_request(base: dict, layers: list[int], positions: list[int], source_run: str) -> dict:
    """The request of a zoom sweep: `base` (the replaced sweep's request) restricted to the
    selected layers x positions and reusing its kept clean run (`source_run`); the clean prompt
    stays so positions are aligned the same way, and `keep_source` keeps a re-captured run."""
    out = {k: v for k, v in base.items() if k not in ("layers", "positions", "source_run")}
    out.update(layers=list(layers), positions=list(positions), source_run=source_run, keep_source=True)
    return out


def default_form(tasks_path: str | Path | None = None) -> SweepForm:
    """A form filled with the first fact pair of `tasks_path` (default: the bundled model's
    tasks.json) whose clean and corrupt prompts have equal length and that the model gets
    right; plain `SweepForm()` when the file is missing or has no pairs."""
    path = Path(tasks_path) if tasks_path is not None else BUNDLED_TASKS
    try:
        pairs = json.loads(path.read_text()).get("pairs") or []
    except (OSError, ValueError):
        return SweepForm()
    good = [p for p in pairs if p.get("equal_length") and p.get("hf_top1", True)] or pairs
    if not good:
        return SweepForm()
    p = good[0]
    return SweepForm(clean_prompt=p["clean_prompt"], corrupt_prompt=p["corrupt_prompt"], subject=p.get("subject_corrupt") or "",
                     noise_span=p.get("subject_clean") or "", answer=p["answer"], foil=p.get("foil") or "")


__all__ = ["CORRUPT_PROMPT", "FormError", "HOOKS", "METRICS", "NOISE_SPAN", "SweepForm",
           "default_form", "parse_layers", "parse_positions", "zoom_request"]
