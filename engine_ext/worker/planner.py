"""Turning requests' programs into the op's per-step buffer contents.

Two stages:

1. **`RequestPlan.build`** — once per request (at registration, and again when the global steering
   changes): compose everything that applies at each (site, position) into slots
   (`SlotTable`, content-addressed and shared) and keep the result as small numpy tables:
   a *prompt template* (site -> slot for every prompt position), a *generation template* (for
   every generated position), *explicit* (position, site, slot) entries that override the
   templates (patches, noise, steering at listed positions), and the capture sites/positions.
2. **`StepPlanner.plan_step`** — every step, from the rows vLLM scheduled (request id, row offset,
   tokens already computed): vectorised writes of the templates and explicit entries into the
   host `row_slot[row, site]` / `cap_dst[row, site]` tables for the rows of planned requests,
   one upload (pinned, non-blocking on CUDA), and one checksum fold per request and step.
   A step with nothing planned (and nothing planned in the previous step) does no work at all;
   a steady decode step that repeats the last step's plan while the tables hold it
   (`_SteadyDecode`, `StepPlanner._held`) writes and sends nothing, and only folds its actions.

Composition at one (site, position) — exactly what the transformers oracle does
(`engine_ext.reference.hf`): the patch first (`a = f32(1 - alpha)`, `c = f32(alpha) * target`;
zero-ablation: no `c`; with a dimension mask `m`, per dimension `a = f32(1 - alpha * m)`,
`c = f32(alpha * m) * target`, products in float64), then every add that applies there, in order (the request's steering
entries in spec order, its noise, then the global steering): `c = c + f32(scale * vector)`.
A replace with alpha 1 from a stored (x, r) pair and nothing added is a `PAIR` slot (bit-exact).
Directional clamps (`ClampOp`) that apply there come last: the slot carries them (global ones
first, then the request's, as the fork concatenates its tiers) and the op corrects the composed
value with all of them at once.

Rows and positions: in both vLLM runners, request i of a step owns rows
`query_start_loc[i] .. query_start_loc[i+1]`, which hold positions `num_computed[i]` onward. This
holds under chunked prefill (a window of the prompt), mixed prefill/decode batches (each request
its own window), preemption and resume (recomputed positions are visited again: every write is
idempotent per position), async scheduling without speculative decoding (vLLM's CPU-side
`num_computed` is exact) and padding (rows past the last request belong to no one).

After the forward, `after_forward` sums the captured rows to fp32 where they are and starts their
device-to-host copy without waiting (into a region of the worker's capture ring when there is one,
`engine_ext.capture_ring`); the rows are filed under their requests by the first step that finds
the copy done (planning never waits for it), or when results are collected (which waits).
"""

from __future__ import annotations

import contextlib
import hashlib
import operator
import weakref
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engine_ext.program import AddOp, ClampOp, WorkerProgram
from engine_ext.switches import env_switch
from engine_ext.worker import cuda_streams
from engine_ext.worker.checksum import ActionChecksum
from engine_ext.worker.intervention_op import SiteBuffers, SlotMode
from engine_ext.worker.slots import SlotTable, SlotValue
from engine_ext.worker.source_store import StoredPair

_EMPTY_I32 = np.zeros(0, np.int32)
_EMPTY_I64 = np.zeros(0, np.int64)


def _digest(*arrays: np.ndarray) -> str:
    h = hashlib.blake2b(digest_size=16)
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def _op_identity(op: AddOp, pos: int, memo: dict | None = None) -> tuple:
    """Content identity of what `op` adds at `pos` (vector bytes and scale). `memo`: identities
    already computed by the caller for ops of the same vector object and scale (one steering
    entry's ops at all its sites share their vector: hashed once); valid only while those
    vectors are alive (the caller's, for one plan's composition)."""
    if op.per_pos is not None:
        return ("noise", _digest(np.asarray(op.per_pos[pos], "<f4")))
    if isinstance(op, ClampOp):
        ident = getattr(op, "_identity", None)
        if ident is None:
            ident = op._identity = ("clamp", _digest(np.asarray(op.vec, "<f4"), np.asarray([op.lo, op.hi, op.strength], "<f8")))
        return ident
    ident = getattr(op, "_identity", None)
    if ident is None:
        key = (id(op.vec), op.scale)
        ident = memo.get(key) if memo is not None else None
        if ident is None:
            ident = ("vec", _digest(np.asarray(op.vec, "<f4"), np.asarray([op.scale], "<f8")))
            if memo is not None:
                memo[key] = ident
        op._identity = ident
    return ident


def _mask_identity(mask: np.ndarray | None) -> str | None:
    return None if mask is None else _digest(np.asarray(mask, "<f4"))


def _rep_identity(rep: tuple[float, Any, np.ndarray | None]) -> tuple:
    alpha, t, mask = rep
    m = _mask_identity(mask)
    if t is None:
        return ("zero", alpha, m)
    if isinstance(t, StoredPair):
        return ("pair", alpha, t.ident, m)
    return ("vec", alpha, _digest(np.asarray(t, "<f4")), m)


def _is_pair(rep: tuple[float, Any, np.ndarray | None] | None) -> bool:
    """A plain replace from a stored pair (written back as is: bit-exact)."""
    return rep is not None and rep[0] == 1.0 and isinstance(rep[1], StoredPair) and rep[2] is None


