"""causalboard's vLLM extension: everything that touches vLLM lives in this package."""

from .bundled import BUNDLED_MODEL_NAME, BUNDLED_MODEL_PATH
from .engine import Engine, EngineConfig, EngineInfo
from .errors import EngineDeadError, SpecError
from .generation import Generation, GenerationDelta, GenerationParams

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
