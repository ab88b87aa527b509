"""Fast tier (no engine): composing a request's plan hashes a steering vector once for all the
sites one steering entry names (`planner._op_identity`'s per-composition memo), and the plan is
the one composed without the memo: the same slot keys, so the same slots are shared."""

from __future__ import annotations

import numpy as np
import torch

from engine_ext.program import ModelDims, PromptInfo, WorkerProgram, compile_program, program_to_extra_args
from engine_ext.specs import Interventions, Steer
from engine_ext.worker import planner
from engine_ext.worker.intervention_op import SiteBuffers
from engine_ext.worker.slots import SlotTable
from engine_ext.worker.state import EXTRA_ARGS_KEY

L, H = 8, 16


def _program(steers: tuple[Steer, ...]) -> WorkerProgram:
    import json

    prog = compile_program(Interventions(steer=steers), PromptInfo(list(range(6)), None, None, 16), ModelDims(L, H, 100, 0.02),
                           key="k", named_vector_dims=lambda n: None)
    return WorkerProgram.parse(json.loads(program_to_extra_args(prog)[EXTRA_ARGS_KEY]), named_vector=lambda n: None,
                               source_value=lambda *a: None, source_mean=lambda *a: None, owns_site=lambda s: True)


def _slots() -> SlotTable:
    return SlotTable(SiteBuffers(num_sites=3 * L, max_rows=8, max_slots=64, max_capture_rows=4, hidden=H,
                                 device=torch.device("cpu"), dtype=torch.float32, max_gate_rows=2, max_clamp_rows=2,
                                 max_dim_rows=2))


def test_one_hash_per_vector_and_scale_and_the_same_slot_keys(monkeypatch):
    rng = np.random.default_rng(0)
    v, w = rng.standard_normal(H).astype(np.float32), rng.standard_normal(H).astype(np.float32)
    steers = (Steer.make([f"L{l}.post_block" for l in range(L)], v),  # one vector at 8 sites
              Steer.make(["L1.post_block", "L2.post_block"], v, scale=2.0),  # the same vector, another scale
              Steer.make(["L3.post_block"], w, positions=[2]))
    calls = []
    digest = planner._digest
    monkeypatch.setattr(planner, "_digest", lambda *a: calls.append(1) or digest(*a))
    prog = _program(steers)
    slots = _slots()
    plan = planner.RequestPlan.build("k", 6, prog, [], slots)
    assert len(calls) == 3  # (v, 1.0), (v, 2.0), (w, 1.0): one hash each, not one per site
    # each op's identity is what it is computed alone
    for op in prog.adds:
        alone = ("vec", digest(np.asarray(op.vec, "<f4"), np.asarray([op.scale], "<f8")))
        assert op._identity == alone
    # a second request with the same program shares every slot of the first
    plan2 = planner.RequestPlan.build("k2", 6, _program(steers), [], slots)
    assert sorted(plan2.held) == sorted(plan.held)