def _slot_value(rep: tuple[float, Any, np.ndarray | None] | None, ops: list[AddOp], pos: int) -> SlotValue:
    clamps = [op for op in ops if isinstance(op, ClampOp)]
    ops = [op for op in ops if not isinstance(op, ClampOp)]
    cl: dict[str, Any] = {}
    if clamps:
        cl = {"clamp_dirs": np.stack([np.asarray(op.vec, np.float32) for op in clamps]),
              "clamp_lo": np.asarray([op.lo for op in clamps], np.float32),
              "clamp_hi": np.asarray([op.hi for op in clamps], np.float32),
              "clamp_st": np.asarray([op.strength for op in clamps], np.float32),
              "clamp_key": tuple(_op_identity(op, pos) for op in clamps)}
    a_vec, a_key = None, None
    if rep is not None:
        alpha, t, mask = rep
        if _is_pair(rep) and not ops and not clamps:
            return SlotValue(SlotMode.PAIR, pair=t)
        if t is None:
            tv = None
        elif isinstance(t, StoredPair):
            tv = (t.x.float() + t.r.float()).numpy()
        else:
            tv = np.asarray(t, np.float32)
        a = float(np.float32(1.0 - alpha))
        if mask is None:
            c = None if tv is None else np.float32(alpha) * tv
        else:
            # per dimension: a = 1 - alpha * m, c = (alpha * m) * t (m = 1: the unmasked values exactly)
            am = np.float64(alpha) * np.asarray(mask, np.float64)
            a_vec = (1.0 - am).astype(np.float32)
            a_key = ("a", alpha, _mask_identity(mask))
            c = None if tv is None else am.astype(np.float32) * tv
    else:
        a, c = 1.0, None
    for op in ops:
        v = op.vector_at(pos)
        c = v.astype(np.float32) if c is None else c + v
    return SlotValue(SlotMode.AFFINE, a=a, c=c, a_vec=a_vec, a_key=a_key, **cl)


def _covers_prompt(op: AddOp, n_prompt: int) -> bool:
    if op.phase == "decode":
        return False
    if op.every:
        return True
    return op.per_pos is None and len(op.pos) >= n_prompt > 0 and int(op.pos[0]) == 0 and int(op.pos[n_prompt - 1]) == n_prompt - 1


def _covers_gen(op: AddOp) -> bool:
    return op.phase != "prefill" and (op.every or op.gen)


def _explicit_positions(op: AddOp, n_prompt: int, covers_prompt: bool, covers_gen: bool) -> list[int]:
    pos = sorted(op.per_pos) if op.per_pos is not None else op.pos.tolist()
    out = []
    for p in pos:
        if p < n_prompt:
            if op.phase != "decode" and not covers_prompt:
                out.append(int(p))
        elif op.phase != "prefill" and not covers_gen:
            out.append(int(p))
    return out


