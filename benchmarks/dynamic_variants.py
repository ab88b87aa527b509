"""The dynamic-steering workloads the cost benchmarks share (`dynamic_bench.py` on the GPU,
`dynamic_planner_bench.py` and `diag/dynamic_host.py` on the host): one probe reading
`L{L/2}.post_block` and one policy per request steering `L{L/2 - 1}.post_attn` with `vector`.

  vanilla       no dynamic steering;
  monitor_only  a threshold policy that never fires (the probe scored every step, no action);
  threshold_on  a threshold policy engaged from the first generated token (one action per
                request and step, the payload never changes);
  proportional  proportional control (an action whose scale changes every step).
"""
from __future__ import annotations

import numpy as np

from engine_ext.dynamic.specs import DynamicRequest, Policy

PROBE = "bench-probe"


def probe_site(num_layers: int) -> str:
    return f"L{num_layers // 2}.post_block"


def steer_sites(num_layers: int) -> list[str]:
    return [f"L{max(num_layers // 2 - 1, 0)}.post_attn"]


def variants(num_layers: int, vector: np.ndarray) -> dict[str, DynamicRequest | None]:
    steer = steer_sites(num_layers)
    return {
        "vanilla": None,
        "monitor_only": DynamicRequest.make([Policy.make(probe=PROBE, sites=steer, vector=vector, on=1e30)]),
        "threshold_on": DynamicRequest.make([Policy.make(probe=PROBE, sites=steer, vector=vector, on=-1e30)]),
        "proportional": DynamicRequest.make([Policy.make(probe=PROBE, mode="proportional", sites=steer, vector=vector,
                                                         target=0.0, gain=1e-3, min_scale=-5.0, max_scale=5.0,
                                                         initial_scale=0.5)]),
    }


def static_steer(num_layers: int, vector: np.ndarray):
    """The control: `vector` added statically at `steer_sites` on every generated token (what an
    engaged policy applies), no dynamic steering."""
    from engine_ext.specs import Interventions, Steer

    return Interventions(steer=(Steer.make(steer_sites(num_layers), vector, phase="decode"),))


def in_process_engine(model: str | None, device: str):
    """A started engine whose forward runs in this process (the diagnostics time or profile it
    there): the bundled model unless `model`; on a GPU with CUDA graphs, as `dynamic_bench.py`."""
    from engine_ext import Engine

    kw = {"model": model} if model else {}
    if device == "cuda":
        kw.update(enforce_eager=False, max_model_len=4096, gpu_memory_utilization=0.8)
    return Engine(device=device, multiprocess=False, **kw).start()


def workload(eng, batch: int, prompt_seed: int) -> tuple[dict[str, DynamicRequest | None], np.ndarray, list[list[int]]]:
    """Register the probe (`PROBE`, a random direction at `probe_site`) on `eng` and return the
    variants, their steering vector and `batch` distinct random 16-token prompts (`prompt_seed`)."""
    import random

    from engine_ext.dynamic.specs import Probe

    L, H = eng.info.num_layers, eng.info.hidden_size
    rng = np.random.default_rng(0)
    eng.register_probe(Probe.make(PROBE, probe_site(L), direction=rng.standard_normal(H)))
    v = (rng.standard_normal(H) * 0.01).astype(np.float32)
    prng = random.Random(prompt_seed)
    vocab = eng.info.vocab_size
    lo, hi = (1000, min(vocab - 1, 128000)) if vocab > 2000 else (4, vocab - 1)
    prompts = [[prng.randrange(lo, hi) for _ in range(16)] for _ in range(batch)]
    return variants(L, v), v, prompts
