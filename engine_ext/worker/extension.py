"""`CausalboardWorkerExtension`: the RPC methods causalboard adds to vLLM's worker.

vLLM resolves `worker_extension_cls="engine_ext.worker.extension.CausalboardWorkerExtension"`
inside every worker process (`WorkerWrapperBase.init_worker`) *before* the model is built:
importing this module installs the seam's patches there (`seam.install()`). Arguments and results
are plain msgpack-able data (bytes, lists, dicts), as `collective_rpc` requires across processes.
"""

from __future__ import annotations

from typing import Any

from engine_ext.collect_reply import share_layouts
from engine_ext.switches import env_switch
from engine_ext.worker.seam import close_state, install, runner_state

install()


class CausalboardWorkerExtension:
    """Mixed into vLLM's worker class via `worker_extension_cls`. Arguments and results are plain
    msgpack-able data (bytes, lists, dicts), as `collective_rpc` requires across processes."""

    def _cb(self):
        st = runner_state(self.model_runner)
        if st is None:
            raise RuntimeError("this engine was not started with causalboard's additional_config")
        return st

    def cb_model_info(self) -> dict:
        """This worker's part of the model: its ranks, the decoder layers its stage computes and
        how many of them carry the seam's sites, the embedding's std (None on a pipeline stage
        without the embedding)."""
        import torch
        from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        st = self._cb()
        model = self.model_runner.model
        inner = getattr(model, "model", None)
        weight = getattr(getattr(inner, "embed_tokens", None), "weight", None)
        std = float(weight.float().std().item()) if isinstance(weight, torch.Tensor) and weight.numel() else None
        st.embedding_std = std
        patched = sum(1 for m in model.modules() if getattr(m, "_cb_state", 0) == st.state_id)
        pp = get_pp_group()
        st.tp_rank, st.pp_rank = int(get_tensor_model_parallel_rank()), int(pp.rank_in_group)
        runner = type(self.model_runner).__module__ + "." + type(self.model_runner).__qualname__
        segmented = segments_offered(self.model_runner)
        return {"segments": bool(segmented), "block_size": int(self.model_runner.cache_config.block_size), "num_layers": st.num_layers, "hidden_size": st.hidden, "embedding_std": std,
                "patched_layers": patched, "runner": runner, "dtype": str(st.dtype).replace("torch.", ""),
                "device": str(st.device), "buffer_bytes": int(st.buffers.nbytes()), "torch": str(torch.__version__),
                "tp_rank": st.tp_rank, "pp_rank": st.pp_rank, "tp_size": int(get_tensor_model_parallel_world_size()),
                "pp_size": int(pp.world_size), "cpu_gemm": dict(st.cpu_gemm), "first_layer": int(getattr(inner, "start_layer", 0)),
                "end_layer": int(getattr(inner, "end_layer", st.num_layers))}

    def cb_debug_fault(self, kind: str, tp_rank: int, pp_rank: int = 0) -> bool:
        """Test-only fault injection on one worker (the one at `tp_rank`/`pp_rank`):
        `skip_action` makes it skip applying (and folding) the next planned request window, as a
        faulty rank would. Returns whether this worker took the fault."""
        st = self._cb()
        if (st.tp_rank, st.pp_rank) != (int(tp_rank), int(pp_rank)):
            return False
        if kind != "skip_action":
            raise ValueError(f"unknown fault {kind!r}")
        st.planner.skip_next_action = True
        return True

    def cb_set_defer_plan(self, on: bool) -> bool:
        """Benchmarking aid: whether a V2 step with dynamic steering is finished right before the
        forward (`seam._v2_defers`; the default) or at `prepare_inputs`. Returns whether steps are
        deferred now: the setting, and a runner whose hook defers (vLLM's V2 runner with the
        checked `execute_model`, `CAUSALBOARD_DEFER_PLAN` not 0); False on every other runner."""
        st = self._cb()
        st.defer_plan = bool(on)
        return st.defer_plan and bool(getattr(type(self.model_runner), "_cb_defers", False))

    def cb_set_dyn_replay(self, on: bool) -> bool:
        """Benchmarking aid: whether steady decode steps with dynamic steering repeat the last
        step's plan (`engine_ext.dynamic.replay.Replay`; the default) or are planned request by
        request (the same plans, decisions and checksum). Returns the new setting."""
        st = self._cb()
        st.dynamic.replay_enabled = bool(on)
        return st.dynamic.replay_enabled

    def cb_set_dyn_device(self, on: bool | str) -> bool | str:
        """Whether repeated steady steps' decisions are taken on the device
        (`engine_ext.dynamic.device_decisions`): True, False or "auto" (the default,
        `CAUSALBOARD_DYN_DEVICE`: on a GPU, for chains with a proportional policy). Returns the
        new setting."""
        from engine_ext.dynamic.repeat_steps import device_setting

        st = self._cb()
        st.dynamic.device_decisions = device_setting(on)
        return st.dynamic.device_decisions

    def cb_set_dyn_graphs(self, on: bool) -> bool:
        """Benchmarking aid: whether a repeating layout of dynamic steering's probe scores is
        replayed as a CUDA graph (`engine_ext.dynamic.step_graphs`; the default,
        `CAUSALBOARD_DYN_GRAPHS`) or scored eagerly (the same values). Returns the new setting."""
        st = self._cb()
        st.dynamic.step_graphs_on = bool(on)
        return st.dynamic.step_graphs_on

    def cb_set_upload_skip(self, on: bool) -> bool:
        """Benchmarking and checking aid: whether a step whose row or capture table the device
        already holds skips its upload (`StepPlanner._upload`; the default,
        `CAUSALBOARD_SKIP_SAME_UPLOAD`) or sends it anyway (the same tables). Returns the setting."""
        st = self._cb()
        st.planner.skip_same_upload = bool(on)
        return st.planner.skip_same_upload

    def cb_close(self) -> bool:
        """Free this engine's worker state and device buffers (called before shutdown)."""
        st = runner_state(self.model_runner)
        if st is None:
            return False
        close_state(st)
        self.model_runner._cb_state_obj = None
        return True

    def cb_freeze_heap(self) -> int:
        """Freeze this worker process's startup heap (`runtime.freeze_startup_heap`; the engine's
        start calls it last, where the worker runs in a process of its own); the number of objects
        frozen in this process now (0: the switch is off)."""
        import gc

        from engine_ext.engine.runtime import freeze_startup_heap

        return gc.get_freeze_count() if freeze_startup_heap() else 0

    def cb_collect(self, keys: list, ring_acks: dict | None = None) -> dict:
        return share_layouts(self._cb().collect(list(keys), ring_acks))

    def cb_capture_ring(self, size: int) -> str | None:
        """Hand captured values to the client through a shared-memory ring of `size` bytes (0:
        none, -1: sized from the capture buffer); the ring's name, or None (`WorkerState.enable_ring`)."""
        return self._cb().enable_ring(int(size))

    def cb_status(self) -> dict:
        return self._cb().status()

    def cb_set_global_steer(self, entries: list, clamps: list | None = None) -> int:
        return self._cb().set_global_steer(list(entries), None if clamps is None else list(clamps))

    def cb_register_vector(self, name: str, data: bytes) -> int:
        import numpy as np

        st = self._cb()
        vec = np.frombuffer(data, dtype="<f4").copy()
        st.named[name] = vec
        return int(vec.shape[0])

    def cb_delete_vector(self, name: str) -> bool:
        return self._cb().named.pop(name, None) is not None

    def cb_store(self, action: str, run_id: str = "") -> Any:
        st = self._cb()
        if action == "usage":
            return st.store.usage()
        if action == "drop":
            return st.store.drop(run_id)
        if action == "lease":
            return st.store.lease(run_id)
        if action == "release":
            st.store.release(run_id)
            return True
        if action == "has":
            return run_id in st.store
        if action == "info":
            return st.store.info(run_id)
        raise ValueError(f"unknown store action {action!r}")

    def cb_dynamic(self, action: str, arg: Any = None) -> Any:
        """Dynamic steering's control plane: `set_probe` (the probe's wire JSON text),
        `delete_probe` (a name), `status`."""
        import json

        dyn = self._cb().dynamic
        if action == "set_probe":
            return dyn.set_probe(json.loads(arg))
        if action == "delete_probe":
            return dyn.delete_probe(str(arg))
        if action == "status":
            return dyn.status()
        raise ValueError(f"unknown dynamic action {action!r}")

    def cb_state_hygiene(self, options: dict) -> dict:
        """Recurrent-state hygiene on this worker (hybrids; `state_hygiene.set_mode`): `options`
        may set `mode`, `mask_off`, `sentinel_std`, `sentinel_seed`, `reset`; returns the counters."""
        from engine_ext.worker import state_hygiene

        return state_hygiene.set_mode(self.model_runner, **dict(options or {}))


