"""`Engine`: the client-side facade over a vLLM engine (sync and async).

    from engine_ext import Engine, GenerationParams
    with Engine() as eng:                       # the bundled model, CPU or GPU defaults
        g = eng.generate("The capital of Tarn is", GenerationParams(max_tokens=4))

One engine serves any number of concurrent callers: sync `generate` from threads, `agenerate` /
`astream` / `agenerate_many` (a batch, results as each finishes) from any asyncio loop; all
requests are batched by vLLM on the engine thread (`EngineLoop`). Prompts are tokenized here with
the model's own tokenizer and sent to vLLM as token ids, so the positions the caller sees are
exactly the positions the engine computes on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
import os
import platform
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from engine_ext.engine import runtime
from engine_ext.bundled import BUNDLED_MODEL_NAME, BUNDLED_MODEL_PATH, bundled_model_path
from engine_ext.engine.loop import EngineLoop
from engine_ext.errors import EngineDeadError, SpecError
from engine_ext.engine.config import EngineConfig, EngineInfo
from engine_ext.capture_ring import RingReaders
from engine_ext.engine.topology import (Topology, cpu_thread_binding, merge_model_info, merge_results, merge_store_info,
                                        merge_store_usage)
from engine_ext.engine.cells import PreparedCells
from engine_ext.engine.outputs import AsyncSink, BatchSink, Prepared, QueueSink, delta_from_output
from engine_ext.generation import Generation, GenerationDelta, GenerationParams
from engine_ext.dynamic.engine import DynamicControl
from engine_ext.dynamic.specs import DYNAMIC_ARGS_KEY, policy_from_wire
from engine_ext.program import (ENTRY_KEY, KV_SALT_KEY, TEMPLATE_KEY, ModelDims, ProgramTemplate, PromptInfo, check_clamp_directions,
                                check_score_token_ids, compile_program, program_to_extra_args)
from engine_ext.specs import Clamp, Interventions, Steer, canonical_json, positions_from_json, spec_hash

logger = logging.getLogger("causalboard.engine")

Prompt = str | Sequence[int]

#: how long a control-plane call to the workers may take before the caller gets an error
RPC_TIMEOUT_S = 300
#: a checksum mismatch across ranks is logged at most this often
MISMATCH_LOG_INTERVAL_S = 60.0
#: after close, how long to wait for a multi-rank CPU engine's shared-memory segments to fall out of use
SHM_RELEASE_TIMEOUT_S = 20.0


_RANDOM_LOCK = threading.Lock()
_random_pool = [b"", 0]  # random bytes, next unused offset


def _random_hex8() -> str:
    """8 random hex digits (32 bits from `os.urandom`, like `uuid4().hex[:8]`), drawn from a pool
    refilled 512 ids at a time: one system call per 512 request ids instead of one each."""
    with _RANDOM_LOCK:
        pool, at = _random_pool
        if at >= len(pool):
            pool, at = os.urandom(4 * 512), 0
        _random_pool[0], _random_pool[1] = pool, at + 4
    return pool[at: at + 4].hex()


def _forget_random_pool() -> None:
    """In a forked child: never hand out the parent's ids (and never inherit a held lock)."""
    global _RANDOM_LOCK
    _RANDOM_LOCK = threading.Lock()
    _random_pool[0], _random_pool[1] = b"", 0


os.register_at_fork(after_in_child=_forget_random_pool)


class _DynamicWire:
    """A request's dynamic steering, validated (`DynamicControl._dynamic_wire`: its wire data,
    None without policies) and in the canonical JSON the workers read: resolved once for a batch
    that gives every prompt the same one."""

    __slots__ = ("wire", "json", "_api")

    def __init__(self, wire: dict | None):
        self.wire = wire
        self.json = canonical_json(wire) if wire is not None else None
        self._api: list[dict] | None = None

    def policies_api(self) -> list[dict]:
        """The wire's policies in their API JSON (`Policy.to_api`), made once: what a worker's
        dynamic result names by index (`dynamic.trace.expand`)."""
        if self._api is None:
            self._api = [policy_from_wire(pj).to_api() for pj in (self.wire or {}).get("policies", ())]
        return self._api


