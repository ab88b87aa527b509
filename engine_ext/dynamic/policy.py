"""The policies' decision rule: a pure function of (state, score), shared by the worker and the
test oracle, so both decide exactly alike.

`PolicyState.decide(score)` is called once per scored position `p` (after the forward that
computed `p`, in position order) and returns the scale the policy's action has at position
`p + 1` (0.0: not engaged, no action). All arithmetic is Python floats (IEEE double) on
rank-identical inputs, so every tensor-parallel rank takes the same decisions.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine_ext.dynamic.specs import Policy


@dataclass
class PolicyState:
    policy: Policy
    engaged: bool = False
    #: positions steered so far in the current engagement (threshold)
    held: int = 0
    #: current scale (proportional)
    scale: float = 0.0
    latched: bool = False

    def __post_init__(self) -> None:
        if self.policy.mode == "proportional":
            self.scale = float(self.policy.initial_scale)

    @classmethod
    def start(cls, policy: Policy, latched: bool = False) -> "PolicyState":
        """A fresh state; `latched` (a conversation latched earlier) starts engaged."""
        st = cls(policy)
        if latched and policy.mode == "threshold":
            st.engaged = st.latched = True
        return st

    def current_scale(self) -> float:
        """The scale applied at the next position (0.0 = no action)."""
        if self.policy.mode == "proportional":
            return self.scale
        return self.policy.scale if self.engaged else 0.0

    def threshold(self) -> float:
        """The threshold the score is compared with now (for traces): `on` while released,
        `off` while engaged; the target for proportional control."""
        if self.policy.mode == "proportional":
            return self.policy.target
        return self.policy.release_at if self.engaged else self.policy.on

    def holds(self, score: float) -> bool:
        """Would `decide(score)` leave a threshold policy as it is (engaged stays engaged, released
        stays released; it is then exactly `hold()`)? False for proportional control (every score
        moves its scale) and whenever the policy would flip."""
        pol = self.policy
        if pol.mode == "proportional":
            return False
        if self.engaged:
            return not (pol.latch == "none" and not self.latched and self.held + 1 >= pol.min_hold
                        and score < pol.release_at)
        return not score >= pol.on

    def hold(self) -> float:
        """`decide(score)` for a score that `holds`: the state holds (an engaged policy counts one
        more steered position). Returns the scale at the next position."""
        if self.engaged:
            self.held += 1
        return self.current_scale()

    def decide(self, score: float) -> float:
        """Update with the score at position p; return the scale at position p + 1."""
        pol = self.policy
        if pol.mode == "proportional":
            s = self.scale + pol.gain * (pol.target - float(score))
            self.scale = min(pol.max_scale, max(pol.min_scale, s))
            return self.scale
        if self.engaged:
            self.held += 1
            if (pol.latch == "none" and not self.latched and self.held >= pol.min_hold and score < pol.release_at):
                self.engaged, self.held = False, 0
        elif score >= pol.on:
            self.engaged, self.held = True, 0
            if pol.latch != "none":
                self.latched = True
        return self.current_scale()
