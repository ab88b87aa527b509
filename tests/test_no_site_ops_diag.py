"""The site-ops diagnostic (`benchmarks/diag/no_site_ops/sitecustomize.py`) leaves out exactly the
site ops it names, only when asked, on the real engine (CPU): with `all` a strong steering vector
at any site changes nothing; with `merged` one at `post_attn` still changes the tokens while one
at `mlp_out` or at layer 1's `pre_attn` does not; without the variable the engine is untouched."""

from __future__ import annotations

import os

import pytest

from tests.conftest import REPO, script_results

pytestmark = pytest.mark.engine  # starts engines of its own

SCRIPT = """
import json, sys
import numpy as np
from engine_ext import Engine, GenerationParams
from engine_ext.specs import Interventions, Steer
eng = Engine(model=sys.argv[1], device="cpu", multiprocess=False).start()
H = eng.info.hidden_size
vec = (np.random.default_rng(0).standard_normal(H) * 50).astype(np.float32)
params = GenerationParams(max_tokens=6)
prompt = "The capital of France is"
out = {"plain": eng.generate(prompt, params).token_ids}
for site in ("L1.pre_attn", "L1.post_attn", "L1.mlp_out"):
    out[site] = eng.generate(prompt, params, Interventions(steer=(Steer.make([site], vec),))).token_ids
print("RESULT " + json.dumps(out))
eng.close()
"""


def _env(mode: str | None) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'benchmarks/diag/no_site_ops'}:{REPO}",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("CB_DIAG_NO_SITE_OPS", None)
    if mode:
        env["CB_DIAG_NO_SITE_OPS"] = mode
    return env


def test_the_site_ops_diagnostic_leaves_out_what_it_names_only_when_asked():
    (normal, err), (left_out, err_all), (merged, err_merged) = script_results(SCRIPT, [_env(None), _env("all"), _env("merged")])
    assert "site ops left out" not in err
    assert all(normal[s] != normal["plain"] for s in ("L1.pre_attn", "L1.post_attn", "L1.mlp_out")), normal
    assert "site ops left out (all)" in err_all
    assert left_out["plain"] == normal["plain"]
    assert all(left_out[s] == normal["plain"] for s in ("L1.pre_attn", "L1.post_attn", "L1.mlp_out")), left_out
    assert "site ops left out (merged)" in err_merged
    assert merged["plain"] == normal["plain"] and merged["L1.post_attn"] == normal["L1.post_attn"]
    assert merged["L1.mlp_out"] == normal["plain"] and merged["L1.pre_attn"] == normal["plain"]
