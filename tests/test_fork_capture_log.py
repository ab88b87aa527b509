"""The reference fork's server-wide `logging` capture consumer (`create_app(capture_log=...)`,
`causalboard serve --capture-log`; tests/test_cli_serve.py reads it in the served process's log):
one line per capture key of every completion, with the rows the capture really returned; a
completion with its own capture is not captured again; the values stay out of the response; bad
params are refused naming the field."""

from __future__ import annotations

import logging

import httpx
import pytest

from app.api.compat import capture_log
from engine_ext.errors import SpecError
from tests.conftest import serve_in_thread

PROMPT = "Once upon a time"
PARAMS = {"hooks": {"post_block": [1, 3], "mlp_out": [0]}, "positions": "all_prompt", "level": "warning"}


@pytest.fixture(scope="module")
def logged_server(engine):
    from app.api.app import create_app

    with serve_in_thread(create_app(engine, capture_log=PARAMS)) as url:
        yield url


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == capture_log.LOGGER.name]


def test_every_completion_logs_one_line_per_capture_key(logged_server, engine, caplog):
    caplog.set_level(logging.WARNING, logger=capture_log.LOGGER.name)
    n = len(engine.tokenize(PROMPT))
    with httpx.Client(base_url=logged_server, timeout=120) as http:
        body = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).json()
        cid = body["id"]
        assert _lines(caplog) == [f"capture key=('{cid}', {layer}, '{hook}') rows={n} dtype=float32"
                                  for layer, hook in ((1, "post_block"), (3, "post_block"), (0, "mlp_out"))]
        # with native interventions the body's intervention carries none of the logged values
        steered = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "interventions": {
            "steer": [{"sites": "L1.post_block", "vector": [0.0] * engine.info.hidden_size}]}}).json()
        assert steered["intervention"]["captures"] == [] and steered["intervention"]["status"] == "ok"
        # its own capture: not captured again, said so
        caplog.clear()
        own = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "interventions": {
            "capture": {"sites": ["L2.post_attn"], "positions": "last_prompt"}}}).json()
        assert len(own["intervention"]["captures"]) == 1
        assert _lines(caplog) == [f"capture request={own['id']} own capture, not logged"]
        # streamed completions log too
        caplog.clear()
        with http.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "stream": True}) as s:
            assert s.status_code == 200 and "".join(s.iter_lines())
        assert len(_lines(caplog)) == 3 and all(f"rows={n} " in line for line in _lines(caplog))


@pytest.mark.parametrize("params, field", [
    ("not json", "capture_log"),
    ({"positions": "all"}, "capture_log.hooks"),
    ({"hooks": {"post_mlp": [1]}}, "capture_log.hooks.post_mlp"),
    ({"hooks": {"post_block": [-1]}}, "capture_log.hooks.post_block"),
    ({"hooks": {"post_block": "all"}, "positions": "first"}, "capture_log.positions"),
    ({"hooks": {"post_block": "all"}, "level": "LOUD"}, "capture_log.level"),
    ({"hooks": {"post_block": "all"}, "root": "/tmp"}, "capture_log.root"),
])
def test_bad_params_name_the_field(params, field):
    with pytest.raises(SpecError) as exc:
        capture_log.parse(params)
    assert exc.value.field == field


def test_a_layer_the_model_lacks_fails_the_start_up():
    log = capture_log.parse({"hooks": {"post_block": [99]}})
    with pytest.raises(SpecError) as exc:
        capture_log.setup(log, num_layers=6)
    assert exc.value.field == "capture_log.hooks.post_block"
