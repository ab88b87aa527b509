"""The reference fork's server-wide `logging` capture consumer (its
`vllm/v1/capture/consumers/logging.py`): configured when the server starts, it captures every
completion at its sites and positions and writes one log line per finalized capture key,
`capture key=(request_id, layer, hook) rows=N dtype=float32`.

Configured with `causalboard serve --capture-log JSON` (env `CAUSALBOARD_CAPTURE_LOG`, or
`create_app(capture_log=...)`), JSON being the fork consumer's params: `{"hooks": {hook: [layers] |
"all"}, "positions"?: "last_prompt" | "all_prompt" | "all_generated" | "all", "level"?: "INFO"}`.
It applies to `/v1/completions` and `/v1/chat/completions` (the fork's serving path). A completion
that carries its own capture (`capture` or `interventions.capture`: one capture per request here)
is not captured again: its line says `own capture, not logged`. The values captured for the log
never appear in the response.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any

from engine_ext import Generation
from engine_ext.errors import SpecError
from engine_ext.sites import NAMED_POSITIONS, Site
from engine_ext.specs import Capture, Interventions

from app.fork.vectors import check_hook

LOGGER = logging.getLogger("causalboard.capture.logging")


@dataclass(frozen=True)
class CaptureLog:
    """The consumer's params: hooks -> layers ("all": every layer), positions, level."""

    hooks: dict[str, Any]
    positions: str = "last_prompt"
    level: int = logging.INFO

    def sites(self, num_layers: int) -> list[Site]:
        out = []
        for hook, layers in self.hooks.items():
            for layer in (range(num_layers) if layers == "all" else layers):
                if layer >= num_layers:
                    raise SpecError(f"capture_log.hooks.{hook}",
                                    f"layer {layer} is out of range: the model has layers 0..{num_layers - 1}")
                out.append(Site(layer, hook))
        return out


def parse(value: str | dict | None) -> CaptureLog | None:
    """The `--capture-log` JSON (or its dict) -> `CaptureLog`; SpecError naming the field."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise SpecError("capture_log", f"must be a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise SpecError("capture_log", "must be a JSON object {hooks, positions?, level?}")
    extra = sorted(set(value) - {"hooks", "positions", "level"})
    if extra:
        raise SpecError(f"capture_log.{extra[0]}", "unknown field")
    hooks = value.get("hooks")
    if not isinstance(hooks, dict) or not hooks:
        raise SpecError("capture_log.hooks", "required: {hook: [layers] | 'all'}")
    for hook, layers in hooks.items():
        check_hook(hook, f"capture_log.hooks.{hook}")
        if layers != "all" and (not isinstance(layers, list) or not layers or not all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in layers)):
            raise SpecError(f"capture_log.hooks.{hook}", "must be 'all' or a non-empty list of layer indices")
    positions = value.get("positions", "last_prompt")
    if positions not in NAMED_POSITIONS:
        raise SpecError("capture_log.positions", f"must be one of {', '.join(NAMED_POSITIONS)}")
    level_name = value.get("level", "INFO")
    level = logging.getLevelName(str(level_name).upper())
    if not isinstance(level, int):
        raise SpecError("capture_log.level", f"unknown logging level {level_name!r}")
    return CaptureLog(dict(hooks), positions, level)


def setup(log: CaptureLog, num_layers: int) -> None:
    """Check the sites against the model (a bad layer fails the start-up) and make the lines
    visible in the server's output: the logger's level, and a stderr handler when nothing above
    it would print them."""
    log.sites(num_layers)
    LOGGER.setLevel(log.level)
    if not LOGGER.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        LOGGER.addHandler(handler)


def with_capture(spec: Interventions, log: CaptureLog | None, num_layers: int) -> tuple[Interventions, bool]:
    """`spec` with the consumer's capture added, and whether it was (not when the request has a
    capture of its own)."""
    if log is None or spec.capture is not None:
        return spec, False
    cap = Capture.make(log.sites(num_layers), log.positions, return_values=True, field_name="capture_log")
    return dataclasses.replace(spec, capture=cap), True


def write(gen: Generation, request_id: str, log: CaptureLog, added: bool, num_layers: int) -> None:
    """One line per capture key of `gen` (its sites in order), or one line saying why none."""
    if not added:
        LOGGER.log(log.level, "capture request=%s own capture, not logged", request_id)
        return
    iv = gen.intervention
    if iv is None or iv.voided:
        LOGGER.log(log.level, "capture request=%s failed: %s", request_id, "; ".join(iv.errors if iv else ["no result"]))
        return
    rows = Counter((k[0], k[1]) for k in iv.captures)  # (layer, hook) -> captured positions
    dtype = str(next(iter(iv.captures.values())).dtype) if iv.captures else "float32"
    for site in log.sites(num_layers):
        LOGGER.log(log.level, "capture key=%s rows=%d dtype=%s", (request_id, site.layer, site.hook),
                   rows[(site.layer, site.hook)], dtype)