@dataclass
class RequestPlan:
    """One request's composed interventions (see the module docstring)."""

    key: str
    n_prompt: int
    prompt_sites: np.ndarray = field(default_factory=lambda: _EMPTY_I32)
    prompt_slots: np.ndarray = field(default_factory=lambda: _EMPTY_I32)
    gen_sites: np.ndarray = field(default_factory=lambda: _EMPTY_I32)
    gen_slots: np.ndarray = field(default_factory=lambda: _EMPTY_I32)
    ex_pos: np.ndarray = field(default_factory=lambda: _EMPTY_I64)
    ex_site: np.ndarray = field(default_factory=lambda: _EMPTY_I32)
    ex_slot: np.ndarray = field(default_factory=lambda: _EMPTY_I32)
    cap_sites: np.ndarray = field(default_factory=lambda: _EMPTY_I32)
    cap_pos: np.ndarray = field(default_factory=lambda: _EMPTY_I64)
    cap_gen: bool = False
    #: what the host needs of the captured rows: `CAP_PAIRS` (x and r in the model dtype, for a
    #: stored run), `CAP_VALUES` (their fp32 sum, returned to the client), or both
    cap_need: int = 0
    #: slots this plan holds a reference to (released when the request finishes)
    held: list[int] = field(default_factory=list)
    #: crc32 of the plan's content (slot contents by digest, sites, positions): what the
    #: checksum folds per applied window
    digest: int = 0
    #: the global-steering version the plan was composed with
    global_version: int = 0
    #: at generated positions only the generation template applies (no explicit entries, no
    #: captures there): decode rows of such plans are written in groups (`gen_group`)
    gen_template_only: bool = False
    #: plans with equal generation templates share this number
    gen_group: int = 0
    #: (position, site, slot) of a plan whose only content is one explicit entry (a sweep's cell:
    #: no templates, no captures); `plan_step` writes the rows of all such plans of a step at once
    ex_single: tuple[int, int, int] | None = None
    #: the one prompt position of a plan whose only content is captures at that position (P3:
    #: every layer at the last prompt token; `_capture_only`): `plan_step` writes the capture rows
    #: of all such plans of a step sharing one site table at once
    cap_single: int | None = None

    @property
    def empty(self) -> bool:
        return not (self.prompt_sites.size or self.gen_sites.size or self.ex_pos.size or self.cap_sites.size)

    @classmethod
    def build(cls, key: str, n_prompt: int, prog: WorkerProgram | None, global_adds: list[AddOp], slots: SlotTable,
              global_version: int = 0, global_clamps: list[ClampOp] = ()) -> "RequestPlan":
        """Compose `prog` (None: no program of its own) and the global steering (adds, then
        clamps) for a request with `n_prompt` prompt tokens. Raises SlotCapacityError (nothing
        held) when slots run out, ClampCapacityError when too many clamps meet at one place."""
        ops = ((list(prog.adds) if prog is not None else []) + list(global_adds) + list(global_clamps)
               + (list(prog.clamps) if prog is not None else []))
        replaces = prog.replaces if prog is not None else {}
        if SHARE_CAPTURE_PLANS and not ops and not replaces and prog is not None and prog.capture_sites:
            return cls._capture_only(key, n_prompt, prog, global_version)
        if FAST_REPLACE_PLANS and not ops and replaces and not prog.capture_sites:
            return cls._replaces_only(key, n_prompt, replaces, slots, global_version)
        plan = cls(key=key, n_prompt=n_prompt, global_version=global_version)
        described: list[tuple] = []
        by_site: dict[int, list[tuple[AddOp, bool, bool, set[int]]]] = {}
        for op in ops:
            cp, cg = _covers_prompt(op, n_prompt), _covers_gen(op)
            ex = set(_explicit_positions(op, n_prompt, cp, cg))
            if cp or cg or ex:
                by_site.setdefault(op.site, []).append((op, cp, cg, ex))
        rep_sites: dict[int, dict[int, tuple]] = {}
        for (site, pos), rep in replaces.items():
            rep_sites.setdefault(site, {})[pos] = rep
        p_sites, p_slots, g_sites, g_slots = [], [], [], []
        ex_rows: list[tuple[int, int, int]] = []
        memo: dict = {}  # `_op_identity`'s, for this composition (its ops hold their vectors alive)
        with plan._composing(slots):
            for site in sorted(set(by_site) | set(rep_sites)):
                entries = by_site.get(site, [])
                for region, pick, sites_out, slots_out in (("prompt", 1, p_sites, p_slots), ("gen", 2, g_sites, g_slots)):
                    here = [op for op, cp, cg, _ in entries if (cp, cg)[pick - 1]]
                    if here:
                        pos = 0 if region == "prompt" else n_prompt
                        skey = ("A", None, tuple(_op_identity(op, pos, memo) for op in here))
                        slot = plan._acquire(slots, skey, lambda: _slot_value(None, here, pos))
                        sites_out.append(site)
                        slots_out.append(slot)
                        described.append((region, site, skey))
                reps = rep_sites.get(site, {})
                for p in sorted(set().union(*(ex for *_, ex in entries), reps)):
                    here = [op for op, cp, cg, ex in entries if p in ex or (cp if p < n_prompt else cg)]
                    rep = reps.get(p)
                    if _is_pair(rep) and not here:
                        skey = ("P", _rep_identity(rep))
                    else:
                        skey = ("A", _rep_identity(rep) if rep is not None else None,
                                tuple(_op_identity(op, p, memo) for op in here))
                    slot = plan._acquire(slots, skey, lambda rep=rep, here=here, p=p: _slot_value(rep, here, p))
                    ex_rows.append((p, site, slot))
                    described.append(("at", p, site, skey))
        plan.prompt_sites, plan.prompt_slots = np.asarray(p_sites, np.int32), np.asarray(p_slots, np.int32)
        plan.gen_sites, plan.gen_slots = np.asarray(g_sites, np.int32), np.asarray(g_slots, np.int32)
        if ex_rows:
            ex_rows.sort()
            arr = np.asarray(ex_rows, np.int64)
            plan.ex_pos, plan.ex_site, plan.ex_slot = arr[:, 0], arr[:, 1].astype(np.int32), arr[:, 2].astype(np.int32)
        if prog is not None and prog.capture_sites:
            plan.cap_sites = np.asarray(prog.capture_sites, np.int32)
            plan.cap_pos = np.unique(np.asarray(prog.capture_pos, np.int64))
            plan.cap_gen = bool(prog.capture_gen)
            plan.cap_need = capture_need(prog)
            described.append(("capture", tuple(plan.cap_sites.tolist()), tuple(plan.cap_pos.tolist()), plan.cap_gen))
        plan.digest = zlib.crc32(repr((key, n_prompt, described)).encode())
        plan.gen_template_only = not plan.cap_gen and not (plan.cap_pos.size and plan.cap_pos[-1] >= n_prompt) and not (
            plan.ex_pos.size and plan.ex_pos[-1] >= n_prompt)
        plan.gen_group = _template_group(plan.gen_sites, plan.gen_slots)
        if len(ex_rows) == 1 and not plan.prompt_sites.size and not plan.gen_sites.size and not plan.cap_sites.size:
            plan.ex_single = tuple(int(v) for v in ex_rows[0])
        return plan

    @classmethod
    def _capture_only(cls, key: str, n_prompt: int, prog: WorkerProgram, global_version: int) -> "RequestPlan":
        """`build` for a program that only captures (and no global steering): no slots, and the
        tables depend on the prompt length and the capture alone, so requests of one shape share
        them (read-only) and each composes only its digest (which includes its key). Programs
        that share their capture's site list and position array (one template's requests, parsed
        once: `program.ProgramCache`) find their shape by those objects' identity and copy a
        prototype plan (~1 µs instead of ~4)."""
        need = capture_need(prog)
        ident = (n_prompt, id(prog.capture_sites), id(prog.capture_pos), bool(prog.capture_gen), need)
        hit = _CAPTURE_PROTOS.get(ident)
        if hit is None or hit[0] is not prog.capture_sites or hit[1] is not prog.capture_pos:
            if len(_CAPTURE_PROTOS) >= 1024:
                _CAPTURE_PROTOS.clear()
            # the entry holds the program's objects themselves: their ids cannot be reused while it is cached
            hit = _CAPTURE_PROTOS[ident] = (prog.capture_sites, prog.capture_pos, *cls._capture_proto(n_prompt, prog, need))
        proto, described_repr = hit[2], hit[3]
        plan = object.__new__(cls)
        plan.__dict__.update(proto.__dict__)
        plan.key, plan.held, plan.global_version = key, [], global_version
        # = repr((key, n_prompt, described)), the general composition's digest text
        plan.digest = zlib.crc32(f"({key!r}, {n_prompt!r}, {described_repr})".encode())
        return plan

    @classmethod
    def _capture_proto(cls, n_prompt: int, prog: WorkerProgram, need: int) -> tuple["RequestPlan", str]:
        """The plan every capture-only request of this shape copies (its key, digest, held slots
        and global version set per request) and the text of its description."""
        shape = (n_prompt, tuple(prog.capture_sites), np.asarray(prog.capture_pos, np.int64).tobytes(), bool(prog.capture_gen),
                 need)
        hit = _CAPTURE_PLANS.get(shape)
        if hit is None:
            cap_sites = np.asarray(prog.capture_sites, np.int32)
            cap_pos = np.unique(np.asarray(prog.capture_pos, np.int64))
            cap_sites.flags.writeable = False
            cap_pos.flags.writeable = False
            cap_gen = bool(prog.capture_gen)
            described = [("capture", tuple(cap_sites.tolist()), tuple(cap_pos.tolist()), cap_gen)]
            gen_only = not cap_gen and not (cap_pos.size and cap_pos[-1] >= n_prompt)
            if len(_CAPTURE_PLANS) >= 1024:
                _CAPTURE_PLANS.clear()
            hit = _CAPTURE_PLANS[shape] = (cap_sites, cap_pos, cap_gen, repr(described), gen_only,
                                           _template_group(_EMPTY_I32, _EMPTY_I32))
        cap_sites, cap_pos, cap_gen, described_repr, gen_only, group = hit
        proto = cls(key="", n_prompt=n_prompt, cap_sites=cap_sites, cap_pos=cap_pos, cap_gen=cap_gen,
                    cap_need=need, gen_template_only=gen_only, gen_group=group)
        if cap_pos.size == 1 and not cap_gen and cap_sites.size and int(cap_pos[0]) < n_prompt:
            proto.cap_single = int(cap_pos[0])
        return proto, described_repr

    @classmethod
    def _replaces_only(cls, key: str, n_prompt: int, replaces: dict, slots: SlotTable,
                       global_version: int) -> "RequestPlan":
        """`build` for a program of patches alone (no steering, noise, clamps or captures of its
        own, no global steering: a sweep's cell): every replace is an explicit entry, composed and
        described exactly as the general loop does (sites in order, positions in order within a
        site), without its per-site bookkeeping."""
        plan = cls(key, n_prompt, global_version=global_version, gen_group=_no_template_group())
        described: list[tuple] = []
        ex_rows: list[tuple[int, int, int]] = []
        held = plan.held
        try:  # `_composing`, inline (this path runs once per sweep cell)
            for site, p in sorted(replaces):
                rep = replaces[(site, p)]
                skey = ("P", _rep_identity(rep)) if _is_pair(rep) else ("A", _rep_identity(rep), ())
                slot = slots.acquire(skey, lambda rep=rep, p=p: _slot_value(rep, [], p))
                held.append(slot)
                ex_rows.append((p, site, slot))
                described.append(("at", p, site, skey))
        except BaseException:
            slots.release(held)
            plan.held = []
            raise
        if len(ex_rows) == 1:
            p, site, slot = plan.ex_single = ex_rows[0]
            plan.ex_pos = np.array((p,), np.int64)
            plan.ex_site, plan.ex_slot = np.array((site,), np.int32), np.array((slot,), np.int32)
        else:
            ex_rows.sort()
            arr = np.asarray(ex_rows, np.int64)
            plan.ex_pos, plan.ex_site, plan.ex_slot = arr[:, 0], arr[:, 1].astype(np.int32), arr[:, 2].astype(np.int32)
        plan.digest = zlib.crc32(repr((key, n_prompt, described)).encode())
        plan.gen_template_only = ex_rows[-1][0] < n_prompt if len(ex_rows) == 1 else not plan.ex_pos[-1] >= n_prompt
        return plan

    @contextlib.contextmanager
    def _composing(self, slots: SlotTable):
        """Composition that fails (slots run out, ...) releases every slot the plan took."""
        try:
            yield
        except BaseException:
            slots.release(self.held)
            self.held = []
            raise

    def _acquire(self, slots: SlotTable, key, make) -> int:
        slot = slots.acquire(key, make)
        self.held.append(slot)
        return slot