def segments_offered(runner) -> bool:
    """Whether this worker runs segmented requests (`engine_ext.worker.segments`): its runner is
    vLLM's V1 or V2 runner with the seam's hooks on it, no full CUDA graph runs mixed (prefill)
    batches (their attention metadata is captured, not split), and the model has no per-request
    attention extras the split does not carry (R-SWA prefix lengths, multimodal document ranges,
    decode context parallelism), and CAUSALBOARD_SEGMENTS is not `0` (the opt-out, for A/B runs).
    On both runners a segment's scores equal the same cell's as a request of its own bit for bit
    (docs/segmented-cells.md, docs/validation.md)."""
    if not env_switch("CAUSALBOARD_SEGMENTS", True):
        return False
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1Runner

    if isinstance(runner, V1Runner):
        hooked = getattr(V1Runner._prepare_inputs, "_cb_wrapped", False)
    else:
        try:
            from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner
        except ImportError:
            return False
        hooked = isinstance(runner, V2Runner) and getattr(V2Runner.prepare_attn, "_cb_wrapped", False)
    cg = getattr(getattr(runner, "compilation_config", None), "cudagraph_mode", None)
    full_mixed = cg is not None and cg.mixed_mode() == type(cg).FULL
    mc, pc = getattr(runner, "model_config", None), getattr(runner, "parallel_config", None)
    extras = (getattr(mc, "rswa_window", None) is not None or bool(getattr(mc, "is_mm_prefix_lm", False))
              or (getattr(pc, "decode_context_parallel_size", 1) or 1) > 1)
    return bool(hooked and not full_mixed and not extras)
