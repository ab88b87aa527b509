"""`causalboard serve` with a fault-injection point, for tests/test_engine_failure.py and the
reliability docs:

    python tests/fault_serve.py TRIGGER_FILE serve [serve options...]

* vLLM's `LLMEngine.step` (the front end's step, on the engine loop thread) sleeps `STEP_DELAY_S`
  first, so a test's requests are reliably still in flight when it injects a fault;
* vLLM's `EngineCore.step` (the engine core's step: scheduling and the model's forward) raises
  `RuntimeError("injected fault inside EngineCore.step")` once TRIGGER_FILE exists. In-process
  (`--no-multiprocess`) that is an exception inside the serving process's step; with
  `--multiprocess` the engine core runs elsewhere (kill that process instead).

Everything else is the real CLI: `app.cli.main.main(["serve", ...])`, whose exit status this
process returns.
"""

from __future__ import annotations

import os
import sys
import time

STEP_DELAY_S = 0.03


def install(trigger: str) -> None:
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.engine.llm_engine import LLMEngine

    front_step, core_step = LLMEngine.step, EngineCore.step

    def slow_step(self):
        time.sleep(STEP_DELAY_S)
        return front_step(self)

    def faulty_step(self):
        if os.path.exists(trigger):
            raise RuntimeError("injected fault inside EngineCore.step")
        return core_step(self)

    LLMEngine.step = slow_step
    EngineCore.step = faulty_step


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    install(sys.argv[1])
    from app.cli.main import main

    sys.exit(main(sys.argv[2:]))