#: `RequestPlan.cap_need` bits
CAP_PAIRS = 1
CAP_VALUES = 2


def capture_need(prog: WorkerProgram) -> int:
    """What the host needs of a program's captured rows (`RequestPlan.cap_need`): the pairs
    for a stored run (`keep_as`), the fp32 values for a result that returns them; a voided
    program's rows are not needed at all."""
    if prog.voided:
        return 0
    return (CAP_PAIRS if prog.keep_as else 0) | (CAP_VALUES if prog.return_captures else 0)


_TEMPLATE_GROUPS: dict[bytes, int] = {}
#: capture-only plans' shared tables by (prompt length, sites, positions, generated)
_CAPTURE_PLANS: dict[tuple, tuple] = {}
#: capture-only plans' prototypes by (prompt length, id of the program's site list, id of its
#: position array, generated, need), each entry holding those two objects (`_capture_only`)
_CAPTURE_PROTOS: dict[tuple, tuple] = {}
#: whether capture-only plans share their tables (off: the general composition, for tests)
SHARE_CAPTURE_PLANS = True
#: whether patch-only plans take `RequestPlan._replaces_only` (off: the general composition, for tests)
FAST_REPLACE_PLANS = True


def _ints(values: Any) -> list[int]:
    """A step's per-request numbers (numpy arrays from the runners; any sequence) as Python ints."""
    return values.tolist() if hasattr(values, "tolist") else [int(v) for v in values]


def _no_template_group() -> int:
    """`_template_group` of the empty template (plans without a generation template)."""
    group = _TEMPLATE_GROUPS.get(b"|")
    return group if group is not None else _template_group(_EMPTY_I32, _EMPTY_I32)


def _template_group(sites: np.ndarray, slots: np.ndarray) -> int:
    """A small integer per distinct (sites, slots) template (interned)."""
    key = sites.tobytes() + b"|" + slots.tobytes()
    group = _TEMPLATE_GROUPS.get(key)
    if group is None:
        if len(_TEMPLATE_GROUPS) > 65536:
            _TEMPLATE_GROUPS.clear()
        group = _TEMPLATE_GROUPS[key] = len(_TEMPLATE_GROUPS) + 1
    return group


class StepCaptures:
    """One step's captured rows on the host: `xs` / `rs` [rows, hidden] in the model dtype (None
    when no request of the step keeps its pairs) and their fp32 values `x + r` (as vLLM's fused
    add computes them; None when no request returns them), summed once for the whole step where
    the rows are (on the GPU, before the copy) and shared by the step's requests (each reads its
    own slice)."""

    __slots__ = ("xs", "rs", "_values", "ring", "region", "__weakref__")

    def __init__(self, xs: torch.Tensor | None, rs: torch.Tensor | None, values: torch.Tensor | None = None,
                 ring: Any = None, region: int | None = None):
        self.xs, self.rs = xs, rs
        self._values = values
        #: where the values live when they are in a capture ring's region (its reference is
        #: dropped when this object goes: `StepPlanner.after_forward`)
        self.ring, self.region = ring, region

    @property
    def width(self) -> int:
        """Values per row (the hidden size)."""
        return int((self._values if self._values is not None else self.xs).shape[-1])

    def values(self, base: int, k: int) -> torch.Tensor:
        """fp32 `x + r` of rows `[base, base + k)` (a view of the step's one sum)."""
        if self._values is None:
            self._values = fp32_sum(self.xs, self.rs)
        return self._values[base: base + k]