class Engine(DynamicControl):
    """A vLLM engine on the bundled model (or `model`) with causalboard's interventions (and
    dynamic steering: `DynamicControl`)."""

    def __init__(self, config: EngineConfig | None = None, **overrides: Any):
        config = config or EngineConfig()
        if overrides:
            config = EngineConfig(**{**{f: getattr(config, f) for f in config.__dataclass_fields__}, **overrides})
        self.config = config
        self.device = runtime.resolve_device(config.device)
        defaults = runtime.defaults_for(self.device)
        self.dtype = config.dtype or defaults.dtype
        self.enforce_eager = defaults.enforce_eager if config.enforce_eager is None else config.enforce_eager
        self.attention_backend = config.attention_backend or defaults.attention_backend
        self.block_size = defaults.block_size
        self.batch_invariant = True if config.batch_invariant is None else bool(config.batch_invariant)
        self.model_path = Path(config.model).expanduser().resolve() if config.model else bundled_model_path()
        if not (self.model_path / "config.json").is_file():
            raise SpecError("model", f"{self.model_path} is not a local Hugging Face model folder (no config.json)")
        self._loop: EngineLoop | None = None
        self._ids = itertools.count()
        self._info: EngineInfo | None = None
        self._dims: ModelDims | None = None
        self._named: dict[str, int] = {}  # mirror of the workers' named vectors: name -> dimension
        self._named_values: dict[str, Any] = {}  # client-side copy of each named vector (float32)
        self._global: list[Steer] = []
        self._global_clamps: list[Clamp] = []
        self._topology = Topology()
        #: the scheduler salts single KV blocks (else whole requests: see `start`)
        self._block_salting = True
        self._mismatch_logged = float("-inf")
        self._failure: BaseException | None = None
        self._segments_ok, self._segments_block, self._segments_step_tokens = False, 16, 0
        self._shm_segments: set = set()  # the CPU-communicator segments this engine's start created
        self.tokenizer: Any = None
        self._init_dynamic()
        #: a hybrid (recurrent-state) architecture: served with the state-hygiene guard
        self.is_hybrid = False
        #: thread that holds the engine exclusively (the state check); others' requests are refused
        self._exclusive_owner: int | None = None
        #: whether `start` froze this process's startup heap (`runtime.freeze_startup_heap`); `close` thaws it
        self._heap_frozen = False
        #: each worker's objects frozen by `cb_freeze_heap` (rank order) where they run in processes of their own
        self._workers_frozen: list[int] = []

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> "Engine":
        if self._loop is not None:
            return self
        ring = self.config.capture_ring_bytes
        if ring is not None and (isinstance(ring, bool) or not isinstance(ring, int) or ring < 0):
            raise SpecError("capture_ring_bytes", "must be None (sized from the capture buffer), 0 (no ring) or a "
                                                  f"positive number of bytes, not {ring!r}")
        runtime.prepare_environment(self.device)
        if self.device == "cpu" and self.world_size == 1:
            try:
                threads = runtime.cpu_thread_count(self.config.cpu_threads)
            except ValueError as exc:
                raise SpecError("cpu_threads", str(exc)) from None
            runtime.apply_cpu_threads(threads)
            logger.info("CPU engine: %d intra-op thread(s)", threads)
        from transformers import AutoConfig, AutoTokenizer

        from engine_ext.worker import seam

        seam.install()  # also checks the vLLM version (in-process workers share these patches)
        hf_config = AutoConfig.from_pretrained(self.model_path)
        arch = (hf_config.architectures or ["?"])[0]
        if arch not in seam.SUPPORTED_ARCHITECTURES:
            raise SpecError("model", f"architecture {arch} is not supported (supported: {', '.join(seam.SUPPORTED_ARCHITECTURES)}); "
                                     "causalboard refuses to serve a model it cannot intervene on")
        self.is_hybrid = arch in seam.HYBRID_ARCHITECTURES
        missing = seam.unavailable_architecture(arch)
        if missing:
            raise SpecError("model", f"architecture {arch} cannot be served in this environment: {missing}; hybrids need "
                                     "compressed-tensors and loguru (requirements/cpu.txt; GPU bundle: BUNDLE_MOE=1)")
        if self.is_hybrid:
            from engine_ext.engine.hybrid import check_hybrid_config, hybrid_dtype

            check_hybrid_config(self.config)
            self.dtype = hybrid_dtype(self.device, self.config.dtype, self.dtype)
            if self.config.batch_invariant:
                raise SpecError("batch_invariant", "vLLM 0.25.1's batch-invariant mode does not support the gated "
                                                   "delta-net attention (GDN_ATTN) of hybrid models")
            self.batch_invariant = False  # the CUDA default (on) does not apply to hybrids
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        t0 = time.perf_counter()
        self._loop = EngineLoop(self._build_vllm_engine)
        try:
            self._loop.start()
            infos = self._loop.call(lambda e: e.collective_rpc("cb_model_info")).result(timeout=RPC_TIMEOUT_S)
            self._topology = Topology.of(infos)
            self._check_topology(infos, int(hf_config.num_hidden_layers))
        except BaseException:
            if self._loop is not None:
                if self._loop.alive:
                    try:
                        self._loop.call(lambda e: e.collective_rpc("cb_close")).result(timeout=RPC_TIMEOUT_S)
                    except Exception:
                        logger.debug("cb_close failed", exc_info=True)
                self._loop.shutdown()
            self._loop = None
            raise
        # KV isolation: the scheduler salts the blocks an intervention changes (seam's KV_SALT_PATCHES,
        # installed with the worker extension in the engine core's process at one rank, by the
        # plugin entry point otherwise); where the plugin cannot load there, whole requests are
        # salted through vLLM's own `cache_salt` (never shared; no reuse below a patch position)
        self._block_salting = self.world_size == 1 or seam.plugin_discoverable()
        if not self._block_salting:
            logger.warning("causalboard's vLLM plugin entry point is not installed (run `pip install -e .` / `make setup`): "
                           "with %d ranks the scheduler cannot salt single KV blocks, so every intervened request is "
                           "salted whole (correct, without prefix reuse below its first modified position)", self.world_size)
        self._loop.merge_results = functools.partial(merge_results, topology=self._topology)
        if len(self._topology.leaders) < self.world_size:  # tensor parallel: only leaders' captures are merged
            self._loop.capture_ranks = frozenset(self._topology.leaders)
        self._loop.rings = self._open_capture_rings()
        worker = merge_model_info(infos, self._topology)
        # segmented requests (`agenerate_cells`): every worker runs vLLM's V1 runner with the seam's hooks
        self._segments_ok = all(info.get("segments") for info in infos)
        self._segments_block = int(worker.get("block_size") or 16)
        self._segments_step_tokens = int(self._loop.call(
            lambda e: e.vllm_config.scheduler_config.max_num_batched_tokens).result(timeout=RPC_TIMEOUT_S))
        startup = time.perf_counter() - t0
        self._info = self._make_info(hf_config, startup, worker)
        self._dims = ModelDims(self._info.num_layers, self._info.hidden_size, self._info.vocab_size, worker["embedding_std"])
        logger.info("vLLM engine ready in %.1f s: %s", startup, self._info)
        self._heap_frozen = self._freeze_startup_heaps()
        return self

    def _freeze_startup_heaps(self) -> bool:
        """Freeze the startup heap (`runtime.freeze_startup_heap`) of this process and of every
        worker's process (`cb_freeze_heap`) where they run in processes of their own (vLLM's
        multiprocess engine core, its `mp` executor; vLLM froze theirs before causalboard's own
        start-up calls). Whether this process's heap was frozen."""
        if not runtime.freeze_startup_heap():
            return False
        if self._workers_on_this_host_elsewhere():
            try:
                self._workers_frozen = self._rpc("cb_freeze_heap")
            except Exception:  # only speed depends on it
                logger.warning("could not freeze the workers' startup heap", exc_info=True)
        return True

    def _core_in_this_process(self) -> bool:
        """Whether vLLM's engine core runs in this process (its in-process client)."""
        return type(getattr(self._require_loop().engine, "engine_core", None)).__name__ == "InprocClient"

    def _workers_on_this_host_elsewhere(self) -> bool:
        """Whether the workers run in other processes of this host: vLLM's multiprocess engine
        core or its `mp` executor (not in-process, not Ray's)."""
        return not self._core_in_this_process() and self.config.distributed_executor_backend != "ray"

    def _open_capture_rings(self) -> RingReaders | None:
        """Have every worker hand captured values over in shared memory (`engine_ext.capture_ring`)
        where the workers run in other processes of this host (vLLM's multiprocess engine core,
        its `mp` executor); None (values inline in each reply) in-process, with Ray, with
        `capture_ring_bytes=0`, or where any worker's ring cannot be created or mapped here."""
        size = -1 if self.config.capture_ring_bytes is None else int(self.config.capture_ring_bytes)  # -1: auto
        if size == 0 or not self._workers_on_this_host_elsewhere():
            return None
        names = self._rpc("cb_capture_ring", size)
        readers = RingReaders()
        if all(names) and all(readers.open(n) for n in names):
            logger.info("captured values reach this process through %d shared-memory ring(s)", len(names))
            return readers
        readers.close()
        self._loop.call(lambda e: e.collective_rpc("cb_capture_ring", args=(0,))).result(timeout=RPC_TIMEOUT_S)
        logger.info("captured values travel inline (no shared-memory ring: %s)", names)
        return None

    def close(self) -> None:
        """Free the workers' state (device buffers, stored runs) and shut the engine down."""
        if self._loop is not None:
            if self._loop.alive:
                try:
                    self._loop.call(lambda e: e.collective_rpc("cb_close")).result(timeout=RPC_TIMEOUT_S)
                except Exception:  # best effort: the engine may already be failing
                    logger.debug("cb_close failed", exc_info=True)
            self._loop.shutdown()
            if self._loop.rings is not None:
                self._loop.rings.close()
            self._failure = self._loop.error
            self._loop = None
            self._sweep_cpu_shm(after_close=True)
            if self._heap_frozen:
                runtime.unfreeze_heap()
                self._heap_frozen = False

    def _sweep_cpu_shm(self, after_close: bool = False) -> None:
        """Several ranks on CPU: remove vLLM CPU-communicator segments that ended engines left in
        /dev/shm (`engine_ext.engine.cpu_shm`; a rank that is killed never unlinks its own). After
        closing, first wait (at most SHM_RELEASE_TIMEOUT_S) for the segments this engine's start
        created to fall out of use: its ranks' processes may still be ending."""
        if self.device != "cpu" or self.world_size <= 1:
            return
        from engine_ext.engine import cpu_shm

        if after_close:
            ours, self._shm_segments = self._shm_segments, set()
            cpu_shm.sweep_when_stale(ours, SHM_RELEASE_TIMEOUT_S)
        else:
            cpu_shm.sweep_stale_segments()

    def _cpu_shm_segments(self) -> set:
        if self.device != "cpu" or self.world_size <= 1:
            return set()
        from engine_ext.engine.cpu_shm import segments

        return segments()

    def __enter__(self) -> "Engine":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _check_topology(self, infos: list[dict], num_layers: int) -> None:
        """Refuse to serve when the seam does not cover the model exactly under this topology:
        every decoder layer patched once (on the stage that computes it), the stages' layer
        ranges contiguous, and nothing configured that splits the residual stream across ranks
        (sequence, context or data parallelism; see docs/distributed.md)."""
        topo = self._topology
        merged = merge_model_info(infos, topo)
        if merged["patched_layers"] != num_layers:
            raise RuntimeError(f"causalboard patched {merged['patched_layers']} of {num_layers} decoder layers; "
                               "refusing to serve a model whose interventions would be silently ignored")
        expected = 0
        for stage in topo.stages:
            if stage.first_layer != expected:
                raise RuntimeError(f"pipeline stage {stage.pp_rank} computes layers from {stage.first_layer}, expected {expected}")
            expected = stage.end_layer
        if expected != num_layers:
            raise RuntimeError(f"the pipeline stages compute layers up to {expected} of {num_layers}")
        if topo.world_size != len(infos):
            raise RuntimeError(f"{len(infos)} workers answered for a {topo.tensor_parallel_size} x {topo.pipeline_parallel_size} topology")
        split = self._loop.call(_stream_splitting_features).result(timeout=RPC_TIMEOUT_S)
        if split:
            raise SpecError("engine_kwargs", f"{', '.join(split)}: these split the residual stream across ranks, "
                                             "where causalboard's sites cannot see whole rows; not supported")

    def _build_vllm_engine(self) -> Any:
        from vllm.engine.arg_utils import EngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.llm_engine import LLMEngine

        from engine_ext.worker.seam import SEAM_FINGERPRINT

        kwargs: dict[str, Any] = dict(
            model=str(self.model_path),
            dtype=self.dtype,
            enforce_eager=self.enforce_eager,
            seed=self.config.seed,
            enable_prefix_caching=self.config.enable_prefix_caching,
            disable_log_stats=True,
            worker_extension_cls="engine_ext.worker.extension.CausalboardWorkerExtension",
            additional_config={"causalboard": {
                "seam": SEAM_FINGERPRINT,
                "max_slots": self.config.max_slots,
                "max_capture_rows": self.config.max_capture_rows,
                "capture_buffer_bytes": self.config.capture_buffer_bytes,
                "source_store_bytes": self.config.source_store_bytes,
                "max_clamp_directions": self.config.limits.max_clamp_directions,
            }},
        )
        if self.config.max_model_len:
            kwargs["max_model_len"] = self.config.max_model_len
        if self.config.max_num_seqs:
            kwargs["max_num_seqs"] = self.config.max_num_seqs
        parallel, env = self._parallel_kwargs()
        kwargs.update(parallel)
        if self.device == "cuda":
            kwargs["gpu_memory_utilization"] = self.config.gpu_memory_utilization
        if self.attention_backend:
            kwargs["attention_config"] = {"backend": self.attention_backend}
        if self.block_size and not getattr(self, "is_hybrid", False):  # hybrids: vLLM aligns it to the state size
            kwargs["block_size"] = self.block_size
        if self.batch_invariant and self.device == "cuda":
            os.environ["VLLM_BATCH_INVARIANT"] = "1"  # read by vLLM's workers at start-up
        elif self.batch_invariant:
            # CPU: vLLM has no batch-invariant mode there; the seam makes each linear layer
            # row-invariant where this host's GEMM is not (engine_ext/worker/cpu_gemm.py)
            kwargs["additional_config"]["causalboard"]["cpu_row_invariant"] = True
        if getattr(self, "is_hybrid", False):
            from engine_ext.engine.hybrid import hybrid_engine_kwargs

            kwargs.update(hybrid_engine_kwargs(self.device))
            if self.device == "cuda":
                # vLLM's default gated delta-net prefill on Hopper is FlashInfer's (JIT-built, not in
                # the GPU bundle); its Triton kernels are the portable choice
                kwargs["additional_config"]["gdn_prefill_backend"] = "triton"
        kwargs.update(self.config.engine_kwargs)
        multiprocess = bool(self.config.multiprocess) or self.world_size > 1
        self._sweep_cpu_shm()  # a segment left by an ended engine on the port drawn now fails the start
        shm_before = self._cpu_shm_segments()
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # seen by the processes vLLM starts now; restored for the rest of this process
        try:
            return LLMEngine.from_engine_args(EngineArgs(**kwargs), usage_context=UsageContext.LLM_CLASS,
                                              enable_multiprocessing=multiprocess)
        finally:
            self._shm_segments = self._cpu_shm_segments() - shm_before  # this start's (for the sweep after close)
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    @property
    def world_size(self) -> int:
        return self.config.tensor_parallel_size * self.config.pipeline_parallel_size

    def _parallel_kwargs(self) -> tuple[dict[str, Any], dict[str, str]]:
        """vLLM's parallel settings and the environment its processes need. Several ranks always
        run the engine core in its own process (vLLM's executors need it). On CPU each rank gets
        its own cores (`VLLM_CPU_OMP_THREADS_BIND` from this process's CPU affinity, unless set). On GPUs with TP > 1,
        the compile passes that rewrite the residual stream across ranks (sequence parallelism,
        async TP, all-reduce + norm fusion) are turned off: causalboard's sites must see every
        row of the stream on every rank."""
        tp, pp = self.config.tensor_parallel_size, self.config.pipeline_parallel_size
        for name, value in (("tensor_parallel_size", tp), ("pipeline_parallel_size", pp)):
            if not isinstance(value, int) or value < 1:
                raise SpecError(name, f"must be a positive integer, got {value!r}")
        kwargs: dict[str, Any] = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp}
        if self.config.distributed_executor_backend:
            kwargs["distributed_executor_backend"] = self.config.distributed_executor_backend
        env: dict[str, str] = {}
        if tp * pp == 1:
            return kwargs, env
        if self.device == "cpu":
            if self.config.distributed_executor_backend not in (None, "mp"):
                raise SpecError("distributed_executor_backend", "the CPU backend runs several ranks with the 'mp' executor "
                                                                "only (vLLM refuses Ray on CPU)")
            kwargs["distributed_executor_backend"] = "mp"
            if not os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
                cores = sorted(os.sched_getaffinity(0))
                try:
                    env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(tp * pp, cores)
                except ValueError as exc:
                    raise SpecError("tensor_parallel_size", str(exc)) from None
        elif tp > 1:
            user = dict((self.config.engine_kwargs.get("compilation_config") or {}).get("pass_config") or {})
            asked = [k for k in ("enable_sp", "fuse_gemm_comms", "fuse_allreduce_rms") if user.get(k)]
            if asked:
                raise SpecError("engine_kwargs", f"compilation_config.pass_config {', '.join(asked)} rewrite the residual "
                                                 "stream across tensor-parallel ranks; causalboard's sites need it whole")
            if "compilation_config" not in self.config.engine_kwargs:
                kwargs["compilation_config"] = {"pass_config": {"enable_sp": False, "fuse_gemm_comms": False,
                                                                "fuse_allreduce_rms": False}}
        return kwargs, env

    def _make_info(self, hf_config: Any, startup: float, worker: dict) -> EngineInfo:
        import torch
        import transformers
        from importlib import metadata

        from engine_ext.worker.seam import installed_vllm_version

        try:
            own = metadata.version("causalboard")
        except metadata.PackageNotFoundError:
            own = "source"
        max_len, max_seqs = self._loop.call(
            lambda e: (e.model_config.max_model_len, e.vllm_config.scheduler_config.max_num_seqs)).result()
        name = BUNDLED_MODEL_NAME if self.model_path == BUNDLED_MODEL_PATH else self.model_path.name
        return EngineInfo(
            model=name,
            model_path=str(self.model_path),
            architecture=(hf_config.architectures or ["?"])[0],
            num_layers=int(hf_config.num_hidden_layers),
            hidden_size=int(hf_config.hidden_size),
            vocab_size=int(hf_config.vocab_size),
            max_model_len=int(max_len),
            max_num_seqs=int(max_seqs),
            device=self.device,
            dtype=self.dtype,
            enforce_eager=self.enforce_eager,
            versions={
                "causalboard": own,
                "vllm": installed_vllm_version(),
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "python": platform.python_version(),
            },
            startup_seconds=round(startup, 2),
            runner=worker.get("runner", ""),
            embedding_std=float(worker["embedding_std"] if worker.get("embedding_std") is not None else 1.0),
            batch_invariant=self.batch_invariant,
            cpu_gemm=dict(worker.get("cpu_gemm") or {}),
            topology=self._topology.to_json(),
            kv_isolation="blocks" if self._block_salting else "requests",
        )

    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise EngineDeadError("the engine is not started")
        return self._info

    @property
    def alive(self) -> bool:
        return self._loop is not None and self._loop.alive

    @property
    def in_flight(self) -> int:
        return self._loop.in_flight if self._loop is not None else 0

    @property
    def failure(self) -> BaseException | None:
        """Why the engine died (a step raised, the engine-core process exited), or None while it
        serves, before it starts and after a clean `close`. A dead engine stays dead: every entry
        point raises `EngineDeadError`; restart the process (`causalboard serve` exits 1)."""
        return self._loop.error if self._loop is not None else self._failure

    # ---- tokens ----------------------------------------------------------------------------
    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """One display string per token id (the decoded text of that single token)."""
        return [self.tokenizer.decode([i]) for i in ids]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _prompt_info(self, text: str | None, ids: list[int], max_tokens: int) -> PromptInfo:
        offsets = None
        if text is not None:
            enc = self.tokenizer(text, return_offsets_mapping=True)
            offsets = [tuple(o) for o in enc["offset_mapping"]]
            specials = set(self.tokenizer.all_special_ids)
            offsets = [(0, 0) if i in specials else o for i, o in zip(enc["input_ids"], offsets)]
        return PromptInfo(ids, text, offsets, max_tokens)

    def resolve_positions(self, prompt: str, positions: Any, field_name: str = "positions") -> list[int]:
        """Absolute prompt positions a selector (index list, span, named) denotes for `prompt`."""
        from engine_ext.program import resolve_positions

        ids = self.tokenize(prompt)
        pos, _ = resolve_positions(positions_from_json(positions, field_name), self._prompt_info(prompt, ids, 1), field_name)
        return pos

    # ---- generation ------------------------------------------------------------------------
    def _prepare(self, prompt: Prompt, params: GenerationParams, spec: Interventions | None = None,
                 fresh: bool = False, stream: bool = False, dynamic: Any = None,
                 templates: dict | None = None, params_checked: bool = False, segments: dict | None = None) -> Prepared:
        """Validate and build the vLLM request. Raises `SpecError` naming the field. `fresh`:
        compute the whole prompt (no prefix-cache reuse), like every request that modifies the
        stream — so an unpatched baseline goes through the same computation as patched cells.
        `stream`: vLLM hands out every step's new tokens (DELTA); otherwise only the finished
        request (FINAL_ONLY, no per-step output objects). `templates`: compiled programs of the
        batch being prepared (`generate`), by (spec object, prompt length, prompt text): one
        spec on many prompts of one length is compiled once (`ProgramTemplate`), with the same
        result as compiling it for each. `params_checked`: the caller has validated `params`
        (`_prepare_many` validates each distinct parameters object of a batch once). `segments`:
        the request is a segmented one (`engine_ext.engine.cells`; the worker's `segments` block):
        its program carries it and every KV block it writes is salted (never shared)."""
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        owner = self._exclusive_owner
        if owner is not None and owner != threading.get_ident():
            raise SpecError("engine", "a recurrent-state check is running on this engine (it switches the state "
                                      "handling of every request); retry when it has finished")

        if not params_checked:
            params.validate()
        if isinstance(prompt, str):
            if not prompt.strip():
                raise SpecError("prompt", "must not be empty")
            text, ids = prompt, self.tokenize(prompt)
        else:
            ids = [int(i) for i in prompt]
            text = None
            if not ids:
                raise SpecError("prompt", "must not be empty")
            vocab = self.info.vocab_size
            bad = [i for i in ids if not 0 <= i < vocab]
            if bad:
                raise SpecError("prompt", f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        limit = self.info.max_model_len
        if len(ids) >= limit:
            raise SpecError("prompt", f"has {len(ids)} tokens; the model's context is {limit} tokens")
        if len(ids) + params.max_tokens > limit:
            raise SpecError(
                "max_tokens",
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"model's context of {limit} tokens",
            )
        prep = Prepared(text, ids, None)
        prep.cache_salt = params.cache_salt
        extra_args = None
        score_ids: list[int] | None = None
        skip_cache_read = False
        if spec is not None and not spec.is_empty():
            if spec.score_token_ids:
                if params.logprobs:
                    raise SpecError("logprobs", "top-k logprobs cannot be combined with score_token_ids (vLLM returns one or the other)")
                score_ids = check_score_token_ids(spec.score_token_ids, self.info.vocab_size)
        dyn = dynamic if isinstance(dynamic, _DynamicWire) else _DynamicWire(self._dynamic_wire(dynamic))
        dyn_wire = dyn.wire
        if ((spec is not None and (spec.steer or spec.patch or spec.capture or spec.noise or spec.clamp))
                or dyn_wire is not None or segments is not None):
            # the caller's spec objects live until the batch is submitted, so their ids are theirs
            slot = (id(spec) if spec is not None else None, len(ids), text, params.max_tokens)
            spec = spec if spec is not None else Interventions()
            prep.key = self._new_id()
            template = templates.get(slot) if templates is not None else None
            if template is None:
                program = compile_program(spec, self._prompt_info(text, ids, params.max_tokens), self._dims,
                                          key=TEMPLATE_KEY if templates is not None else prep.key,
                                          named_vector_dims=self._named.get, limits=self.config.limits)
                if program.get("clamp") and self._global_clamps:  # with the global clamps: K at most per (site, position)
                    check_clamp_directions(program["clamp"], len(ids), self.config.limits.max_clamp_directions,
                                           extra=self._global_clamp_counts())
                if templates is not None:
                    template = templates[slot] = ProgramTemplate(program)
            # KV blocks at or after the first modified position get a salt of their own: never
            # shared with requests computed differently; the blocks before it stay shared
            if segments is not None:  # segment-local positions: no block of it may serve another request
                program = {**program, "segments": segments}
                program["hash"] = spec_hash([program["hash"], segments])
                extra_args = program_to_extra_args(program)
                extra_args[KV_SALT_KEY] = [0, f"cb-{program['hash']}-{prep.key}"]  # every block, from position 0
                if segments.get("entry"):
                    extra_args[ENTRY_KEY] = int(segments["entry"])
            elif template is not None:
                program = template.program
                extra_args = template.extra_args(prep.key, kv_salt=f"cb-{template.hash}-{prep.key}")
            else:
                extra_args = program_to_extra_args(program, kv_salt=f"cb-{program['hash']}-{prep.key}")
            prep.program_hash = program["hash"]
            if dyn_wire is not None:
                # dynamic steering may change any generated position: salt from the first one on
                first = extra_args.get(KV_SALT_KEY, [len(ids)])[0]
                extra_args[KV_SALT_KEY] = [min(first, len(ids)), f"cb-{program['hash']}-{prep.key}"]
                extra_args[DYNAMIC_ARGS_KEY] = dyn.json
                prep.dynamic_policies = dyn.policies_api
            if spec.capture is not None and program["capture"]["pos"][:-1]:
                skip_cache_read = True  # cached prompt positions would not be recomputed/captured
            if not self._block_salting and KV_SALT_KEY in extra_args:
                salt = extra_args[KV_SALT_KEY][1]
                prep.cache_salt = salt if prep.cache_salt is None else f"{prep.cache_salt}|{salt}"
        if fresh:  # never reuse cached blocks (a user's cache_salt included)
            prep.cache_salt = f"cb-fresh-{self._new_id()}"
        prep.sampling = SamplingParams(
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            seed=params.seed,
            logprobs=params.logprobs if score_ids is None else None,
            logprob_token_ids=score_ids,
            stop=list(params.stop) or None,
            ignore_eos=params.ignore_eos,
            detokenize=params.detokenize,
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
            extra_args=extra_args,
            skip_reading_prefix_cache=skip_cache_read or None,
            # built here for this one request and never reused or changed after submission: vLLM's
            # input processor may take it as is (a shallow copy) instead of deep-copying it per
            # request (~0.14 ms per request with a program in `extra_args`), as vLLM's own OpenAI
            # server does for the parameters it builds per request
            skip_clone=True,
        )
        return prep

    def validate(self, prompt: Prompt, params: GenerationParams, interventions: Interventions | None = None, *,
                 dynamic: Any = None) -> list[int]:
        """Check a request without submitting it; returns the prompt's token ids.
        Raises `SpecError` naming the offending field."""
        return self._prepare(prompt, params, interventions, dynamic=dynamic).ids

    def _new_id(self) -> str:
        return f"cb-{next(self._ids)}-{_random_hex8()}"

    def _require_loop(self) -> EngineLoop:
        if self._loop is None:
            raise EngineDeadError("the engine is not started (call start() or use `with Engine()`)")
        return self._loop

    def _converter(self, params: GenerationParams, spec: Interventions | None, prep: Prepared):
        score_ids = tuple(dict.fromkeys(spec.score_token_ids)) if spec is not None else ()
        return functools.partial(delta_from_output, top_k=(params.logprobs or 0) if not score_ids else 0,
                                 score_ids=score_ids, program_hash=prep.program_hash, chosen=params.logprobs is not None,
                                 dynamic_policies=prep.dynamic_policies)

    def _prepare_many(self, batch: list[Prompt], params: list[GenerationParams], specs: list[Interventions | None], *,
                      fresh: bool = False, dynamic: Any = None, errors: dict[int, Exception] | None = None) -> list[Prepared | None]:
        """`_prepare` for a batch (one params and one spec per prompt): a spec object given for
        several prompts is compiled once per prompt length (`ProgramTemplate`, for this call
        only). Without `errors` the first invalid item raises; with it, an item that fails
        validation is recorded there (by index) and its slot is None."""
        seen = Counter(map(id, specs))
        templates: dict = {}
        checked: set[int] = set()  # parameters objects validated (frozen: valid for the whole batch)
        out: list[Prepared | None] = []
        if len(batch) > 1 and not isinstance(dynamic, _DynamicWire):
            # one dynamic request for every prompt: validated and serialized once for the batch
            try:
                dynamic = _DynamicWire(self._dynamic_wire(dynamic))
            except Exception as exc:
                if errors is None:
                    raise
                errors.update(dict.fromkeys(range(len(batch)), exc))
                return [None] * len(batch)
        for i, (p, gp, s) in enumerate(zip(batch, params, specs)):
            try:
                if id(gp) not in checked:
                    gp.validate()
                    checked.add(id(gp))
                out.append(self._prepare(p, gp, s, fresh, dynamic=dynamic, templates=templates if seen[id(s)] > 1 else None,
                                         params_checked=True))
            except Exception as exc:
                if errors is None:
                    raise
                errors[i] = exc
                out.append(None)
        return out

    def generate(self, prompts: Prompt | Sequence[Prompt], params: GenerationParams | None = None,
                 interventions: Interventions | Sequence[Interventions | None] | None = None, *,
                 dynamic: Any = None) -> Any:
        """Generate for one prompt (returns a `Generation`) or a list of prompts (returns a list),
        all submitted together so vLLM batches them. `interventions` is one spec for all prompts
        or one per prompt; `dynamic` (a `DynamicRequest`) applies to every prompt. Blocks until all
        are finished."""
        params = params or GenerationParams()
        single = isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int))
        batch = [prompts] if single else list(prompts)
        _, specs = _per_prompt(batch, params, interventions)
        loop = self._require_loop()
        prepared = self._prepare_many(batch, [params] * len(batch), specs, dynamic=dynamic)  # validate all before submitting any
        jobs, requests = [], []
        for prep, spec in zip(prepared, specs):
            rid = prep.key or self._new_id()
            sink = QueueSink(self._converter(params, spec, prep))
            requests.append((rid, prep.prompt(), prep.sampling, sink, prep.key))
            jobs.append((Generation(rid, prep.text, prep.ids), sink))
        loop.submit_many(requests)
        for gen, sink in jobs:
            while True:
                item = sink.q.get()
                if isinstance(item, BaseException):
                    raise item
                gen.extend(item)
                if item.finished:
                    break
        results = [g for g, _ in jobs]
        return results[0] if single else results

    async def astream(self, prompt: Prompt, params: GenerationParams | None = None,
                      interventions: Interventions | None = None, *, dynamic: Any = None) -> AsyncIterator[GenerationDelta]:
        """Yield deltas as the engine produces them (the last one carries the intervention
        result). Leaving the iterator early (or cancelling the task) aborts the request."""
        params = params or GenerationParams()
        prep = self._prepare(prompt, params, interventions, stream=True, dynamic=dynamic)
        async for delta in self._astream(prep, params, interventions):
            yield delta

    async def _astream(self, prep: Prepared, params: GenerationParams, spec: Interventions | None) -> AsyncIterator[GenerationDelta]:
        loop = self._require_loop()
        rid = prep.key or self._new_id()
        sink = AsyncSink(asyncio.get_running_loop(), self._converter(params, spec, prep))
        loop.submit(rid, prep.prompt(), prep.sampling, sink, collect_key=prep.key)
        finished = False
        try:
            while True:
                item = await sink.q.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                loop.abort(rid)

    async def agenerate(self, prompt: Prompt, params: GenerationParams | None = None,
                        interventions: Interventions | None = None, *, fresh: bool = False,
                        dynamic: Any = None) -> Generation:
        """Async `generate` for one prompt (`fresh`: see `_prepare`)."""
        params = params or GenerationParams()
        prep = self._prepare(prompt, params, interventions, fresh, dynamic=dynamic)
        gen = Generation(prep.key or "", prep.text, prep.ids)
        async for delta in self._astream(prep, params, interventions):
            gen.extend(delta)
        return gen

    async def agenerate_many(self, prompts: Sequence[Prompt],
                             params: GenerationParams | Sequence[GenerationParams] | None = None,
                             interventions: Interventions | Sequence[Interventions | None] | None = None, *,
                             fresh: bool = False, dynamic: Any = None) -> AsyncIterator[tuple[int, Generation | Exception]]:
        """Run many prompts as one batch from asyncio; yield `(index, result)` as each finishes.

        Contract:

        - `prompts`, `interventions`, `dynamic` as in `generate` (one spec for all, or one per
          prompt; a spec object given for several prompts is compiled once per prompt length);
          `params` one for all or one per prompt; `fresh` as in `agenerate`, for every item.
        - Every item is prepared first, then all are handed to the engine loop in one command
          (`EngineLoop.submit_many`), so vLLM schedules them together. Results come back through one
          shared sink: the caller's event loop is woken once per burst of finished requests, not
          once per request.
        - Yields each index exactly once, in completion order (not input order). The result is the
          item's `Generation`, or the `Exception` of that item alone: a `SpecError` from its
          validation (nothing of it was submitted) or vLLM refusing it. A bad item never fails the
          others. A voided intervention is a normal `Generation` (`intervention.voided`).
        - The engine dying (or being shut down) raises `EngineDeadError` from the iterator.
        - Leaving early — `aclose()`, `break` inside `async with contextlib.aclosing(...)`, or
          cancelling the task that iterates — aborts every item not yet finished, in one command
          (`EngineLoop.abort_many`); `in_flight` then returns to what it was. (A generator merely
          dropped without `aclose` is only closed when it is garbage-collected.)
        """
        batch = list(prompts)
        per, specs = _per_prompt(batch, params, interventions)
        loop = self._require_loop()
        errors: dict[int, Exception] = {}
        prepared = self._prepare_many(batch, per, specs, fresh=fresh, dynamic=dynamic, errors=errors)
        sink = BatchSink(asyncio.get_running_loop())
        gens: dict[int, Generation] = {}
        rids: dict[int, str] = {}
        requests = []
        for i, (prep, gp, spec) in enumerate(zip(prepared, per, specs)):
            if prep is None:
                continue
            rid = rids[i] = prep.key or self._new_id()
            gens[i] = Generation(rid, prep.text, prep.ids)
            requests.append((rid, prep.prompt(), prep.sampling, sink.member(i, self._converter(gp, spec, prep)), prep.key))
        if requests:
            loop.submit_many(requests)
        try:
            for i, exc in errors.items():
                yield i, exc
            while gens:
                for i, item in await sink.get():
                    if i is None:  # the whole engine failed
                        raise item
                    if isinstance(item, BaseException):
                        gens.pop(i, None)
                        yield i, item
                        continue
                    gen = gens.get(i)
                    if gen is None:
                        continue
                    gen.extend(item)
                    if item.finished:
                        del gens[i]
                        yield i, gen
        finally:
            if gens:
                loop.abort_many([rids[i] for i in gens])

    @property
    def segment_block(self) -> int | None:
        """The KV block size segmented requests are laid out in (`agenerate_cells`), or None where
        this engine cannot run them (a hybrid model; CAUSALBOARD_SEGMENTS=0; `extension.segments_offered`)."""
        return self._segments_block if self._segments_ok and not getattr(self, "is_hybrid", False) else None

    @property
    def layer_entry_offered(self) -> bool:
        """Whether segmented cells given an `entry_run` skip the layers below their entry layer here
        (`agenerate_cells`; docs/segmented-cells.md, "Layer skipping"): an engine that can segment,
        with one pipeline stage and an eager forward (`enforce_eager`), and by default only on the
        CPU (`CAUSALBOARD_LAYER_ENTRY`: 0 turns it off, 1 turns it on for an eager GPU engine too).
        Measured on an H200 (docs/segmented-cells.md): a step of one entry layer's cells costs
        ~24 ms of host time however few tokens it holds, so the cells entering at their layers ran
        0.22-0.49x of the same cells in one step that runs every layer; a compiled engine's graph
        fixes the layers a forward runs (its uncompiled forward gave scores up to 0.06 apart)."""
        from engine_ext.switches import env_switch

        return (self.segment_block is not None and bool(self.enforce_eager)
                and self.config.pipeline_parallel_size == 1
                and env_switch("CAUSALBOARD_LAYER_ENTRY", self.info.device == "cpu"))

    def _segments_blocked(self) -> str | None:
        """Why cells cannot be segments now (None: they can): global steering, clamps or dynamic
        policies apply to every request at its own positions, which in a segmented request would
        be the first segment's only."""
        if self._global or self._global_clamps:
            return "global steering or clamps are set (they apply at each request's own positions)"
        if self.dynamic_policies:
            return "global dynamic policies are set"
        return None

    def segment_layout(self, n_prompt: int) -> tuple[int, int] | None:
        """(segment length, cells per request) that `agenerate_cells` uses by default for cells of
        an `n_prompt`-token prompt, or None where it runs them as requests of their own (the engine
        cannot segment, fewer than two fit, or padding to whole KV blocks would cost more than
        `cells.MAX_PADDING` of the prompt)."""
        from engine_ext.engine import cells as packing

        if self.segment_block is None or self._segments_blocked():
            return None
        length, k = packing.segments_per_request(n_prompt, self.segment_block, self.info.max_model_len,
                                                 self._segments_step_tokens)
        return (length, k) if packing.worth_it(n_prompt, length, k) else None

    async def agenerate_cells(self, prompt: Sequence[int], cells: Sequence[Interventions | None],
                              score_token_ids: Sequence[int], *, segmented: bool | None = None,
                              entry_run: str | None = None, entry_band: int = 1
                              ) -> AsyncIterator[tuple[int, Generation | Exception]]:
        """Score many *cells* — one forward each of the same `prompt` (token ids), each with its
        own patches (None: none, a baseline) — at `score_token_ids` at the last prompt token.

        Contract: yields each index once, in completion order, with the cell's `Generation`
        (`scores[0]` by token id, `intervention` its status; no generated tokens) or its
        `Exception`, as `agenerate_many` does for the same cells as requests of their own (each
        with `score_token_ids`, `fresh`). Where `segmented` allows (None: where `segment_layout`
        says so; True: wherever the engine can, else `SpecError`; False: never), several cells run
        as the segments of one request (`engine_ext.engine.cells`, `engine_ext.worker.segments`,
        docs/segmented-cells.md): the same scores (bit for bit on the CPU engine:
        tests/test_segmented_cells.py), vLLM's per-request costs paid once per request of up to
        `cells.MAX_SEGMENTS` cells; a patch source that is missing voids every cell of its request.
        Cells with anything but patches, and all of them when one fails validation, run as
        requests of their own. Leaving early aborts what is unfinished.

        `entry_run`: a stored run of `prompt` with no patches (a sweep's corrupt baseline,
        captured with `keep_as`) that holds `pre_attn` at every layer and prompt position. Then
        segmented cells are grouped by the lowest layer they patch, enter the forward there from
        that run's values, and a step holding only cells of one such layer skips the layers
        below (`cells.pack`; docs/segmented-cells.md, "Layer skipping"): the same scores.
        Missing values void the cells that need them, as any missing patch source does. Ignored
        (every layer runs) where the engine does not offer it (`layer_entry_offered`).
        `entry_band`: cells enter at the first layer of their band of that many layers.

        The same in two steps: `prepare_cells` (validation, packing, the vLLM requests: host work
        that needs nothing from the engine's state, so a caller can do it while the engine computes
        something else, e.g. a sweep's clean run) and `arun_cells`."""
        async for item in self.arun_cells(self.prepare_cells(prompt, cells, score_token_ids, segmented=segmented,
                                                             entry_run=entry_run, entry_band=entry_band)):
            yield item

    def prepare_cells(self, prompt: Sequence[int], cells: Sequence[Interventions | None],
                      score_token_ids: Sequence[int], *, segmented: bool | None = None,
                      entry_run: str | None = None, entry_band: int = 1) -> PreparedCells:
        """The first step of `agenerate_cells` (same arguments): every cell validated and packed
        into the vLLM requests that `arun_cells` submits. Raises `SpecError` only for `segmented`
        (as `agenerate_cells`); a cell's own error is kept and yielded by `arun_cells`. A patch's
        stored source run need not exist yet (the worker reads it when the request runs)."""
        from engine_ext.engine import cells as packing

        params = GenerationParams(max_tokens=1, detokenize=False)
        ids = [int(i) for i in prompt]
        score_ids = tuple(int(t) for t in score_token_ids)
        if not isinstance(entry_band, int) or isinstance(entry_band, bool) or entry_band < 1:
            raise SpecError("entry_band", f"must be a whole number >= 1, got {entry_band!r}")
        if entry_run is not None and (not isinstance(entry_run, str) or not entry_run):
            raise SpecError("entry_run", f"must be a stored run's name, got {entry_run!r}")
        if not self.layer_entry_offered:  # every layer runs: no entry patches, no steps held apart
            entry_run = None
        can = self.segment_block is not None
        if segmented and not can:
            raise SpecError("segmented", "this engine cannot run segmented requests (vLLM's V1 runner with "
                                         "causalboard's seam is needed, or V2's, CAUSALBOARD_SEGMENTS not 0, "
                                         "and no hybrid model)")
        blocked = self._segments_blocked() if segmented else None
        if blocked:
            raise SpecError("segmented", f"cells cannot be segments now: {blocked}")
        layout = self.segment_layout(len(ids))
        use = layout is not None if segmented is None else segmented
        packed = [i for i, c in enumerate(cells) if packing.packable(c)] if use else []
        carriers: list = []
        if len(packed) >= 2 and ids:
            length, k = layout or packing.segments_per_request(len(ids), self._segments_block, self.info.max_model_len,
                                                               self._segments_step_tokens)
            try:
                if k >= 2:
                    check_score_token_ids(list(score_ids), self.info.vocab_size)
                    carriers = packing.pack(ids, [cells[i] for i in packed], score_ids, length, k, ids[-1],
                                            entry_run=entry_run, entry_band=entry_band)
            except SpecError:  # a bad cell (or bad ids): every cell as a request of its own reports its own error
                carriers = []
        in_carriers = {packed[j] for car in carriers for j in car.cells}
        out = PreparedCells(ids)
        for i in (i for i in range(len(cells)) if i not in in_carriers):
            spec = dataclasses.replace(cells[i] or Interventions(), score_token_ids=score_ids)
            try:
                prep = self._prepare(ids, params, spec, fresh=True)
            except Exception as exc:
                out.errors.append((i, exc))
                continue
            out.add(prep.key or self._new_id(), prep, i, self._converter(params, spec, prep))
        for car in carriers:
            car.cells = [packed[j] for j in car.cells]
            try:
                prep = self._prepare(car.ids, params, car.spec, fresh=True, segments=car.segments)
            except Exception as exc:
                out.errors += [(i, exc) for i in car.cells]
                continue
            out.add(prep.key or self._new_id(), prep, car, self._converter(params, None, prep))
        return out

    async def arun_cells(self, prepared: PreparedCells) -> AsyncIterator[tuple[int, Generation | Exception]]:
        """The second step of `agenerate_cells`: submit `prepared` (once: a second run raises
        `RuntimeError`) and yield as `agenerate_cells` does."""
        from engine_ext.engine import cells as packing

        prepared.claim()
        loop = self._require_loop()
        ids = prepared.ids
        sink = BatchSink(asyncio.get_running_loop())
        pending: dict[int, tuple[str, Any, Generation]] = {}  # sink index -> (request id, carrier or cell, generation)
        requests = []
        for m, (rid, prep, what, convert) in enumerate(prepared.requests):
            pending[m] = (rid, what, Generation(rid, None, prep.ids))
            requests.append((rid, prep.prompt(), prep.sampling, sink.member(m, convert), prep.key))
        if requests:
            loop.submit_many(requests)
        try:
            for i, exc in prepared.errors:
                yield i, exc
            while pending:
                for j, item in await sink.get():
                    if j is None:
                        raise item
                    entry = pending.get(j)
                    if entry is None:
                        continue
                    rid, what, gen = entry
                    if isinstance(item, BaseException):
                        del pending[j]
                        for i in (what.cells if isinstance(what, packing.Carrier) else [what]):
                            yield i, item
                        continue
                    gen.extend(item)
                    if not item.finished:
                        continue
                    del pending[j]
                    if isinstance(what, packing.Carrier):
                        for i, g in packing.split(what, gen, ids):
                            yield i, g
                    else:
                        gen.token_ids, gen.text, gen.logprobs = [], "", []  # a cell is its scores
                        yield what, gen
        finally:
            if pending:
                loop.abort_many([rid for rid, _, _ in pending.values()])

    # ---- conveniences ----------------------------------------------------------------------
    def capture(self, prompt: Prompt, sites: Any, positions: Any = "all_prompt", *, keep_as: str | None = None,
                return_values: bool = True) -> Generation:
        """Run the prompt (one generated token) capturing `sites` x `positions`."""
        from engine_ext.specs import Capture

        spec = Interventions(capture=Capture.make(sites, positions, keep_as=keep_as, return_values=return_values))
        gen = self.generate(prompt, GenerationParams(max_tokens=1), spec)
        iv = gen.intervention
        if iv is None or iv.voided or (keep_as is not None and iv.stored_as != keep_as):
            errs = iv.errors if iv else ["no result"]
            raise RuntimeError(f"capture failed: {'; '.join(errs)}")
        return gen

    def score(self, prompt: Prompt, token_ids: Sequence[int], interventions: Interventions | None = None) -> dict[int, float]:
        """Exact logprobs of `token_ids` at the last prompt position (with interventions)."""
        spec = interventions or Interventions()
        spec = dataclasses.replace(spec, score_token_ids=tuple(token_ids))
        gen = self.generate(prompt, GenerationParams(max_tokens=1), spec)
        if gen.intervention is not None and gen.intervention.voided:
            raise RuntimeError(f"request voided: {'; '.join(gen.intervention.errors)}")
        return gen.scores[0]

    # ---- hybrids: recurrent-state hygiene ----------------------------------------------------
    def state_check(self, probes: Sequence[Sequence[int]] | None = None, *, max_tokens: int = 4,
                    sentinel_std: float = 1.0, seed: int = 0) -> dict:
        """The sentinel 4-arm check on this (hybrid) engine; needs an idle engine
        (`engine_ext.engine.hybrid.run_state_check`, docs/hybrid-models.md)."""
        from engine_ext.engine.hybrid import run_state_check

        return run_state_check(self, probes, max_tokens=max_tokens, sentinel_std=sentinel_std, seed=seed)

    def state_hygiene(self) -> dict:
        """The zero-on-realloc guard's counters (mode, slots zeroed, seconds spent)."""
        from engine_ext.engine.hybrid import state_hygiene_status

        return state_hygiene_status(self)

    # ---- control plane ---------------------------------------------------------------------
    def _send_rpc(self, method: str, args: tuple) -> Future:
        """Queue `collective_rpc(method, args)` for the loop thread; the Future holds the replies,
        or (multiprocess core) a Future of them (see `_rpc`)."""
        from engine_ext.worker.seam import start_collective_rpc

        def send(engine: Any) -> Any:
            pending = start_collective_rpc(engine, method, args)
            return pending if pending is not None else engine.collective_rpc(method, args=args)

        return self._require_loop().call(send)

    async def _arpc(self, method: str, *args: Any) -> list:
        """`_rpc` for a caller on an asyncio loop: the call is queued for the engine loop at
        once, before this coroutine first yields (no worker thread to start first, which would
        wait for the caller's loop to be free), and its reply awaited."""
        sent = self._send_rpc(method, args)
        reply = await asyncio.wait_for(asyncio.wrap_future(sent), RPC_TIMEOUT_S)
        return await asyncio.wait_for(asyncio.wrap_future(reply), RPC_TIMEOUT_S) if isinstance(reply, Future) else reply

    async def handed_over(self) -> None:
        """With the engine core in its own process: wait until everything submitted to this
        engine before the call has been sent to it (the loop thread runs its commands in order).
        A caller about to hold the GIL for a while (preparing many requests) thus lets the
        requests already submitted reach the core first, instead of delaying each of the loop
        thread's steps in sending them by a GIL switch interval. In-process it returns at once:
        there the loop thread runs the forward itself, and waiting for it would serialise the
        caller's work after the step instead of beside it."""
        if not self._core_in_this_process():
            await asyncio.wrap_future(self._require_loop().call(lambda _engine: None))

    def _rpc(self, method: str, *args: Any) -> list:
        """`collective_rpc(method, args)` on every worker: their replies, in rank order. With a
        multiprocess engine core the loop thread only sends the call (`seam.start_collective_rpc`)
        and this thread waits for the reply, so the loop keeps stepping and delivering outputs
        meanwhile (a call waits for the core's current step to end: up to a sweep's whole step);
        in-process the loop thread runs it. The core takes the call before anything sent after
        it, as before. An engine-core death fails the wait (`loop.wake_blocked_calls`)."""
        reply = self._send_rpc(method, args).result(timeout=RPC_TIMEOUT_S)
        return reply.result(timeout=RPC_TIMEOUT_S) if isinstance(reply, Future) else reply

    def register_vector(self, name: str, vector: Any) -> None:
        """Register a named steering vector on every worker (replacing one of the same name)."""
        from engine_ext.specs import as_vector

        if not isinstance(name, str) or not name or len(name) > 128:
            raise SpecError("name", "must be a non-empty string of at most 128 characters")
        vec = as_vector(vector, "vector")
        if vec.shape[0] != self.info.hidden_size:
            raise SpecError("vector", f"has dimension {vec.shape[0]}, the model's hidden size is {self.info.hidden_size}")
        if name not in self._named and len(self._named) >= self.config.limits.max_named_vectors:
            raise SpecError("name", f"at most {self.config.limits.max_named_vectors} named vectors")
        self._rpc("cb_register_vector", name, vec.astype("<f4").tobytes())
        self._named[name] = int(vec.shape[0])
        self._named_values[name] = vec.astype("<f4").copy()

    def delete_vector(self, name: str) -> bool:
        if any(s.name == name for s in self._global):
            raise SpecError("name", f"vector {name!r} is used by the global steering; clear it first")
        found = any(self._rpc("cb_delete_vector", name))
        self._named.pop(name, None)
        self._named_values.pop(name, None)
        return found

    def list_vectors(self) -> dict[str, int]:
        return dict(self._named)

    def named_vector(self, name: str) -> Any:
        """A copy of the registered vector `name` (float32 numpy array), or None."""
        vec = self._named_values.get(name)
        return None if vec is None else vec.copy()

    def _global_clamp_counts(self) -> dict[int, tuple[int, int]]:
        """Per site index: the global clamps acting at prompt / at generated positions (each
        counted as acting at every position of its phase)."""
        out: dict[int, tuple[int, int]] = {}
        for c in self._global_clamps:
            for site in c.sites:
                p, g = out.get(site.index(), (0, 0))
                out[site.index()] = (p + (c.phase != "decode"), g + (c.phase != "prefill"))
        return out

    def _check_global_entry(self, field: str, what: str, positions: Any, vector: Any, sites: Sequence[Any]) -> None:
        """A global steer's or clamp's positions (no relative forms), width and layers, or a
        SpecError naming the field."""
        if positions not in ("all", "all_generated") and (isinstance(positions, str) or any(
                not isinstance(p, int) or p < 0 for p in positions)):
            raise SpecError(f"{field}.positions", f"{what} takes 'all', 'all_generated' or absolute indices")
        if vector is not None and vector.shape[0] != self.info.hidden_size:
            raise SpecError(f"{field}.vector", f"has dimension {vector.shape[0]}, the model's hidden size is {self.info.hidden_size}")
        for j, site in enumerate(sites):
            if site.layer >= self.info.num_layers:
                raise SpecError(f"{field}.sites[{j}]", f"layer {site.layer} is out of range: the model has layers 0..{self.info.num_layers - 1}")

    def set_global_steer(self, steers: Sequence[Steer], clamps: Sequence[Clamp] | None = None) -> None:
        """Replace the server-wide steering (applies to every request; composes with per-request
        steering). Positions: "all", "all_generated" or absolute indices. `clamps`: the global
        directional clamps (None: keep the current ones), after every add at their site. Resets
        the prefix cache."""
        clamp_entries = None
        if clamps is not None:
            clamp_entries = []
            per_site: dict[int, tuple[int, int]] = {}  # clamps at prompt / generated positions
            for k, c in enumerate(clamps):
                f = f"clamp[{k}]"
                self._check_global_entry(f, "global clamps", c.positions, c.vector, c.sites)
                for j, site in enumerate(c.sites):
                    p, g = per_site.get(site.index(), (0, 0))
                    per_site[site.index()] = (p + (c.phase != "decode"), g + (c.phase != "prefill"))
                    if max(per_site[site.index()]) > self.config.limits.max_clamp_directions:
                        raise SpecError(f"{f}.sites[{j}]", f"more than {self.config.limits.max_clamp_directions} global clamps "
                                                           f"at {site} (max_clamp_directions)")
                    e = {"site": site.index(), "dir": c.unit().astype("<f4").tobytes(), "lo": c.min, "hi": c.max,
                         "st": c.strength, "phase": c.phase, **_global_positions(c.positions)}
                    clamp_entries.append(e)
        entries = []
        for k, s in enumerate(steers):
            f = f"steer[{k}]"
            if s.name is not None and s.name not in self._named:
                raise SpecError(f"{f}.name", f"no registered vector named {s.name!r}")
            self._check_global_entry(f, "global steering", s.positions, s.vector, s.sites)
            for site in s.sites:
                entries.append({"site": site.index(), "scale": s.scale, "phase": s.phase,
                                "vec": s.vector.astype("<f4").tobytes() if s.vector is not None else None, "name": s.name,
                                "mask": s.mask.values(self.info.hidden_size, f"{f}.mask").astype("<f4").tobytes()
                                if s.mask is not None else None, **_global_positions(s.positions)})

        def apply(engine: Any) -> None:
            engine.collective_rpc("cb_set_global_steer", args=(entries,) if clamp_entries is None else (entries, clamp_entries))
            engine.reset_prefix_cache()

        self._require_loop().call(apply).result()
        self._global = list(steers)
        if clamps is not None:
            self._global_clamps = list(clamps)

    def clear_global_steer(self) -> None:
        """Remove every global steering entry and global clamp."""
        self.set_global_steer([], [])

    @property
    def global_steer(self) -> list[Steer]:
        return list(self._global)

    @property
    def global_clamps(self) -> list[Clamp]:
        return list(self._global_clamps)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block (waits for running requests to finish first)."""
        return bool(self._require_loop().call(lambda e: e.reset_prefix_cache()).result())

    def drop_source(self, run_id: str) -> bool:
        return any(self._rpc("cb_store", "drop", run_id))

    def has_source(self, run_id: str) -> bool:
        return all(self._rpc("cb_store", "has", run_id))

    def source_info(self, run_id: str) -> dict | None:
        """What a stored run holds, over every pipeline stage: `{"sites": [site index],
        "positions": [...], "bytes", "leases"}`, or None when it is not stored (on any rank)."""
        return merge_store_info(self._rpc("cb_store", "info", run_id), self._topology)

    def lease_source(self, run_id: str) -> bool:
        """Protect a stored run from eviction until `release_source` (e.g. for a sweep's life)."""
        return all(self._rpc("cb_store", "lease", run_id))

    def release_source(self, run_id: str) -> None:
        self._rpc("cb_store", "release", run_id)

    def source_store_usage(self) -> dict:
        """The source store over every stage, as one store (`topology.merge_store_usage`): the
        budget applies to whole runs on every stage, a run's bytes are its values on all stages."""
        return merge_store_usage(self._rpc("cb_store", "usage"), self._topology)

    @property
    def topology(self) -> Topology:
        return self._topology

    def intervention_status(self) -> dict:
        """Every worker's checksum and action count, and the comparison within each pipeline
        stage (its tensor-parallel ranks must agree). A mismatch is logged as an error (at most
        once a minute) and reported, never raised."""
        return self._checksum_status(self._rpc("cb_status"))

    async def aintervention_status(self) -> dict:
        """`intervention_status` for a caller on an asyncio loop (`_arpc`)."""
        return self._checksum_status(await self._arpc("cb_status"))

    def _checksum_status(self, workers: list) -> dict:
        from engine_ext.worker.checksum import compare_ranks

        determinism = compare_ranks(workers)
        if not determinism["consistent"]:
            now = time.monotonic()
            if now - self._mismatch_logged >= MISMATCH_LOG_INTERVAL_S:
                self._mismatch_logged = now
                logger.error("applied-action checksums disagree across tensor-parallel ranks: %s "
                             "(the ranks applied different interventions; results may be wrong)", determinism["mismatches"])
        return {"workers": workers, "determinism": determinism}

    def inject_fault(self, kind: str, tp_rank: int, pp_rank: int = 0) -> bool:
        """Testing aid: make one worker misbehave (`skip_action`: skip the next planned request
        window, as a faulty rank would). Returns whether a worker took the fault."""
        return any(self._rpc("cb_debug_fault", kind, tp_rank, pp_rank))


def _per_prompt(batch: list, params: Any, interventions: Any) -> tuple[list, list]:
    """One `GenerationParams` and one spec per prompt of `batch`, from one for all or one each
    (a count that does not match is a SpecError naming the field)."""
    specs = list(interventions) if isinstance(interventions, (list, tuple)) else [interventions] * len(batch)
    if len(specs) != len(batch):
        raise SpecError("interventions", f"{len(specs)} specs for {len(batch)} prompts")
    per = list(params) if isinstance(params, (list, tuple)) else [params or GenerationParams()] * len(batch)
    if len(per) != len(batch):
        raise SpecError("params", f"{len(per)} parameter sets for {len(batch)} prompts")
    return per, specs


def _stream_splitting_features(engine: Any) -> list[str]:
    """vLLM settings under which a rank does not hold whole rows of the residual stream."""
    cfg = engine.vllm_config
    par, passes = cfg.parallel_config, cfg.compilation_config.pass_config
    found = []
    for name in ("data_parallel_size", "decode_context_parallel_size", "prefill_context_parallel_size"):
        if int(getattr(par, name, 1) or 1) > 1:
            found.append(f"{name}={getattr(par, name)}")
    for name in ("enable_sp", "fuse_gemm_comms"):
        if getattr(passes, name, False) and par.tensor_parallel_size > 1:
            found.append(f"compilation_config.pass_config.{name}")
    return found


def _global_positions(positions: Any) -> dict:
    """The worker's position fields of a global steer or clamp entry (`cb_set_global_steer`)."""
    if positions == "all":
        return {"pos": [], "gen": True, "every": True}
    if positions == "all_generated":
        return {"pos": [], "gen": True}
    return {"pos": sorted(set(positions)), "gen": False}
