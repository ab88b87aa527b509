"""How an engine is started (`EngineConfig`) and what it serves (`EngineInfo`): plain data."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from engine_ext.program import Limits


@dataclass(frozen=True)
class EngineConfig:
    """How to start the engine. `None` means the device default (see `runtime.defaults_for`)."""

    model: str | None = None
    device: str = "auto"
    dtype: str | None = None
    enforce_eager: bool | None = None
    max_model_len: int | None = None
    #: requests batched at once (None: vLLM's default for the device, e.g. 1024 on an H100)
    max_num_seqs: int | None = None
    gpu_memory_utilization: float = 0.5
    seed: int = 0
    enable_prefix_caching: bool = True
    attention_backend: str | None = None
    #: worker-side capacities (see WorkerConfig): intervention slots, capture rows per step
    #: (None: as many as `capture_buffer_bytes` holds) and the byte budget of the source-run store
    max_slots: int = 4096
    max_capture_rows: int | None = None
    capture_buffer_bytes: int = 256 * 1024 * 1024
    #: shared memory per worker through which captured values reach a client in another process
    #: (vLLM's multiprocess engine core; `engine_ext.capture_ring`); None: twice the largest
    #: step's captured values (fp32 rows of the capture buffer), within [64 MiB, 1 GiB]; 0: none,
    #: values always inline in the reply
    capture_ring_bytes: int | None = None
    source_store_bytes: int = 256 * 1024 * 1024
    limits: Limits = field(default_factory=Limits)
    #: run vLLM's engine core in its own process, overlapping scheduling and output processing
    #: with the model (None: the VLLM_ENABLE_V1_MULTIPROCESSING setting, which vLLM defaults to on
    #: and `runtime.prepare_environment` sets off on CPU; False does not override that setting:
    #: vLLM's `from_engine_args` turns multiprocessing on whenever it is on). Several engines in one
    #: process need True: vLLM's distributed state is process-global, so an in-process engine's
    #: shutdown breaks the others.
    multiprocess: bool | None = None
    #: A request's numbers do not depend on what it is batched with (sweep cells then equal their
    #: solo runs exactly; see docs/validation.md). GPU: vLLM's batch-invariant kernels
    #: (VLLM_BATCH_INVARIANT=1). CPU: each linear layer made row-invariant where this host's GEMM
    #: is not (AVX2 hosts; `engine_ext/worker/cpu_gemm.py`; no cost where it already is).
    #: None: on (both devices; hybrids: off, vLLM's mode does not cover their attention).
    batch_invariant: bool | None = None
    #: vLLM's parallelism (the same names as `vllm serve`'s flags): ranks per pipeline stage,
    #: pipeline stages, and the executor that runs the ranks ("mp", "ray", ...; None: vLLM's
    #: choice). On CPU a world of several ranks runs one process per rank, each bound to its own
    #: cores (`VLLM_CPU_OMP_THREADS_BIND`, set from the process's CPU affinity unless given).
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    #: CPU, one rank: the forward's intra-op threads (None: `OMP_NUM_THREADS` when set, else one
    #: fewer than the cores the process may use, at least 1; see `runtime.cpu_thread_count`).
    #: Several ranks get their cores from `VLLM_CPU_OMP_THREADS_BIND` instead.
    cpu_threads: int | None = None
    engine_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineInfo:
    """What is being served (for /v1/status and figure manifests)."""

    model: str
    model_path: str
    architecture: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    max_model_len: int
    device: str
    dtype: str
    enforce_eager: bool
    versions: dict[str, str]
    startup_seconds: float
    runner: str = ""
    embedding_std: float = 1.0
    batch_invariant: bool = False
    #: CPU engines with batch invariance: how many linear layers (of rank 0) kept this host's own
    #: kernel because it is row-invariant ("native"), or run it in fixed 16-row calls ("chunked")
    #: or one row per call ("per_row"); see engine_ext/worker/cpu_gemm.py. Empty elsewhere.
    cpu_gemm: dict = field(default_factory=dict)
    #: requests vLLM batches at once (the engine's scheduler limit)
    max_num_seqs: int = 0
    #: TP x PP and the decoder layers each pipeline stage computes (`topology.Topology.to_json`)
    topology: dict = field(default_factory=lambda: {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "stages": []})
    #: how KV blocks computed under an intervention are kept from other requests: "blocks" (the
    #: blocks from the first modified position on get a salt; those before stay shared) or
    #: "requests" (the whole request is salted: several ranks without the plugin entry point)
    kv_isolation: str = "blocks"

    def to_dict(self) -> dict:
        return asdict(self)