def fp32_sum(xs: torch.Tensor, rs: torch.Tensor) -> torch.Tensor:
    """`xs.float() + rs.float()` as a new tensor (also for an fp32 model: `xs` itself may be kept
    for stored pairs), on the tensors' device: both upcasts are exact and the sum is one fp32
    rounding, so the CPU and the GPU give the same bits."""
    return xs.to(torch.float32, copy=True).add_(rs)


def _capture_overflow(max_rows: int) -> str:
    """What a request whose captures do not fit a step's `max_rows` capture rows is told."""
    return (f"the step's {max_rows} capture rows are exceeded; raise max_capture_rows / capture_buffer_bytes "
            "or capture fewer sites x positions at once")


@dataclass
class _CaptureBlock:
    """Captured rows of one request in one step: row `base + i * len(sites) + j` of the step's
    capture buffer holds position `positions[i]` at site `sites[j]`."""

    owner: Any
    positions: np.ndarray
    sites: np.ndarray
    base: int
    need: int = CAP_PAIRS | CAP_VALUES  # `RequestPlan.cap_need`


def _rewriter(after_upload: Any) -> Any:
    """Who an `after_upload` callable is (`StepPlanner.after_upload`): its bound object, which
    writes the same row-table entries every time it runs, else the callable itself."""
    return getattr(after_upload, "__self__", after_upload)


class _SteadyDecode:
    """A decode step planned request by request whose plan the next step may repeat: every
    request has one row, and each that has a plan applied only its generation template (its rows
    written in groups, one action `(digest, p0, p0 + 1)` each). The next step repeats it exactly
    when it schedules the same requests in the same order, one row each, with the same plan
    objects, every one still past its prompt: then its table entries are the same (rows and
    templates do not depend on positions) and its actions are the same digests at each request's
    new position (`fold_actions`). Anything else, and the step is planned request by request again.

    While the device's tables hold exactly this plan's entries (`StepPlanner._held`), a repeat
    writes, compares and uploads nothing: it only folds its actions into the checksum."""

    __slots__ = ("ids", "plans", "qsl_dtype", "qsl_bytes", "max_prompt", "writes", "acting", "acts",
                 "one", "every", "max_row")

    @classmethod
    def build(cls, req_ids, plans: dict, writes: list, actions: list, max_row: int, qsl_dtype) -> "_SteadyDecode":
        s = cls()
        s.ids = list(req_ids)
        s.plans = [plans.get(r) for r in s.ids]
        # the step's query_start_loc (one row each) as the seam passes it, compared as bytes
        s.qsl_dtype = np.dtype(qsl_dtype)
        s.qsl_bytes = np.arange(len(s.ids) + 1, dtype=s.qsl_dtype).tobytes()
        s.max_prompt = max((p.n_prompt for p in s.plans if p is not None), default=0)
        s.writes = writes
        # the requests that acted, in batch order (the order of `actions`); row i is request i's
        s.acting = np.asarray([i for i, p in enumerate(s.plans) if p is not None and p.gen_sites.size], np.int64)
        # the actions in `ActionChecksum.fold_prepared`'s form: digests masked once, positions per step
        s.acts = np.zeros((s.acting.size, 3), "<i8")
        s.acts[:, 0] = np.asarray([a[0] for a in actions], np.int64).reshape(-1) & 0xFFFFFFFF
        assert len(actions) == s.acting.size
        s.one = int(s.acting[0]) if s.acting.size == 1 else -1
        s.every = s.acting.size == len(s.ids)  # every request acts: its positions in batch order
        s.max_row = max_row
        return s

    def repeats(self, req_ids, query_start_loc, num_computed, plans: dict) -> bool:
        """Is this step (same arguments as `StepPlanner.plan_step`) a repeat of the one built?"""
        if req_ids != self.ids:
            return False
        q = query_start_loc
        if isinstance(q, np.ndarray) and q.dtype == self.qsl_dtype:
            if q.tobytes() != self.qsl_bytes:
                return False
        elif not np.array_equal(q, np.frombuffer(self.qsl_bytes, self.qsl_dtype)):
            return False
        if not all(map(operator.is_, map(plans.get, req_ids), self.plans)):
            return False
        # every request past its prompt (a chunk of one prompt token is not a decode row): at
        # once when the least position is past the longest prompt, else request by request
        nc = num_computed
        if (nc[0] if len(nc) == 1 else nc.min() if isinstance(nc, np.ndarray) else min(nc)) >= self.max_prompt:
            return True
        return bool((np.asarray(nc) >= np.asarray([0 if p is None else p.n_prompt for p in self.plans])).all())

    def fold_actions(self, num_computed) -> np.ndarray:
        """This step's actions, `[k, 3]` little-endian int64 with digests masked to 32 bits (the
        form `ActionChecksum.fold_prepared` takes; reused: valid until the next call): each acting
        request's digest at its position."""
        a = self.acts
        if self.one >= 0:
            p = int(num_computed[self.one])
            a[0, 1] = p
            a[0, 2] = p + 1
        else:
            a[:, 1] = num_computed if self.every else np.asarray(num_computed, np.int64)[self.acting]
            np.add(a[:, 1], 1, out=a[:, 2])
        return a


