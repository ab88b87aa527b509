"""`CausalboardWorkerExtension`: the RPC methods causalboard adds to vLLM's worker.

vLLM resolves `worker_extension_cls="engine_ext.worker.extension.CausalboardWorkerExtension"`
inside every worker process (`WorkerWrapperBase.init_worker`) *before* the model is built:
importing this module installs the seam's patches there (`seam.install()`). Arguments and results
are plain msgpack-able data (bytes, lists, dicts), as `collective_rpc` requires across processes.
"""

from __future__ import annotations

from typing import Any

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
        import torch

        st = self._cb()
        model = self.model_runner.model
        emb = getattr(getattr(model, "model", None), "embed_tokens", None)
        weight = getattr(emb, "weight", None)
        if weight is None:
            raise RuntimeError("cannot find the input embedding matrix (model.model.embed_tokens)")
        std = float(weight.float().std().item())
        st.embedding_std = std
        patched = sum(1 for m in model.modules() if getattr(m, "_cb_state", 0) == st.state_id)
        from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank

        st.tp_rank, st.pp_rank = int(get_tensor_model_parallel_rank()), int(get_pp_group().rank_in_group)
        runner = type(self.model_runner).__module__ + "." + type(self.model_runner).__qualname__
        return {"num_layers": st.num_layers, "hidden_size": st.hidden, "embedding_std": std,
                "patched_layers": patched, "runner": runner, "dtype": str(st.dtype).replace("torch.", ""),
                "device": str(st.device), "buffer_bytes": int(st.buffers.nbytes()), "torch": str(torch.__version__)}

    def cb_close(self) -> bool:
        """Free this engine's worker state and device buffers (called before shutdown)."""
        st = runner_state(self.model_runner)
        if st is None:
            return False
        close_state(st)
        self.model_runner._cb_state_obj = None
        return True

    def cb_collect(self, keys: list) -> dict:
        return self._cb().collect(list(keys))

    def cb_status(self) -> dict:
        return self._cb().status()

    def cb_set_global_steer(self, entries: list) -> int:
        return self._cb().set_global_steer(list(entries))

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

