"""Merged sites (the default, one op call for a layer's `mlp_out`, `post_block` and the next
layer's `pre_attn`; `CAUSALBOARD_MERGED_SITES=0` turns them off) give exactly what the five calls per layer give, on the real CPU
engine: steering at every hook of the first, a middle and the last layer, captures of every site
at every prompt position, patches from a stored run at `post_block` and at the next layer's
`pre_attn` (the merged call's pair sites), and a mean-ablation at `mlp_out` — tokens, scores and
captured bytes bit for bit. Each setting runs in its own process (the seam reads it at import)."""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import REPO, script_results

pytestmark = pytest.mark.engine  # starts engines of its own

SCRIPT = r"""
import hashlib, json, sys
import numpy as np
from engine_ext import Engine, GenerationParams
from engine_ext.specs import Capture, Interventions, Patch, RunSource, Steer
from engine_ext.worker import seam
eng = Engine(model=sys.argv[1], device="cpu", multiprocess=False).start()
L, H = eng.info.num_layers, eng.info.hidden_size
vec = (np.random.default_rng(0).standard_normal(H) * 4).astype(np.float32)
params = GenerationParams(max_tokens=5, logprobs=3)
clean = "The capital of France is"
out = {"merged": seam.MERGED_SITES}
hooks = ("pre_attn", "post_attn", "mlp_in", "mlp_out", "post_block")
for layer in (0, L // 2, L - 1):
    for hook in hooks:
        g = eng.generate(clean, params, Interventions(steer=(Steer.make([f"L{layer}.{hook}"], vec),)))
        out[f"steer L{layer}.{hook}"] = [g.token_ids, g.logprobs]
sites = [f"L{l}.{h}" for l in range(L) for h in hooks]
g = eng.generate(clean, GenerationParams(max_tokens=1), Interventions(capture=Capture.make(sites, "all_prompt", keep_as="clean-run")))
cap = g.intervention.captures
out["captures"] = {str(k): hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest() for k, v in sorted(cap.items())}
corrupt = list(eng.tokenize(clean))
corrupt[2] = (corrupt[2] + 7) % eng.info.vocab_size  # one token changed
n = len(corrupt)
for site in (f"L{L // 2}.post_block", f"L{L // 2 + 1}.pre_attn", f"L{L // 2}.mlp_out"):
    cells = [Interventions(patch=(Patch.make(site, [p], RunSource("clean-run", (p,))),), score_token_ids=(5, 9)) for p in range(n)]
    gens = eng.generate([corrupt] * n, GenerationParams(max_tokens=1), cells)
    out[f"patch {site}"] = [sorted(g.scores[0].items()) for g in gens]
print("RESULT " + json.dumps(out))
eng.close()
"""


def _run(*merged_modes: bool) -> list[dict]:
    """The script once per mode, the processes side by side."""
    envs = [{**os.environ, "PYTHONPATH": str(REPO), "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
             "CAUSALBOARD_MERGED_SITES": "1" if merged else "0"} for merged in merged_modes]
    return [result for result, _ in script_results(SCRIPT, envs)]


def test_merged_sites_give_exactly_what_one_call_per_site_gives():
    merged, separate = _run(True, False)
    assert merged.pop("merged") is True and separate.pop("merged") is False
    assert merged.keys() == separate.keys()
    for key in separate:
        assert merged[key] == separate[key], key
    # the interventions did something (not a comparison of unchanged runs)
    assert len({json.dumps(v) for k, v in separate.items() if k.startswith("steer")}) > 5
    varied = {k: len({json.dumps(c) for c in separate[k]}) for k in separate if k.startswith("patch")}
    assert sum(v > 1 for v in varied.values()) >= 2, varied
