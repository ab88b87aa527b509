"""The record of a steady decode step that the next step may repeat (`Replay`), built by the
dynamic worker at the end of a step planned request by request (`worker.DynamicWorker`) and used
by its repeat (`repeat_steps.RepeatedSteps._replay_begin` / `_replay_finish`) and by decisions on the device
(`device_decisions`)."""

from __future__ import annotations

import zlib
from collections import Counter
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the worker imports this module
    from engine_ext.dynamic.worker import DynamicWorker, _ScorePlan


def requests_decode_only(qsl, req_ids) -> bool:
    """Is every request of the step one decode row (query start locations 0, 1, ..., n)?"""
    n = len(req_ids)
    return n > 0 and len(qsl) == n + 1 and int(qsl[0]) == 0 and int(qsl[n]) == n


def proportional_action_crc(key: str, site_tags: list[str], vcrc: int, s32_bytes: bytes) -> int:
    """The checksum crc of a proportional policy's action, as `DynamicWorker._action_plan` names it
    (no base under it): the request key and, per site (`"site:"`), the payload's crc (`f32(scale)`'s
    4 bytes continued from the vector's crc, `_Policy.parts`)."""
    tail = f"{zlib.crc32(s32_bytes, vcrc):08x}"
    return zlib.crc32("|".join([key] + [tag + tail for tag in site_tags]).encode())


class ProportionalCrcs:
    """`proportional_action_crc` for a fixed list of proportional windows, all at once per step:
    `crcs(s32)` gives window k's crc for the scale `s32[k]` (float32), equal to
    `proportional_action_crc(key_k, site_tags_k, vcrc_k, s32[k]'s 4 little-endian bytes)`
    (`tests/test_dynamic_crc_bulk.py`). The constant part of each window's text (`key|tag`) is
    folded into a crc once, here; per step only the 4 payload bytes, their 8 hex digits and the
    rest of the text are fed to zlib (a crc continues over concatenated data), instead of building
    and encoding each window's string and converting each scale on its own."""

    __slots__ = ("_windows",)

    def __init__(self, windows: list[tuple[str, list[str], int]]):
        """`windows`: `(request key, ["site:" in site order], vector crc)` per window."""
        out = []
        for key, tags, vcrc in windows:
            if tags:
                head = zlib.crc32(f"{key}|{tags[0]}".encode())
                rest = [f"|{t}".encode() for t in tags[1:]]
            else:
                head, rest = zlib.crc32(key.encode()), None
            out.append((head, rest, vcrc))
        self._windows = out

    def __len__(self) -> int:
        return len(self._windows)

    def crcs(self, s32: np.ndarray, only=None) -> list[int]:
        """The crcs for the scales `s32` (one per window, cast to float32 as `np.float32(x)` would);
        `only`: the window indices to compute (in that order; default: all)."""
        b = np.asarray(s32).astype("<f4").tobytes()
        crc32 = zlib.crc32
        w = self._windows
        out = []
        for k in (range(len(w)) if only is None else only):
            head, rest, vcrc = w[k]
            if rest is None:  # no site: the key's crc alone
                out.append(head)
                continue
            tail = b"%08x" % crc32(b[4 * k: 4 * k + 4], vcrc)
            c = crc32(tail, head)
            for r in rest:
                c = crc32(tail, crc32(r, c))
            out.append(c)
        return out


def proportional_scales(cur: np.ndarray, gain: np.ndarray, target: np.ndarray, score: np.ndarray,
                        min_scale: np.ndarray, max_scale: np.ndarray) -> np.ndarray:
    """`PolicyState.decide` of proportional policies on float64 arrays, bit for bit:
    `min(max_scale, max(min_scale, scale + gain * (target - score)))`, one numpy operation per
    arithmetic step and Python's min/max argument order (NaN: the limit)."""
    s = cur + gain * (target - score)
    s = np.where(s > min_scale, s, min_scale)  # max(min_scale, s)
    return np.where(s < max_scale, s, max_scale)  # min(max_scale, .)


def threshold_flip_points(st) -> tuple[float, float]:
    """(lo, hi) of a threshold policy's state (`policy.PolicyState`): a score below `lo` or at or
    above `hi` may flip it (NaN: no score does; NaN scores never flip it). Within a minimum hold a
    low score does not release it: such scores are checked exactly by the caller's slow path, so
    `lo` may flag more than flips, never less."""
    pol = st.policy
    if st.engaged:
        return (pol.release_at if pol.latch == "none" and not st.latched else np.nan), np.nan
    return np.nan, pol.on


