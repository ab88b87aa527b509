"""`Engine`: the client-side facade over a vLLM engine (sync and async).

    from engine_ext import Engine, GenerationParams
    with Engine() as eng:                       # the bundled model, CPU or GPU defaults
        g = eng.generate("The capital of Varnia is", GenerationParams(max_tokens=4))

One engine serves any number of concurrent callers: sync `generate` from threads, `agenerate` /
`astream` from any asyncio loop; all requests are batched by vLLM on the engine thread
(`EngineLoop`). Prompts are tokenized here with the model's own tokenizer and sent to vLLM as
token ids, so the positions the caller sees are exactly the positions the engine computes on.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import platform
import queue
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import runtime
from .bundled import BUNDLED_MODEL_NAME, BUNDLED_MODEL_PATH, bundled_model_path
from .engine_loop import EngineLoop
from .errors import EngineDeadError, SpecError
from .generation import Generation, GenerationDelta, GenerationParams

logger = logging.getLogger("causalboard.engine")

Prompt = str | Sequence[int]


@dataclass(frozen=True)
class EngineConfig:
    """How to start the engine. `None` means the device default (see `runtime.defaults_for`)."""

    model: str | None = None
    device: str = "auto"
    dtype: str | None = None
    enforce_eager: bool | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 64
    gpu_memory_utilization: float = 0.5
    seed: int = 0
    enable_prefix_caching: bool = True
    attention_backend: str | None = None
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

    def to_dict(self) -> dict:
        return asdict(self)


class _QueueSink:
    """Sync sink: deltas go to a thread-safe queue."""

    def __init__(self, convert):
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self._convert = convert

    def on_output(self, output: Any) -> None:
        self.q.put(self._convert(output))

    def on_error(self, error: BaseException) -> None:
        self.q.put(error)


class _AsyncSink:
    """Async sink: deltas are posted onto the caller's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, convert):
        self.q: asyncio.Queue = asyncio.Queue()
        self._loop = loop
        self._convert = convert

    def _post(self, item: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(self.q.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            pass

    def on_output(self, output: Any) -> None:
        self._post(self._convert(output))

    def on_error(self, error: BaseException) -> None:
        self._post(error)


def _delta_from_output(output: Any, top_k: int) -> GenerationDelta:
    """Convert a vLLM DELTA `RequestOutput`; `top_k` = how many alternatives were asked for."""
    comp = output.outputs[0]
    logprobs: list[float] = []
    tops: list[dict[int, float]] = []
    for tid, step in zip(comp.token_ids, comp.logprobs or []):
        logprobs.append(float(step[tid].logprob))
        if top_k:
            # vLLM adds the sampled token to the top-k even when it ranks lower; keep the top-k only
            tops.append({int(t): float(lp.logprob) for t, lp in step.items() if lp.rank <= top_k})
    return GenerationDelta(
        token_ids=list(comp.token_ids),
        text=comp.text,
        logprobs=logprobs,
        top_logprobs=tops,
        finished=bool(output.finished),
        finish_reason=comp.finish_reason,
    )


class Engine:
    """A vLLM engine on the bundled model (or `model`), with causalboard's defaults."""

    def __init__(self, config: EngineConfig | None = None, **overrides: Any):
        config = config or EngineConfig()
        if overrides:
            config = EngineConfig(**{**asdict(config), **overrides})
        self.config = config
        self.device = runtime.resolve_device(config.device)
        defaults = runtime.defaults_for(self.device)
        self.dtype = config.dtype or defaults.dtype
        self.enforce_eager = defaults.enforce_eager if config.enforce_eager is None else config.enforce_eager
        self.attention_backend = config.attention_backend or defaults.attention_backend
        self.model_path = Path(config.model).expanduser().resolve() if config.model else bundled_model_path()
        if not (self.model_path / "config.json").is_file():
            raise SpecError("model", f"{self.model_path} is not a local Hugging Face model folder (no config.json)")
        self._loop: EngineLoop | None = None
        self._ids = itertools.count()
        self._info: EngineInfo | None = None
        self.tokenizer: Any = None

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> "Engine":
        if self._loop is not None:
            return self
        runtime.prepare_environment(self.device)
        from . import seam

        seam.check_vllm_version()
        from transformers import AutoConfig, AutoTokenizer

        hf_config = AutoConfig.from_pretrained(self.model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        t0 = time.perf_counter()
        self._loop = EngineLoop(self._build_vllm_engine)
        try:
            self._loop.start()
        except BaseException:
            self._loop = None
            raise
        startup = time.perf_counter() - t0
        self._info = self._make_info(hf_config, startup)
        logger.info("vLLM engine ready in %.1f s: %s", startup, self._info)
        return self

    def close(self) -> None:
        if self._loop is not None:
            self._loop.shutdown()
            self._loop = None

    def __enter__(self) -> "Engine":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _build_vllm_engine(self) -> Any:
        from vllm.engine.arg_utils import EngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.llm_engine import LLMEngine

        kwargs: dict[str, Any] = dict(
            model=str(self.model_path),
            dtype=self.dtype,
            enforce_eager=self.enforce_eager,
            max_num_seqs=self.config.max_num_seqs,
            seed=self.config.seed,
            enable_prefix_caching=self.config.enable_prefix_caching,
            disable_log_stats=True,
        )
        if self.config.max_model_len:
            kwargs["max_model_len"] = self.config.max_model_len
        if self.device == "cuda":
            kwargs["gpu_memory_utilization"] = self.config.gpu_memory_utilization
        if self.attention_backend:
            kwargs["attention_config"] = {"backend": self.attention_backend}
        kwargs.update(self.config.engine_kwargs)
        return LLMEngine.from_engine_args(EngineArgs(**kwargs), usage_context=UsageContext.LLM_CLASS)

    def _make_info(self, hf_config: Any, startup: float) -> EngineInfo:
        import torch
        import transformers
        from importlib import metadata

        from .seam import installed_vllm_version

        try:
            own = metadata.version("causalboard")
        except metadata.PackageNotFoundError:
            own = "source"
        max_len = self._loop.call(lambda e: e.model_config.max_model_len).result()
        name = BUNDLED_MODEL_NAME if self.model_path == BUNDLED_MODEL_PATH else self.model_path.name
        return EngineInfo(
            model=name,
            model_path=str(self.model_path),
            architecture=(hf_config.architectures or ["?"])[0],
            num_layers=int(hf_config.num_hidden_layers),
            hidden_size=int(hf_config.hidden_size),
            vocab_size=int(hf_config.vocab_size),
            max_model_len=int(max_len),
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

    # ---- tokens ----------------------------------------------------------------------------
    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """One display string per token id (the decoded text of that single token)."""
        return [self.tokenizer.decode([i]) for i in ids]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    # ---- generation ------------------------------------------------------------------------
    def _prepare(self, prompt: Prompt, params: GenerationParams) -> tuple[str | None, list[int], Any]:
        """Validate and build the vLLM request. Raises `SpecError` naming the field."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

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
        sp = SamplingParams(
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            seed=params.seed,
            logprobs=params.logprobs,
            stop=list(params.stop) or None,
            ignore_eos=params.ignore_eos,
            output_kind=RequestOutputKind.DELTA,
        )
        return text, ids, sp

    def validate(self, prompt: Prompt, params: GenerationParams) -> list[int]:
        """Check a request without submitting it; returns the prompt's token ids.
        Raises `SpecError` naming the offending field."""
        return self._prepare(prompt, params)[1]

    def _new_id(self) -> str:
        return f"cb-{next(self._ids)}-{uuid.uuid4().hex[:8]}"

    def _require_loop(self) -> EngineLoop:
        if self._loop is None:
            raise EngineDeadError("the engine is not started (call start() or use `with Engine()`)")
        return self._loop

    def generate(self, prompts: Prompt | Sequence[Prompt], params: GenerationParams | None = None) -> Any:
        """Generate for one prompt (returns a `Generation`) or a list of prompts (returns a list),
        all submitted together so vLLM batches them. Blocks until all are finished."""
        params = params or GenerationParams()
        single = isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int))
        batch = [prompts] if single else list(prompts)
        loop = self._require_loop()
        prepared = [self._prepare(p, params) for p in batch]  # validate all before submitting any
        jobs = []
        for text, ids, sp in prepared:
            rid = self._new_id()
            sink = _QueueSink(functools.partial(_delta_from_output, top_k=params.logprobs))
            loop.submit(rid, {"prompt_token_ids": ids}, sp, sink)
            jobs.append((Generation(rid, text, ids), sink))
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

    async def astream(self, prompt: Prompt, params: GenerationParams | None = None) -> AsyncIterator[GenerationDelta]:
        """Yield deltas as the engine produces them. Leaving the iterator early (or cancelling
        the task) aborts the request in the engine."""
        async for delta in self._astream(prompt, params or GenerationParams(), self._new_id()):
            yield delta

    async def _astream(self, prompt: Prompt, params: GenerationParams, rid: str) -> AsyncIterator[GenerationDelta]:
        loop = self._require_loop()
        _, ids, sp = self._prepare(prompt, params)
        sink = _AsyncSink(asyncio.get_running_loop(), functools.partial(_delta_from_output, top_k=params.logprobs))
        loop.submit(rid, {"prompt_token_ids": ids}, sp, sink)
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

    async def agenerate(self, prompt: Prompt, params: GenerationParams | None = None) -> Generation:
        """Async `generate` for one prompt."""
        params = params or GenerationParams()
        rid = self._new_id()
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenize(prompt) if isinstance(prompt, str) else [int(i) for i in prompt]
        gen = Generation(rid, text, ids)
        async for delta in self._astream(prompt, params, rid):
            gen.extend(delta)
        return gen
