"""The policies' decision rule for many policy instances at once, as tensor operations: the
building block for taking dynamic steering's decisions on the device (no host round trip between
a step's scores and the next step's scales; docs/performance.md, "Decisions on the device").
Used by `device_decisions` for the policies of repeated steady steps: the reference (and the CPU
implementation) of the Triton kernel in `device_kernels`, which must equal it bit for bit.

`PolicyTable.decide(slots, scores)` equals `policy.PolicyState.decide(score)` applied to each
slot's state in turn, bit for bit: float64 arithmetic (a fp32 score is exact in float64, Python
floats are IEEE doubles), one torch operation per arithmetic step (no fused multiply-add), the
same comparisons (NaN compares false in both), and Python's `min`/`max` argument order (which
returns the first argument when a comparison with NaN fails) spelled out with `torch.where`.
"""

from __future__ import annotations

import torch

from engine_ext.dynamic.policy import PolicyState

THRESHOLD, PROPORTIONAL = 0, 1


class PolicyTable:
    """`capacity` policy instances (one per (request, policy)), constants and state, on `device`."""

    def __init__(self, capacity: int, device: torch.device | str = "cpu"):
        f64 = dict(dtype=torch.float64, device=device)
        self.capacity = capacity
        self.mode = torch.zeros(capacity, dtype=torch.int8, device=device)
        self.on = torch.zeros(capacity, **f64)
        self.release_at = torch.zeros(capacity, **f64)
        self.min_hold = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.engage_scale = torch.zeros(capacity, **f64)
        self.latch_none = torch.ones(capacity, dtype=torch.bool, device=device)
        self.gain = torch.zeros(capacity, **f64)
        self.target = torch.zeros(capacity, **f64)
        self.min_scale = torch.zeros(capacity, **f64)
        self.max_scale = torch.zeros(capacity, **f64)
        # state
        self.engaged = torch.zeros(capacity, dtype=torch.bool, device=device)
        self.held = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.latched = torch.zeros(capacity, dtype=torch.bool, device=device)
        self.scale = torch.zeros(capacity, **f64)

    def to(self, device: torch.device | str) -> "PolicyTable":
        """The same table on `device` (fill it on the CPU, then move it: one copy per tensor)."""
        for name, value in list(vars(self).items()):
            if isinstance(value, torch.Tensor):
                setattr(self, name, value.to(device))
        return self

    def load(self, slot: int, st: PolicyState) -> None:
        """Put a policy's constants and its current state into `slot` (a host-to-device write;
        also how a request rescheduled from an earlier position gets its recorded state back)."""
        p = st.policy
        self.mode[slot] = PROPORTIONAL if p.mode == "proportional" else THRESHOLD
        self.on[slot], self.release_at[slot] = float(p.on), float(p.release_at)
        self.min_hold[slot], self.engage_scale[slot] = int(p.min_hold), float(p.scale)
        self.latch_none[slot] = p.latch == "none"
        self.gain[slot], self.target[slot] = float(p.gain), float(p.target)
        self.min_scale[slot], self.max_scale[slot] = float(p.min_scale), float(p.max_scale)
        self.engaged[slot], self.held[slot] = bool(st.engaged), int(st.held)
        self.latched[slot], self.scale[slot] = bool(st.latched), float(st.scale)

    def state(self, slot: int) -> tuple[bool, int, bool, float]:
        """(engaged, held, latched, scale) of `slot`, as `PolicyState` holds them."""
        return (bool(self.engaged[slot]), int(self.held[slot]), bool(self.latched[slot]), float(self.scale[slot]))

    def decide(self, slots: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Update the states of `slots` (distinct) with one score each (any float dtype); return
        the scale each policy's action has at the next position (float64; 0: no action)."""
        x = scores.to(torch.float64)
        thr = self.mode[slots] == THRESHOLD
        # threshold with hysteresis (PolicyState.decide, engaged then released branch)
        eng, held, lat = self.engaged[slots], self.held[slots], self.latched[slots]
        held1 = torch.where(eng, held + 1, held)
        release = eng & self.latch_none[slots] & ~lat & (held1 >= self.min_hold[slots]) & (x < self.release_at[slots])
        engage = ~eng & (x >= self.on[slots])
        eng2 = (eng & ~release) | engage
        held2 = torch.where(release | engage, torch.zeros_like(held1), held1)
        lat2 = lat | (engage & ~self.latch_none[slots])
        zero = torch.zeros_like(x)
        thr_scale = torch.where(eng2, self.engage_scale[slots], zero)
        # proportional control: s = scale + gain * (target - score), then min(max_scale, max(min_scale, s))
        s = self.scale[slots] + self.gain[slots] * (self.target[slots] - x)
        lo, hi = self.min_scale[slots], self.max_scale[slots]
        s = torch.where(s > lo, s, lo)  # Python's max(lo, s)
        s = torch.where(s < hi, s, hi)  # Python's min(hi, s)
        self.engaged[slots] = torch.where(thr, eng2, eng)
        self.held[slots] = torch.where(thr, held2, held)
        self.latched[slots] = torch.where(thr, lat2, lat)
        self.scale[slots] = torch.where(thr, self.scale[slots], s)
        return torch.where(thr, thr_scale, s)