class Replay:
    """A steady decode step that the next step may repeat (`repeat_steps.RepeatedSteps._replay_begin`): every
    dynamic request of the batch one row, one policy (no gates, one probe site), its monitor row
    freshly handed out; a threshold policy's decision taken ahead and held, a proportional one
    with no static steering under it. The next step repeats it when it has
    the same requests on the same rows, each one position further, the same slots under its
    writes (the static plan's) and no capture row taken where its monitors go; the request set,
    the probes (`_version`) and the rejection count did not change. Its threshold decisions are
    then checked at once (`lo`, `hi`: a score below `lo` or at or above `hi` may flip the policy
    and makes the step fall back to the exact path; NaN: never), its proportional ones taken at
    once (`repeat_steps.RepeatedSteps._replay_proportional`). `dev`: the chain's decisions taken on the device
    instead (`device_decisions.DeviceDecisions`, opt-in)."""

    def __init__(self) -> None:
        self.armed = False
        self.sp: "_ScorePlan | None" = None
        self.work: list | None = None
        self.picks = np.zeros(0, np.int64)

    @classmethod
    def build(cls, w: "DynamicWorker", ctx: tuple, windows: list[list], hs: np.ndarray) -> "Replay | None":
        req_ids, qsl, nc, snap, n_cap0, rejected0, version0 = ctx
        if w.rejected != rejected0 or w._version != version0 or len(w._monitors) != len(windows) or w._gated:
            return None
        owns_site = w.st.owns_site
        drs, w0, lo, hi, m_sites = [], [], [], [], []
        ahead_idx, ahead_scales = [], []  # threshold windows (decisions taken ahead)
        act_idx, act_crcs, act_prop = [], [], []  # windows that act, in window order
        w_rows: list[int] = []
        w_sites: list[int] = []
        prop: list[tuple] = []  # proportional windows: (request, state, vector crc, ["site:" in site order])
        p_rows: list[int] = []
        p_sites: list[int] = []
        prop_held: list[int] = []
        for j, ((dr, row0, p0, n, acts, _), mon) in enumerate(zip(windows, w._monitors)):
            if (n != 1 or dr.gate is not None or len(dr.states) != 1 or len(dr.monitor_sites) != 1
                    or mon[0] is not dr or mon[1] != p0 or mon[3] != n_cap0 + j):
                return None
            st = dr.states[0]
            pol = st.policy
            scales = (st.current_scale(),)
            applied = dr.decided.get(p0)
            if applied is None:
                applied = (0.0,)
            if applied != scales or (scales[0] != 0.0) != bool(acts) or len(acts) > 1:
                return None
            if pol.mode == "proportional":
                # it acts at every repeated step (a new scale of 0 falls back): at its policy's sites
                pol_ = dr.policies[0]
                sites = tuple(sorted(site for site in pol_.sites if owns_site(site)))
                if (snap[row0, list(sites)] != -1).any() or (acts and w._layout(dr, scales)[0] != sites):
                    return None  # static steering under the action
                act_idx.append(j)
                act_crcs.append(acts[0][0] if acts else 0)
                # the payload's crc: `f32(scale)`'s bytes continued from the vector's (`_Policy.parts`)
                vcrc = zlib.crc32(np.ascontiguousarray(pol_.vec, "<f4").tobytes())
                prop.append((dr, st, vcrc, [f"{site}:" for site in sites]))
                act_prop.append(len(act_idx) - 1)
                p_rows += [row0] * len(sites)
                p_sites += sites
                if acts:
                    prop_held += [int(hs[row0, site]) for site in sites]
                lo.append(np.nan)
                hi.append(np.nan)
            else:
                if not dr.speculable:
                    return None
                if acts:
                    act_idx.append(j)
                    act_crcs.append(acts[0][0])
                sites = w._layout(dr, scales)[0] if acts else ()
                ahead_idx.append(j)
                ahead_scales.append(scales)
                lo_, hi_ = threshold_flip_points(st)
                lo.append(lo_)
                hi.append(hi_)
                if acts:
                    w_rows += [row0] * len(sites)
                    w_sites += sites
            drs.append(dr)
            w0.append(row0)
            m_sites.append(mon[2])
        rp = cls()
        rp.req_ids, rp.qsl, rp.nc, rp.n_cap0, rp.version = list(req_ids), qsl, nc, n_cap0, version0
        rp.drs = drs
        rp.ahead_idx, rp.ahead_scales = ahead_idx, ahead_scales
        rp.w0 = np.asarray(w0, np.int64)
        rp.win_rows = rp.w0 - int(qsl[0])  # decode rows: a window's row is its batch index
        rp.act_idx = np.asarray(act_idx, np.int64)
        rp.acting = np.zeros(len(drs), bool)  # the windows whose action each repeated step applies
        rp.acting[rp.act_idx] = True
        rp.act_crcs = np.asarray(act_crcs, np.int64)
        rp.act_prop = np.asarray(act_prop, np.int64)
        rp.snap = snap
        rp.crc_of = dict(zip(act_idx, act_crcs))
        rp.dev = None  # decisions on the device (`device_decisions.DeviceDecisions`), when on
        rp.w_rows, rp.w_sites = np.asarray(w_rows, np.int64), np.asarray(w_sites, np.int64)
        rp.w_base = snap[rp.w_rows, rp.w_sites]
        rp.w_slots = hs[rp.w_rows, rp.w_sites].copy()
        rp.m_rows, rp.m_sites = rp.w0, np.asarray(m_sites, np.int64)
        rp.m_idx = (n_cap0 + np.arange(len(drs))).astype(hs.dtype)
        rp.lo, rp.hi = np.asarray(lo, np.float64), np.asarray(hi, np.float64)
        rp.max_row = int(rp.w0.max()) + 1
        # proportional windows: their scale moves every step (`_replay_finish` composes their slots)
        rp.prop = prop
        rp.p_crcs = ProportionalCrcs([(dr.key, tags, vcrc) for dr, _, vcrc, tags in prop])
        #: the chain's own slots for its proportional windows (per window and site; one per window),
        #: taken at its first repeat (`repeat_steps.RepeatedSteps._replay_proportional`)
        rp.p_own, rp.p_own_dev, rp.p_own_rows = None, None, None
        rp.p_j = np.asarray([j for j, pol in enumerate(drs) if pol.states[0].policy.mode == "proportional"], np.int64)
        rp.p_rows, rp.p_sites = np.asarray(p_rows, np.int64), np.asarray(p_sites, np.int64)
        if prop:
            specs = [st.policy for _, st, _, _ in prop]
            rp.p_gain = np.asarray([float(sp.gain) for sp in specs], np.float64)
            rp.p_target = np.asarray([float(sp.target) for sp in specs], np.float64)
            rp.p_min = np.asarray([float(sp.min_scale) for sp in specs], np.float64)
            rp.p_max = np.asarray([float(sp.max_scale) for sp in specs], np.float64)
            rp.p_vec = np.stack([np.asarray(dr.policies[0].vec, np.float32) for dr, _, _, _ in prop])
            #: their current scales, moved by each repeated step (the states get them from
            #: `_flush_chain`)
            rp.p_cur = np.asarray([st.scale for _, st, _, _ in prop], np.float64)
        # the slots held across repeats: the threshold windows' (kept) and the proportional
        # windows' (replaced every step)
        rp.prop_held = prop_held
        rest = Counter(w._held)
        rest.subtract(prop_held)
        if any(v < 0 for v in rest.values()):
            return None
        rp.static_held = list(rest.elements())
        return rp

    def continues(self, version: int, planner, req_ids, qsl, num_computed, n_cap: int) -> bool:
        """Is the step being planned this record's next one: armed by its `after_forward`, the
        request set and probes unchanged (`version`), no test fault pending, the same capture
        rows free, the same requests on the same rows, each one position further?"""
        return (self.armed and self.version == version and not planner.skip_next_action
                and n_cap == self.n_cap0 and self.n_cap0 + self.m_idx.size <= planner.b.max_capture_rows
                and np.array_equal(qsl, self.qsl) and np.array_equal(num_computed, self.nc + 1)
                and list(req_ids) == self.req_ids)

    def arm(self, sp: "_ScorePlan", work: list) -> None:
        """After the building step's forward: its score layout, if each request has one score
        (no row gate) in window order; the next plan may then repeat the step."""
        if len(sp.work) != len(self.drs) or sp.gate_rows:
            return
        picks = []
        for (dr, from_monitor, _, pk, gp), mine in zip(sp.work, self.drs):
            if dr is not mine or not from_monitor or gp is not None or len(pk) != 1 or pk[0] is None:
                return
            picks.append(pk[0])
        self.sp, self.work, self.picks, self.armed = sp, work, np.asarray(picks, np.int64), True