class StepPlanner:
    """Per-step buffer contents for one engine's `SiteBuffers` (see the module docstring)."""

    def __init__(self, buffers: SiteBuffers, slots: SlotTable, checksum: ActionChecksum, sink):
        """`sink(owner, positions, sites, xs, rs, step, base)` receives each request's captured
        rows of a step (xs/rs: [positions, sites, hidden] host tensors in the model dtype; `step`:
        the step's `StepCaptures`, whose rows `[base, base + positions x sites)` they are)."""
        self.b, self.slots, self.checksum, self.sink = buffers, slots, checksum, sink
        on_host = buffers.device.type != "cuda"
        # host tables; on a CPU engine they are the op's buffers themselves (no copy)
        self.hs = buffers.row_slot.numpy() if on_host else np.full((buffers.max_rows, buffers.num_sites), -1, np.int32)
        self.hc = buffers.cap_dst.numpy() if on_host else np.full((buffers.max_rows, buffers.num_sites), -1, np.int32)
        self.on_host = on_host
        self._dirty_rows = 0          # rows [0, n) of the device tables that may hold entries
        self._dirty_cap_rows = 0      # the same, for the capture table
        if not on_host:
            shape = (buffers.max_rows, buffers.num_sites)
            self._stage = [(torch.empty(shape, dtype=torch.int32, device="cpu", pin_memory=True),
                            torch.empty(shape, dtype=torch.int32, device="cpu", pin_memory=True), torch.cuda.Event())
                           for _ in range(3)]
            # what the device tables hold now, rows [0, n) (the rest is -1): a step whose tables
            # are the same (a steady decode) uploads nothing (`_upload`)
            self._sent_s = np.full(shape, -1, np.int32)
            self._sent_c = np.full(shape, -1, np.int32)
            self._sent_rows = self._sent_cap_rows = 0
        #: who wrote the device's row table on the device since the last upload (an
        #: `after_upload` callable's object; None: nobody): the next step's table is sent whatever
        #: it holds unless the same object rewrites it again (it writes the same entries each time)
        self._rewritten_by: Any = None
        #: skip the upload of a table the device already holds (`_upload`;
        #: `CAUSALBOARD_SKIP_SAME_UPLOAD`, the RPC `cb_set_upload_skip`), and how often it did
        self.skip_same_upload = env_switch("CAUSALBOARD_SKIP_SAME_UPLOAD", True)
        self.uploads_skipped = 0
        self._blocks: list[_CaptureBlock] = []
        #: a step planned but not yet finished (`plan_step(defer=True)`)
        self._open: tuple | None = None
        self._pending: list[tuple[Any, StepCaptures, list[_CaptureBlock]]] = []
        self.steps = 0
        self.applied_steps = 0
        #: test-only fault (`cb_debug_fault`): skip the next planned request window entirely
        self.skip_next_action = False
        #: the last step's plan when it was a steady decode step that the next may repeat
        #: (`_SteadyDecode`), and how many steps repeated one
        self._steady: _SteadyDecode | None = None
        self.steady_steps = 0
        #: the steady plan whose entries alone the tables hold (sent to the device, or the op's
        #: own tables on a CPU engine) and nothing rewrote since: its repeats write nothing
        self._held: _SteadyDecode | None = None
        self.held_steps = 0  # steps that repeated a held plan (wrote and sent nothing)
        #: whether steady decode steps repeat the last step's plan (off: every step planned
        #: request by request; the same tables and actions, for tests)
        self.steady_decode = True
        #: run once right after the next upload, before the forward (dynamic decisions taken on
        #: the device rewrite their rows' slots there: `engine_ext.dynamic.device_decisions`).
        #: Contract: a bound method whose object writes the same entries of the row table every
        #: time it runs (so the upload of an unchanged table may be skipped before it: `_upload`)
        self.after_upload: Any = None
        #: the worker's capture ring (`engine_ext.capture_ring`; None: none): each step's fp32
        #: values go into a region of it, which results hand to the client as slices
        self.ring: Any = None

    def plan_step(self, req_ids, query_start_loc, num_computed, plans: dict, on_overflow, extra=None,
                  defer: bool = False) -> None:
        """Fill the tables for this step's rows. `plans` maps request id -> RequestPlan (requests
        without one are left untouched); `on_overflow(req_id, message)` is told about a request
        whose captures do not fit this step (its rows are then left untouched). `extra(planner,
        req_ids, query_start_loc, num_computed, hs, hc, n_cap) -> (max_row, n_cap, finish)`
        writes more entries on top of the plans' (dynamic steering); `finish() -> (max_row,
        actions)` (None: nothing more) writes the rest of them, before the upload; its actions
        are folded after the plans'.

        With `defer`, the step is left open after `extra`: `finish_step` (which the caller must
        call before the step's forward is launched) runs `finish`, folds the checksum and uploads.
        The seam defers where the runner has host work of its own between preparing the inputs
        and launching the forward (vLLM's V2 runner), so that work is done while the previous
        forward may still run, before `finish` waits for that forward's scores."""
        self.finish_step()  # a step left open (never launched) is closed before the next
        self.steps += 1
        self.checksum.begin_step()
        if self._pending:  # the copies that finished (never a wait here: the step's host work overlaps the GPU)
            self.file_captures(wait=False)
        steady = self._steady
        if (steady is not None and steady is self._held and extra is None and plans and self.after_upload is None
                and (self.on_host or self.skip_same_upload)
                and self._rewritten_by is None and not self._dirty_cap_rows and not self.skip_next_action
                and steady.repeats(req_ids, query_start_loc, num_computed, plans)):
            # the tables (the device's, or the op's own on a CPU engine) hold this plan's entries
            # already: nothing to write, compare or send; the checksum still folds the step
            self._blocks = []
            self.steady_steps += 1
            self.held_steps += 1
            self.checksum.fold_prepared(steady.fold_actions(num_computed))
            self.applied_steps += 1
            self.slots.flush()
            if not self.on_host:
                self.uploads_skipped += 1
            return
        hs, hc = self.hs, self.hc
        if self.on_host and self._dirty_rows:
            hs[: self._dirty_rows] = -1
            hc[: self._dirty_rows] = -1
        max_row = 0
        n_cap = 0
        blocks: list[_CaptureBlock] = []
        actions: Any = []
        #: the step's tables are a steady plan's entries alone (kept by the device: `_held`)
        pure: _SteadyDecode | None = None
        if plans and steady is not None and not self.skip_next_action and steady.repeats(req_ids, query_start_loc,
                                                                                          num_computed, plans):
            for rows, sites, slots in steady.writes:
                hs[rows, sites] = slots
            max_row = steady.max_row
            actions = steady.fold_actions(num_computed)
            self.steady_steps += 1
            pure = steady
        elif plans:
            self._steady = None
            get = plans.get
            qsl, computed = _ints(query_start_loc), _ints(num_computed)
            steady_ok = qsl[-1] == len(req_ids) and not self.skip_next_action and self.steady_decode
            # decode rows whose plan applies only its generation template, grouped by template
            groups: dict[int, tuple[RequestPlan, list[int]]] = {}
            # the one entry of each single-entry plan in this step (`RequestPlan.ex_single`)
            s_rows: list[int] = []
            s_sites: list[int] = []
            s_slots: list[int] = []
            # capture rows of `cap_single` plans, by their (shared) site table: rows, bases
            c_groups: dict[int, tuple[np.ndarray, list[int], list[int]]] = {}
            max_cap = self.b.max_capture_rows
            for i, rid in enumerate(req_ids):
                plan = get(rid)
                if plan is None:
                    continue
                row0, p0 = qsl[i], computed[i]
                n = qsl[i + 1] - row0
                if n <= 0:
                    steady_ok = False
                    continue
                if self.skip_next_action and not plan.empty:
                    self.skip_next_action = False
                    continue
                p1 = p0 + n
                if p0 >= plan.n_prompt and plan.gen_template_only:
                    if plan.gen_sites.size:
                        group = groups.get(plan.gen_group)
                        if group is None:
                            groups[plan.gen_group] = (plan, list(range(row0, row0 + n)))
                        else:
                            group[1].extend(range(row0, row0 + n))
                        actions.append((plan.digest, p0, p1))
                        max_row = max(max_row, row0 + n)
                    continue
                steady_ok = False  # only decode rows of generation templates repeat (`_SteadyDecode`)
                single = plan.ex_single
                if single is not None:
                    if p0 <= single[0] < p1:
                        s_rows.append(row0 + single[0] - p0)
                        s_sites.append(single[1])
                        s_slots.append(single[2])
                    max_row = max(max_row, row0 + n)
                    actions.append((plan.digest, p0, p1))
                    continue
                cs = plan.cap_single
                if cs is not None:  # what the general path below does for such a plan, batched
                    if p0 <= cs < p1:
                        k = plan.cap_sites.size
                        if n_cap + k > max_cap:
                            on_overflow(rid, _capture_overflow(max_cap))
                            continue
                        group = c_groups.get(id(plan.cap_sites))
                        if group is None:
                            group = c_groups[id(plan.cap_sites)] = (plan.cap_sites, [], [])
                        group[1].append(row0 + cs - p0)
                        group[2].append(n_cap)
                        blocks.append(_CaptureBlock(rid, plan.cap_pos, plan.cap_sites, n_cap, plan.cap_need))
                        n_cap += k
                    max_row = max(max_row, row0 + n)
                    actions.append((plan.digest, p0, p1))
                    continue
                if plan.empty:
                    continue
                # captures first: a request whose captures overflow is left untouched this step
                cpos = _EMPTY_I64
                if plan.cap_sites.size:
                    a, z = np.searchsorted(plan.cap_pos, (p0, p1))
                    cpos = plan.cap_pos[a:z]
                    if plan.cap_gen and p1 > plan.n_prompt:
                        cpos = np.union1d(cpos, np.arange(max(p0, plan.n_prompt), p1, dtype=np.int64))
                    k = cpos.size * plan.cap_sites.size
                    if k and n_cap + k > max_cap:
                        on_overflow(rid, _capture_overflow(max_cap))
                        continue
                pb = min(p1, plan.n_prompt)
                if pb > p0 and plan.prompt_sites.size:
                    hs[row0: row0 + (pb - p0), plan.prompt_sites] = plan.prompt_slots
                ga = max(p0, plan.n_prompt)
                if p1 > ga and plan.gen_sites.size:
                    hs[row0 + (ga - p0): row0 + n, plan.gen_sites] = plan.gen_slots
                if plan.ex_pos.size:
                    a, z = np.searchsorted(plan.ex_pos, (p0, p1))
                    if z > a:
                        hs[row0 + plan.ex_pos[a:z] - p0, plan.ex_site[a:z]] = plan.ex_slot[a:z]
                if cpos.size:
                    ids = n_cap + np.arange(cpos.size * plan.cap_sites.size, dtype=np.int32).reshape(cpos.size, plan.cap_sites.size)
                    hc[(row0 + cpos - p0)[:, None], plan.cap_sites[None, :]] = ids
                    blocks.append(_CaptureBlock(rid, cpos, plan.cap_sites, n_cap, plan.cap_need))
                    n_cap += ids.size
                max_row = max(max_row, row0 + n)
                actions.append((plan.digest, p0, p1))
            writes = []
            for plan, rows in groups.values():
                writes.append((np.asarray(rows, np.int64)[:, None], plan.gen_sites[None, :], plan.gen_slots))
                hs[writes[-1][0], writes[-1][1]] = plan.gen_slots
            if steady_ok:
                self._steady = pure = _SteadyDecode.build(req_ids, plans, writes, actions, max_row,
                                                          getattr(query_start_loc, "dtype", np.int64))
            if s_rows:
                hs[s_rows, s_sites] = s_slots
            for sites, rows, bases in c_groups.values():
                hc[np.asarray(rows, np.int64)[:, None], sites[None, :]] = (
                    np.asarray(bases, np.int32)[:, None] + np.arange(sites.size, dtype=np.int32)[None, :])
        finish = None
        if extra is not None:
            more_rows, n_cap, finish = extra(self, req_ids, query_start_loc, num_computed, hs, hc, n_cap)
            max_row = max(max_row, more_rows)
        self._blocks = blocks
        self._open = (max_row, n_cap, actions, finish, pure if extra is None else None)
        if not defer:
            self.finish_step()

    def finish_step(self) -> None:
        """Close the step `plan_step` opened (nothing if none is open): the rest of the extra
        entries, the checksum fold, the slot flush and the upload."""
        if self._open is None:
            return
        max_row, n_cap, actions, finish, pure = self._open
        self._open = None
        if finish is not None:
            more_rows, more = finish()  # more: a list of actions or an [k, 3] int64 array
            max_row = max(max_row, more_rows)
            if len(more):
                actions = more if not len(actions) else np.concatenate([np.asarray(actions, np.int64).reshape(-1, 3),
                                                                        np.asarray(more, np.int64).reshape(-1, 3)])
        if len(actions):
            if pure is not None and actions is pure.acts:  # a repeat's, already in the checksum's form
                self.checksum.fold_prepared(actions)
            else:
                self.checksum.fold_step(actions)
            self.applied_steps += 1
        self.slots.flush()
        self._upload(max_row, n_cap > 0)
        # the tables sent (or kept) are the steady plan's alone: its repeats may send nothing
        self._held = pure if pure is not None and self.after_upload is None and n_cap == 0 else None
        if self.after_upload is not None:
            fn, self.after_upload = self.after_upload, None
            fn()
            self._rewritten_by = _rewriter(fn)

    def _upload(self, max_row: int, captures: bool) -> None:
        b = self.b
        m = max(max_row, self._dirty_rows)
        if self.on_host:
            if m:
                act = (self.hs[:m] >= 0).any(axis=0) | (self.hc[:m] >= 0).any(axis=0)
                b.active[:] = act.tolist()
            else:
                b.active[:] = [False] * b.num_sites
            self._dirty_rows = max_row
            return
        mc = max(max_row if captures else 0, self._dirty_cap_rows)
        # a table the device holds already (the same rows as the last upload, and rewritten on
        # the device since by nobody or by the one that rewrites it again after this upload) is
        # not sent again: a steady decode's tables repeat step after step
        by = self._rewritten_by
        skip = self.skip_same_upload
        if (skip and m and m == self._sent_rows
                and (by is None or _rewriter(self.after_upload) is by)
                and np.array_equal(self.hs[:m], self._sent_s[:m])):
            m = 0
            self.uploads_skipped += 1
        if skip and mc and mc == self._sent_cap_rows and np.array_equal(self.hc[:mc], self._sent_c[:mc]):
            mc = 0
            self.uploads_skipped += 1
        if m or mc:
            # pinned staging, one of a ring: a slot is refilled only after its last copy finished
            k = self.steps % len(self._stage)
            stage_s, stage_c, done = self._stage[k]
            done.synchronize()
            if m:
                stage_s.numpy()[:m] = self.hs[:m]
                b.row_slot[:m].copy_(stage_s[:m], non_blocking=True)
                self._sent_s[:m] = self.hs[:m]
                self._sent_s[m: self._sent_rows] = -1
                self._sent_rows = m
                self._rewritten_by = None
            if mc:
                stage_c.numpy()[:mc] = self.hc[:mc]
                b.cap_dst[:mc].copy_(stage_c[:mc], non_blocking=True)
                self._sent_c[:mc] = self.hc[:mc]
                self._sent_c[mc: self._sent_cap_rows] = -1
                self._sent_cap_rows = mc
            cuda_streams.record(done, b.cuda_index)
        if max_row:
            self.hs[:max_row] = -1
            if captures:
                self.hc[:max_row] = -1
        self._dirty_rows = max_row
        self._dirty_cap_rows = max_row if captures else 0

    def after_forward(self) -> None:
        """Start copying this step's captured rows to the host (filed later by `file_captures`):
        the pairs if a request of the step keeps them, their fp32 sums (computed here, on the
        rows' device) if one returns them."""
        if not self._blocks:
            return
        blocks, self._blocks = self._blocks, []
        k = blocks[-1].base + blocks[-1].positions.size * blocks[-1].sites.size
        need = 0
        for blk in blocks:
            need |= blk.need
        b = self.b
        x, r = b.cap_x[:k], b.cap_r[:k]
        cuda = b.device.type == "cuda"
        ring, region = self.ring, None
        if need & CAP_VALUES and ring is not None and (ring.pinned or not cuda):
            region = ring.alloc(4 * k * b.hidden)  # None: full, the values go the usual way
        if cuda:
            def to_host(t: torch.Tensor) -> torch.Tensor:
                h = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
                h.copy_(t, non_blocking=True)
                return h

            xs, rs = (to_host(x), to_host(r)) if need & CAP_PAIRS else (None, None)
            if region is not None:  # straight into the shared ring (registered as pinned memory)
                vals = ring.host_rows(region, k, b.hidden)
                vals.copy_(fp32_sum(x, r), non_blocking=True)
            else:
                vals = to_host(fp32_sum(x, r)) if need & CAP_VALUES else None
            done = torch.cuda.Event()
            cuda_streams.record(done, b.cuda_index)
        else:
            xs, rs = (x.clone(), r.clone()) if need & CAP_PAIRS else (None, None)
            vals = fp32_sum(x, r) if need & CAP_VALUES else None
            if region is not None:
                vals = ring.host_rows(region, k, b.hidden).copy_(vals)
            done = None
        step = StepCaptures(xs, rs, vals, ring if region is not None else None, region)
        if region is not None:
            weakref.finalize(step, ring.deref, region)
        self._pending.append((done, step, blocks))

    def has_pending(self) -> bool:
        """Are captured rows of some step not yet filed (`file_captures`)?"""
        return bool(self._pending)

    def file_captures(self, wait: bool = True) -> None:
        """Hand each request's captured block of the pending steps to the sink, in step order;
        with `wait`, wait for copies still in flight, else stop at the first of them."""
        while self._pending:
            done, step, blocks = self._pending[0]
            if done is not None and not done.query():
                if not wait:
                    return
                done.synchronize()
            self._pending.pop(0)
            for blk in blocks:
                k = blk.positions.size * blk.sites.size
                shape = (blk.positions.size, blk.sites.size, self.b.hidden)
                xs = step.xs[blk.base: blk.base + k].view(shape) if step.xs is not None else None
                rs = step.rs[blk.base: blk.base + k].view(shape) if step.rs is not None else None
                self.sink(blk.owner, blk.positions, blk.sites, xs, rs, step, blk.base)
