"""`DynamicControl`: the engine's dynamic-steering methods (mixed into `Engine`).

Probes live in a registry on every worker (`register_probe` / `delete_probe` / `list_probes`);
global policies are kept here and travel with every request (`set_dynamic_policies`); a request
adds its own with `generate(..., dynamic=DynamicRequest(...))`. `dynamic_status()` gathers every
worker's dynamic state with the applied-action checksums compared within each pipeline stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from engine_ext.dynamic.probe_fit import fit, midpoint_threshold
from engine_ext.dynamic.specs import MAX_POLICIES, DynamicRequest, Policy, Probe
from engine_ext.errors import SpecError
from engine_ext.specs import canonical_json

#: probes a server holds at most
MAX_PROBES = 256


class DynamicControl:
    """Dynamic steering on an `Engine` (uses its `_rpc`, `info`, `topology`, `_named`, `generate`,
    `intervention_status`)."""

    def _init_dynamic(self) -> None:
        self._probes: dict[str, Probe] = {}
        self._dyn_global: tuple[Policy, ...] = ()

    # ---- probes -----------------------------------------------------------------------------
    def register_probe(self, probe: Probe | dict) -> Probe:
        """Register (or replace) a probe on every worker. A dict takes `Probe.make`'s fields."""
        if isinstance(probe, dict):
            probe = Probe.make(**probe)
        probe.check(self.info.num_layers, self.info.hidden_size)
        if self.topology.pipeline_parallel_size > 1:
            raise SpecError("probe", "dynamic steering needs pipeline_parallel_size 1 (a probe and the sites it "
                                     "steers must be on one stage)")
        if probe.name not in self._probes and len(self._probes) >= MAX_PROBES:
            raise SpecError("name", f"at most {MAX_PROBES} probes")
        self._rpc("cb_dynamic", "set_probe", canonical_json(probe.to_json()))
        self._probes[probe.name] = probe
        return probe

    def delete_probe(self, name: str) -> bool:
        if any(p.probe == name for p in self._dyn_global):
            raise SpecError("name", f"probe {name!r} is used by a global dynamic policy; remove the policy first")
        found = any(self._rpc("cb_dynamic", "delete_probe", name))
        self._probes.pop(name, None)
        return found

    def list_probes(self) -> list[dict]:
        return [p.summary() for p in sorted(self._probes.values(), key=lambda p: p.name)]

    def get_probe(self, name: str) -> Probe | None:
        return self._probes.get(name)

    def probe_values(self, prompts: Sequence[str], site: Any, positions: Any = "last_prompt") -> np.ndarray:
        """Captured stream values `[n, hidden]` (fp32) of `prompts` at `site` and `positions`
        (every selected position of every prompt is one row)."""
        from engine_ext.dynamic.specs import _site
        from engine_ext.specs import Capture, Interventions
        from engine_ext.generation import GenerationParams

        s = _site(site, "site")
        if not prompts:
            raise SpecError("prompts", "give at least one prompt")
        spec = Interventions(capture=Capture.make([str(s)], positions))
        gens = self.generate(list(prompts), GenerationParams(max_tokens=1), spec)
        rows = []
        for k, g in enumerate(gens):
            if g.intervention is None or g.intervention.voided:
                raise SpecError(f"prompts[{k}]", "capture failed: " + "; ".join(g.intervention.errors if g.intervention else []))
            rows += [v for key, v in sorted(g.captures.items(), key=lambda kv: kv[0].position)]
        return np.stack(rows).astype(np.float32)

    def fit_probe(self, name: str, site: Any, positive: Sequence[str], negative: Sequence[str], *,
                  method: str = "mean_diff", positions: Any = "last_prompt", l2: float = 1e-2,
                  register: bool = True, description: str = "") -> dict:
        """Build a probe from two prompt sets: capture `site` at `positions` for each, fit
        (`probe_fit.fit`), register it (unless `register=False`). Returns `{"probe": Probe,
        "threshold": midpoint score, "positive_scores": [...], "negative_scores": [...]}`."""
        pos = self.probe_values(positive, site, positions)
        neg = self.probe_values(negative, site, positions)
        kind, w, b = fit(pos, neg, method, l2)
        probe = Probe.make(name, site, kind=kind, direction=w if kind == "direction" else None,
                           weights=w if kind != "direction" else None, bias=b if kind != "direction" else None,
                           description=description or f"{method} fit on {len(positive)} vs {len(negative)} prompts")
        if register:
            self.register_probe(probe)
        return {"probe": probe, "threshold": midpoint_threshold(pos, neg, w, b),
                "positive_scores": [float(v) for v in (pos @ w + b)], "negative_scores": [float(v) for v in (neg @ w + b)]}

    # ---- policies ---------------------------------------------------------------------------
    def _check_policy(self, policy: Policy, field_name: str) -> None:
        policy.check(self.info.num_layers, self.info.hidden_size, self._probes.get, self._named.get, field_name)

    def set_dynamic_policies(self, policies: Sequence[Policy | dict]) -> None:
        """Replace the global dynamic policies (they apply to every request submitted from now
        on, before the request's own, unless it sets `use_global=False`)."""
        if len(policies) > MAX_POLICIES:
            raise SpecError("policies", f"at most {MAX_POLICIES} global policies")
        pols = tuple(Policy.from_json(p, f"policies[{k}]") for k, p in enumerate(policies))
        for k, p in enumerate(pols):
            self._check_policy(p, f"policies[{k}]")
        self._dyn_global = pols

    @property
    def dynamic_policies(self) -> tuple[Policy, ...]:
        return self._dyn_global

    def _dynamic_wire(self, dynamic: DynamicRequest | dict | None) -> dict | None:
        """The wire data of a request's dynamic steering (global + its own policies), or None."""
        if isinstance(dynamic, dict):
            dynamic = DynamicRequest.make(**dynamic)
        if dynamic is None:
            dynamic = DynamicRequest()
        for k, p in enumerate(dynamic.policies):
            self._check_policy(p, f"dynamic.policies[{k}]")
        if dynamic.gates is not None:
            dynamic.gates.check(self.info.num_layers, self.info.hidden_size)
            if dynamic.gates.probes() and self.topology.pipeline_parallel_size > 1:
                raise SpecError("steering", "probe-triggered gates need pipeline_parallel_size 1 (a probe and the "
                                            "sites it steers must be on one stage)")
        if not dynamic.policies and not (dynamic.use_global and self._dyn_global) and dynamic.gates is None:
            return None
        if len(dynamic.policies) + (len(self._dyn_global) if dynamic.use_global else 0) > MAX_POLICIES:
            raise SpecError("dynamic.policies", f"at most {MAX_POLICIES} policies per request, global ones included")
        return dynamic.wire(self._dyn_global)

    # ---- status -----------------------------------------------------------------------------
    def dynamic_status(self, intervention_status: dict | None = None) -> dict:
        """Every worker's dynamic state (probes, requests, engaged requests, its action count and
        checksum) and `determinism`: `{consistent: true, action_count}` or `{consistent: false,
        checksums: {rank: hex}}` (compared within each pipeline stage). `intervention_status`:
        an `intervention_status()` answer to reuse (no second call to the workers)."""
        st = intervention_status if intervention_status is not None else self.intervention_status()
        workers = []
        for w in st["workers"]:
            d = dict(w.get("dynamic") or {})
            d.update(tp_rank=w.get("tp_rank", 0), pp_rank=w.get("pp_rank", 0), action_count=w["action_count"],
                     action_checksum=w["action_checksum"])
            workers.append(d)
        det = st["determinism"]
        if det["consistent"]:
            determinism = {"consistent": True, "action_count": det["action_count"]}
        else:
            checksums = det.get("checksums") or {rank: hx for stage in det["mismatches"].values() for rank, hx in stage.items()}
            determinism = {"consistent": False, "checksums": checksums}
        return {"probes": self.list_probes(), "policies": [p.to_api() for p in self._dyn_global],
                "workers": workers, "determinism": determinism}
