"""The client side of the engine: the `Engine` facade (`facade.py`), its configuration
(`config.py`), per-request plumbing (`outputs.py`), the device defaults and process environment
(`runtime.py`), the thread that drives vLLM (`loop.py`) and the
sweep of stale CPU shared-memory segments left by ended ranks (`cpu_shm.py`)."""

from engine_ext.engine.config import EngineConfig, EngineInfo
from engine_ext.engine.facade import Engine

__all__ = ["Engine", "EngineConfig", "EngineInfo"]
