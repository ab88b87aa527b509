"""causalboard's vLLM extension: everything that touches vLLM lives in this package."""

from engine_ext.bundled import BUNDLED_MODEL_NAME, BUNDLED_MODEL_PATH
from engine_ext.engine import Engine, EngineConfig, EngineInfo
from engine_ext.errors import EngineDeadError, SpecError
from engine_ext.generation import Generation, GenerationDelta, GenerationParams

__all__ = [
    "BUNDLED_MODEL_NAME",
    "BUNDLED_MODEL_PATH",
    "Engine",
    "EngineConfig",
    "EngineDeadError",
    "EngineInfo",
    "Generation",
    "GenerationDelta",
    "GenerationParams",
    "SpecError",
]
