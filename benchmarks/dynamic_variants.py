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
