"""The wire `Program`: an `Interventions` spec compiled against one prompt and one model.

Client side (`compile_program`): every selector is resolved to absolute token positions
(`generated=True` additionally covers every position >= n_prompt, i.e. generated tokens fed back
into the model), every bound is checked with an error naming the field, noise is drawn, and the
result is canonical JSON that travels in `SamplingParams.extra_args["causalboard"]`.

Worker side (`WorkerProgram.parse`): the JSON becomes arrays and float32 tensors; named vectors
and stored source runs are looked up there (a missing one voids the request, never silently
skips it).
"""

from __future__ import annotations

import bisect
import json
import math
import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine_ext.errors import SpecError
from engine_ext.specs import InlineSource, Interventions, MeanSource, Positions, RunSource, ZeroSource, canonical_json, decode_vector, encode_vector, spec_hash
from engine_ext.sites import Site, Span, site_from_index, site_index

PROGRAM_VERSION = 1
EXTRA_ARGS_KEY = "causalboard"
#: `extra_args` key of `[first modified position, salt]` (see `program_to_extra_args`)
KV_SALT_KEY = "causalboard_kv"
#: `extra_args` key of a segmented request that enters the forward at a layer (the layer): the
#: scheduler-side patch keeps each step to one such layer (`seam._hold_other_entries`)
ENTRY_KEY = "causalboard_entry"


@dataclass(frozen=True)
class ModelDims:
    num_layers: int
    hidden_size: int
    vocab_size: int
    embedding_std: float


@dataclass(frozen=True)
class Limits:
    """Admission limits (per request)."""

    max_site_positions: int = 65536  # sites x positions touched by steer/patch/capture entries
    max_named_vectors: int = 256
    #: directional clamps acting at one (site, position), global ones included (the fork's
    #: `max_clamp_directions`, K: the width of the op's clamp table)
    max_clamp_directions: int = 4


@dataclass
class PromptInfo:
    """The prompt as the engine will see it."""

    token_ids: list[int]
    text: str | None = None
    #: (start, end) character offsets per token; (0, 0) for special tokens
    offsets: list[tuple[int, int]] | None = None
    max_tokens: int = 1

    @property
    def n(self) -> int:
        return len(self.token_ids)


def resolve_positions(sel: Positions, prompt: PromptInfo, field_name: str) -> tuple[list[int], bool]:
    """(sorted absolute positions, covers-all-generated) for a selector on this prompt."""
    n = prompt.n
    if isinstance(sel, str):
        return {
            "last_prompt": ([n - 1], False),
            "all_prompt": (list(range(n)), False),
            "all_generated": ([], True),
            "all": (list(range(n)), True),
        }[sel]
    out: set[int] = set()
    # tokens fed back into the model: positions n .. n + max_tokens - 2 (the last one never is)
    last_fed = n + prompt.max_tokens - 2
    for k, item in enumerate(sel):
        f = f"{field_name}[{k}]"
        if isinstance(item, int):
            p = item + n if item < 0 else item
            if p < 0 or p > max(n - 1, last_fed):
                raise SpecError(f, f"position {item} is outside the prompt (0..{n - 1}, or -{n}..-1 from its end)"
                                + (f" and the generated tokens fed back ({n}..{last_fed})" if last_fed >= n else ""))
            out.add(p)
        else:
            out.update(span_positions(item, prompt, f))
    return sorted(out), False


def span_positions(span: Span, prompt: PromptInfo, field_name: str) -> list[int]:
    """Tokens overlapping the `occurrence`-th occurrence of `span.text` in the prompt text."""
    if prompt.text is None or prompt.offsets is None:
        raise SpecError(field_name, "a span needs the prompt as text (it was given as token ids)")
    start, found = -1, -1
    while found < span.occurrence:
        start = prompt.text.find(span.text, start + 1)
        if start < 0:
            break
        found += 1
    if start < 0:
        count = found + 1
        raise SpecError(f"{field_name}.span", f"{span.text!r} occurs {count} time(s) in the prompt; occurrence {span.occurrence} does not exist")
    end = start + len(span.text)
    toks = [i for i, (a, b) in enumerate(prompt.offsets) if b > a and a < end and b > start]
    if not toks:
        raise SpecError(f"{field_name}.span", f"{span.text!r} maps to no token of the prompt")
    return toks


def _check_site(site: Site, dims: ModelDims, field_name: str) -> int:
    if site.layer >= dims.num_layers:
        raise SpecError(f"{field_name}", f"layer {site.layer} is out of range: the model has layers 0..{dims.num_layers - 1}")
    return site.index()


def _check_vec(vec: np.ndarray, dims: ModelDims, field_name: str) -> str:
    if vec.shape[0] != dims.hidden_size:
        raise SpecError(field_name, f"has dimension {vec.shape[0]}, the model's hidden size is {dims.hidden_size}")
    return encode_vector(vec)


def _mask_wire(mask, dims: ModelDims, field_name: str) -> dict | None:
    """The wire form of a dimension mask (checked against the hidden size): the sorted indices
    with the width, or the base64 float32 weights."""
    if mask is None:
        return None
    mask.values(dims.hidden_size, field_name)  # bounds
    if mask.indices is not None:
        return {"idx": list(mask.indices), "n": dims.hidden_size}
    return {"w": encode_vector(mask.weights)}


def decode_mask(wire: dict | None) -> np.ndarray | None:
    """The float32 per-dimension weights of a wire mask (None: no mask)."""
    if wire is None:
        return None
    if "w" in wire:
        return decode_vector(wire["w"])
    m = np.zeros(int(wire["n"]), np.float32)
    m[np.asarray(wire["idx"], np.int64)] = 1.0
    return m


def noise_vectors(n_positions: int, hidden: int, scale: float, std: float, seed: int) -> np.ndarray:
    """The Gaussian corruption added at the noised positions: `scale * std * N(0, 1)`, drawn in
    position order from `numpy.random.default_rng(seed)` (so the oracle can redraw it)."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n_positions, hidden)) * (scale * std)).astype(np.float32)


MAX_SCORE_IDS = 128


def check_score_token_ids(ids, vocab_size: int) -> list[int]:
    """The distinct ids of `score_token_ids` (order kept); SpecError naming the field otherwise."""
    if len(ids) > MAX_SCORE_IDS:
        raise SpecError("score_token_ids", f"at most {MAX_SCORE_IDS} token ids")
    for k, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise SpecError(f"score_token_ids[{k}]", f"token id {t} is outside the vocabulary [0, {vocab_size})")
    return list(dict.fromkeys(ids))


def compile_program(spec: Interventions, prompt: PromptInfo, dims: ModelDims, *, key: str,
                    named_vector_dims: Callable[[str], int | None], limits: Limits = Limits()) -> dict:
    """Validate `spec` against the prompt and model; return the wire program (plain JSON data).

    Raises `SpecError` naming the offending field (e.g. `patch[2].positions[0]`)."""
    touched = 0
    steer_out = []
    for k, s in enumerate(spec.steer):
        f = f"steer[{k}]"
        sites = [_check_site(site, dims, f"{f}.sites[{j}]") for j, site in enumerate(s.sites)]
        pos, gen = resolve_positions(s.positions, prompt, f"{f}.positions")
        if s.name is not None:
            d = named_vector_dims(s.name)
            if d is None:
                raise SpecError(f"{f}.name", f"no registered vector named {s.name!r}")
            if d != dims.hidden_size:
                raise SpecError(f"{f}.name", f"vector {s.name!r} has dimension {d}, the model's hidden size is {dims.hidden_size}")
            vec = None
        else:
            vec = _check_vec(s.vector, dims, f"{f}.vector")
        touched += len(sites) * (len(pos) + (prompt.max_tokens if gen else 0))
        entry = {"sites": sites, "pos": pos, "gen": gen, "phase": s.phase, "vec": vec, "name": s.name, "scale": s.scale}
        if s.mask is not None:
            entry["mask"] = _mask_wire(s.mask, dims, f"{f}.mask")
        steer_out.append(entry)
    patch_out = []
    for k, p in enumerate(spec.patch):
        f = f"patch[{k}]"
        site = _check_site(p.site, dims, f"{f}.site")
        dst, gen = resolve_positions(p.positions, prompt, f"{f}.positions")
        if gen:
            raise SpecError(f"{f}.positions", "patch destinations must be explicit positions, spans, 'last_prompt' or 'all_prompt'")
        src = p.source
        if isinstance(src, RunSource):
            spos = list(src.positions) if src.positions is not None else list(dst)
            if len(spos) != len(dst):
                raise SpecError(f"{f}.source.positions", f"has {len(spos)} positions for {len(dst)} destination positions")
            if any(q < 0 for q in spos):
                raise SpecError(f"{f}.source.positions", "source positions are absolute (>= 0)")
            sj: dict = {"run": src.run_id, "pos": spos}
        elif isinstance(src, InlineSource):
            if len(src.vectors) not in (1, len(dst)):
                raise SpecError(f"{f}.source.vectors", f"give 1 vector or one per destination position ({len(dst)})")
            sj = {"vecs": [_check_vec(v, dims, f"{f}.source.vectors[{j}]") for j, v in enumerate(src.vectors)]}
        elif isinstance(src, MeanSource):
            sj = {"mean_of": src.run_id}
        else:
            assert isinstance(src, ZeroSource)
            sj = {"zero": True}
        touched += len(dst)
        entry = {"site": site, "dst": dst, "src": sj, "alpha": p.alpha}
        if p.mask is not None:
            entry["mask"] = _mask_wire(p.mask, dims, f"{f}.mask")
        patch_out.append(entry)
    noise_out = None
    if spec.noise is not None:
        pos, _ = resolve_positions(spec.noise.positions, prompt, "noise.positions")
        vecs = noise_vectors(len(pos), dims.hidden_size, spec.noise.scale, dims.embedding_std, spec.noise.seed)
        noise_out = {"pos": pos, "vecs": [encode_vector(v) for v in vecs]}
        touched += len(pos)
    capture_out = None
    if spec.capture is not None:
        c = spec.capture
        sites = [_check_site(site, dims, f"capture.sites[{j}]") for j, site in enumerate(c.sites)]
        pos, gen = resolve_positions(c.positions, prompt, "capture.positions")
        touched += len(sites) * (len(pos) + (prompt.max_tokens if gen else 0))
        capture_out = {"sites": sites, "pos": pos, "gen": gen, "keep_as": c.keep_as, "return": c.return_values,
                       "values": len(sites) * (len(pos) + (prompt.max_tokens if gen else 0))}
        if c.lease:
            capture_out["lease"] = True
    clamp_out = []
    for k, c in enumerate(spec.clamp):
        f = f"clamp[{k}]"
        sites = [_check_site(site, dims, f"{f}.sites[{j}]") for j, site in enumerate(c.sites)]
        pos, gen = resolve_positions(c.positions, prompt, f"{f}.positions")
        _check_vec(c.vector, dims, f"{f}.vector")
        touched += len(sites) * (len(pos) + (prompt.max_tokens if gen else 0))
        clamp_out.append({"sites": sites, "pos": pos, "gen": gen, "phase": c.phase, "dir": encode_vector(c.unit()),
                          "lo": c.min, "hi": c.max, "st": c.strength})
    if clamp_out:
        check_clamp_directions(clamp_out, prompt.n, limits.max_clamp_directions)
    if touched > limits.max_site_positions:
        raise SpecError("interventions", f"touches {touched} site-positions; the limit is {limits.max_site_positions} (too many sites)")
    body = {"steer": steer_out, "patch": patch_out, "noise": noise_out, "capture": capture_out}
    if clamp_out:  # absent when empty: clamp-free programs (and their hashes) are unchanged
        body["clamp"] = clamp_out
    # the last position ever fed to the model: the last prompt token or the next-to-last generated one
    max_pos = max(prompt.n - 1, prompt.n + prompt.max_tokens - 2)
    return {"v": PROGRAM_VERSION, "key": key, "n_prompt": prompt.n, "max_pos": max_pos, "hash": spec_hash(body), **body}


def clamp_counts(entries: list[dict], n_prompt: int) -> dict[int, tuple[int, int, list[int]]]:
    """Per site: the most wire clamp entries acting at one prompt position, at one generated
    position, and the entries (indices into `entries`) at the site."""
    by_site: dict[int, list[int]] = {}
    for k, e in enumerate(entries):
        for site in e["sites"]:
            by_site.setdefault(int(site), []).append(k)
    out = {}
    for site, ks in by_site.items():
        prompt = np.zeros(max(n_prompt, 1), np.int64)
        gen_all = 0
        explicit_gen: dict[int, int] = {}
        for k in ks:
            e = entries[k]
            for p in e["pos"]:
                if p < n_prompt and e["phase"] != "decode":
                    prompt[p] += 1
                elif p >= n_prompt and e["phase"] != "prefill" and not e["gen"]:
                    explicit_gen[p] = explicit_gen.get(p, 0) + 1
            if e["gen"] and e["phase"] != "prefill":
                gen_all += 1
        out[site] = (int(prompt.max()), gen_all + max(explicit_gen.values(), default=0), ks)
    return out


def check_clamp_directions(entries: list[dict], n_prompt: int, limit: int, field_prefix: str = "clamp",
                           extra: dict[int, tuple[int, int]] | None = None) -> None:
    """SpecError naming the entry when more than `limit` clamps would act at one (site,
    position); `extra`: per site, the clamps already acting at prompt and at generated
    positions (the global ones, counted as acting everywhere in their phase)."""
    for site, (in_prompt, in_gen, ks) in sorted(clamp_counts(entries, n_prompt).items()):
        gp, gg = (extra or {}).get(site, (0, 0))
        total = max(in_prompt + gp if in_prompt else 0, in_gen + gg if in_gen else 0)
        if total > limit:
            k = ks[-1]
            j = entries[k]["sites"].index(site)
            glob = f" ({max(gp, gg)} of them global)" if gp or gg else ""
            raise SpecError(f"{field_prefix}[{k}].sites[{j}]", f"{total} clamps would act at one position of "
                            f"{site_from_index(site)}{glob}; at most {limit} (max_clamp_directions)")


def first_modified_position(program: dict) -> int | None:
    """The first position whose residual stream (and so whose KV) the program changes, or None
    when it changes nothing (captures only). Everything before it is computed exactly as for the
    unmodified prompt, so its KV may be shared through the prefix cache."""
    n = int(program["n_prompt"])
    out: list[int] = []
    for s in program["steer"]:
        out += [p for p in s["pos"] if (p < n and s["phase"] != "decode") or (p >= n and s["phase"] != "prefill")]
        if s["gen"] and s["phase"] != "prefill":
            out.append(n)
    for c in program.get("clamp", ()):
        out += [p for p in c["pos"] if (p < n and c["phase"] != "decode") or (p >= n and c["phase"] != "prefill")]
        if c["gen"] and c["phase"] != "prefill":
            out.append(n)
    for p in program["patch"]:
        out += p["dst"]
    if program.get("noise"):
        out += program["noise"]["pos"]
    return min(out) if out else None


def program_to_extra_args(program: dict, kv_salt: str | None = None) -> dict:
    """`SamplingParams.extra_args` for a compiled program, as its canonical JSON text (a string:
    vLLM deep-copies `extra_args` for every request, which costs ~100x more for nested data than
    parsing the text once on the worker). With `kv_salt`, every KV block that
    holds a position the program modifies is hashed with that salt (`KV_SALT_KEY`: the seam adds
    it to vLLM's block hashes), so it is never shared with a request that computes it
    differently, while the blocks before `first_modified_position` stay shareable."""
    return _extra_args(canonical_json(program), first_modified_position(program), kv_salt)


def _extra_args(text: str, first: int | None, kv_salt: str | None) -> dict:
    """The program's canonical `text`, and the KV salt from position `first` on (when both given)."""
    extra: dict[str, Any] = {EXTRA_ARGS_KEY: text}
    if kv_salt is not None and first is not None:
        extra[KV_SALT_KEY] = [first, kv_salt]
    return extra


#: the request key a `ProgramTemplate` is compiled with (NULs: no request key has them)
TEMPLATE_KEY = "\u0000cb-template-key\u0000"
_TEMPLATE_NEEDLE = '"key":' + canonical_json(TEMPLATE_KEY)


class ProgramTemplate:
    """One compiled program for every request that differs only in its key (one spec on a batch
    of prompts of one length): compiled (with `key=TEMPLATE_KEY`) and serialised once; each
    request's `extra_args` is then the canonical text with its own key spliced in, the same text
    `program_to_extra_args` gives for the program compiled with that key. The splice replaces
    `"key":"<template key>"`, which occurs once: the program's only field named `key` is the
    top-level one, and JSON escapes every quote inside a string value, so no string can hold it
    (should it ever occur more than once, each request's text is serialised in full instead)."""

    def __init__(self, program: dict):
        if program.get("key") != TEMPLATE_KEY:
            raise ValueError("a template is compiled with key=TEMPLATE_KEY")
        self.program = program
        self.hash = program["hash"]
        text = canonical_json(program)
        self.text: str | None = text if text.count(_TEMPLATE_NEEDLE) == 1 else None
        self.first = first_modified_position(program)

    def extra_args(self, key: str, kv_salt: str | None = None) -> dict:
        """`program_to_extra_args` of this program compiled with `key`."""
        if self.text is None:
            return program_to_extra_args({**self.program, "key": key}, kv_salt)
        # a key of plain characters (the engine's: `cb-<n>-<hex>`) is its own JSON string body
        quoted = f'"{key}"' if _PLAIN_KEY(key) else canonical_json(key)
        return _extra_args(self.text.replace(_TEMPLATE_NEEDLE, '"key":' + quoted, 1), self.first, kv_salt)


#: keys whose JSON text is the key itself in quotes (nothing to escape)
_PLAIN_KEY = re.compile(r"[A-Za-z0-9_.:-]*").fullmatch


_KEY_FIELD = '"key":"'


def key_split(text: str) -> tuple[str, str] | None:
    """A program's canonical text split into (the text without its key's value, the key), so
    that programs differing only in their key (one `ProgramTemplate`'s requests) have the same
    first part; None where that cannot be told from the text alone (the field not found exactly
    once, or a key with an escape in it)."""
    i = text.find(_KEY_FIELD)
    if i < 0 or text.find(_KEY_FIELD, i + 1) >= 0:
        return None
    start = i + len(_KEY_FIELD)
    end = text.find('"', start)
    if end < 0 or "\\" in text[start:end]:
        return None
    return text[:start] + text[end:], text[start:end]


class ProgramCache:
    """The worker's parse of program texts that differ only in their key (`key_split`): a
    batch's requests built from one `ProgramTemplate` are parsed once and each gets a copy with
    its own key and its own `errors` (everything else, the ops included, is shared and never
    changed per request). Only a parse that read nothing of the worker's state (no named vector,
    no stored source) and found no error is kept; `size` texts at most, least recently used
    dropped."""

    def __init__(self, size: int = 16):
        self.size = size
        self._by_text: OrderedDict[str, WorkerProgram] = OrderedDict()
        self.hits = 0

    def parse(self, text: str, *, named_vector: Callable[[str], np.ndarray | None],
              source_value: Callable[[str, int, int], Any], source_mean: Callable[[str, int], np.ndarray | None],
              owns_site: Callable[[int], bool]) -> WorkerProgram:
        """`WorkerProgram.parse(json.loads(text), ...)`, from the cache where it holds the text."""
        split = key_split(text)
        if split is not None:
            got = self._by_text.get(split[0])
            if got is not None:
                self._by_text.move_to_end(split[0])
                self.hits += 1
                return _for_key(got, split[1])
        read = []

        def reading(fn: Callable) -> Callable:
            def wrapped(*args):
                read.append(1)
                return fn(*args)
            return wrapped

        prog = WorkerProgram.parse(json.loads(text), named_vector=reading(named_vector), source_value=reading(source_value),
                                   source_mean=reading(source_mean), owns_site=owns_site)
        if split is not None and not read and not prog.errors and not prog.sources:
            self._by_text[split[0]] = _for_key(prog, prog.key)
            while len(self._by_text) > self.size:
                self._by_text.popitem(last=False)
        return prog


def _for_key(prog: "WorkerProgram", key: str) -> "WorkerProgram":
    """A copy of `prog` with `key` and errors of its own, every other field shared (a shallow
    copy: `dataclasses.replace` costs ~10 µs a request)."""
    out = object.__new__(WorkerProgram)
    out.__dict__.update(prog.__dict__)
    out.key = key
    out.errors = []
    return out


def clamp_op(op_id: int, kind: str, site: int, e: dict) -> "ClampOp":
    """The worker's `ClampOp` of one wire clamp entry ({pos, gen, phase, dir, lo, hi, st}, plus
    `every` for global ones) at `site`."""
    return ClampOp(op_id, kind, int(site), np.asarray(e.get("pos", []), np.int64), bool(e.get("gen", False)),
                   e.get("phase", "both"), decode_vector(e["dir"]) if isinstance(e["dir"], str) else np.asarray(e["dir"], np.float32),
                   1.0, every=bool(e.get("every", False)),
                   lo=-math.inf if e.get("lo") is None else float(e["lo"]),
                   hi=math.inf if e.get("hi") is None else float(e["hi"]), strength=float(e.get("st", 1.0)))


# ---- worker side ------------------------------------------------------------------------------
_TRUE1, _FALSE1 = np.ones(1, bool), np.zeros(1, bool)


@dataclass
class AddOp:
    """`c += scale * vec` at `site` for positions in `pos` (or every generated position when
    `gen`), restricted to `phase`. `per_pos` holds one vector per position instead (noise)."""

    op_id: int
    kind: str  # "steer" | "noise" | "global"
    site: int
    pos: np.ndarray
    gen: bool
    phase: str
    vec: np.ndarray | None
    scale: float
    per_pos: dict[int, np.ndarray] | None = None
    name: str | None = None
    every: bool = False  # every position (global steering "all")

    def applies(self, p: int, n_prompt: int, max_pos: int) -> bool:
        is_gen = p >= n_prompt
        if p > max_pos or self.phase == "prefill" and is_gen or self.phase == "decode" and not is_gen:
            return False
        if self.every or self.gen and is_gen:
            return True
        i = bisect.bisect_left(self.pos, p)
        return i < len(self.pos) and int(self.pos[i]) == p

    def mask(self, positions: np.ndarray, n_prompt: int, max_pos: int) -> np.ndarray:
        """Which of a window's positions this op applies to."""
        if len(positions) == 1:  # decode steps: the common case, keep it cheap
            return _TRUE1 if self.applies(int(positions[0]), n_prompt, max_pos) else _FALSE1
        is_gen = positions >= n_prompt
        m = np.ones(len(positions), bool) if self.every else np.isin(positions, self.pos)
        if self.gen:
            m |= is_gen
        if self.phase == "prefill":
            m &= ~is_gen
        elif self.phase == "decode":
            m &= is_gen
        return m & (positions <= max_pos)

    def vector_at(self, position: int) -> np.ndarray:
        if self.per_pos is not None:
            return self.per_pos[position]
        scaled = getattr(self, "_scaled", None)
        if scaled is None:
            scaled = self._scaled = (self.vec * np.float32(self.scale)).astype(np.float32)
        return scaled


@dataclass
class ClampOp(AddOp):
    """A directional clamp at `site` (`vec`: the float32 unit direction; `lo` / `hi`: the
    bounds, +-inf when open; `strength`), at the positions and phase of an `AddOp`. Applied
    after every patch and add at the same (site, position)."""

    lo: float = -math.inf
    hi: float = math.inf
    strength: float = 1.0


@dataclass
class WorkerProgram:
    key: str
    n_prompt: int
    max_pos: int
    hash: str
    adds: list[AddOp] = field(default_factory=list)
    clamps: list[ClampOp] = field(default_factory=list)
    #: (site, position) -> (alpha, target, mask): target is an fp32 vector, a stored (x, r) pair,
    #: or None for zero-ablation; mask the fp32 per-dimension weights or None
    replaces: dict[tuple[int, int], tuple[float, Any, np.ndarray | None]] = field(default_factory=dict)
    capture_sites: list[int] = field(default_factory=list)
    capture_pos: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    capture_gen: bool = False
    keep_as: str | None = None
    #: lease the run `keep_as` names as it is stored (`Capture.lease`)
    lease_kept: bool = False
    return_captures: bool = True
    #: (site, position) values the whole capture holds on all stages (what the store charges)
    capture_values: int = 0
    #: why the request cannot be applied faithfully (missing source, ...); non-empty = voided
    errors: list[str] = field(default_factory=list)
    sources: set[str] = field(default_factory=set)
    #: a segmented request (`engine_ext.worker.segments`): segment length S, the carrier
    #: positions scored after the forward and the token ids scored there; 0 / empty otherwise
    segment_len: int = 0
    score_pos: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    score_ids: list[int] = field(default_factory=list)
    #: a segmented request whose every segment enters the forward at this layer (`entry_layer`:
    #: each real position's `pre_attn` pair there replaced from a stored run); 0 otherwise
    entry_layer: int = 0

    @property
    def voided(self) -> bool:
        return bool(self.errors)

    def captures_at(self, position: int) -> bool:
        if position > self.max_pos:
            return False
        if self.capture_gen and position >= self.n_prompt:
            return True
        i = bisect.bisect_left(self.capture_pos, position)
        return i < len(self.capture_pos) and self.capture_pos[i] == position

    @classmethod
    def parse(cls, data: dict, *, named_vector: Callable[[str], np.ndarray | None],
              source_value: Callable[[str, int, int], Any],
              source_mean: Callable[[str, int], np.ndarray | None],
              owns_site: Callable[[int], bool] = lambda site: True) -> "WorkerProgram":
        """Build the worker-side program; lookups that fail are recorded in `errors`. Entries at
        sites this worker does not compute (`owns_site`: another pipeline stage's layers) are
        left out; the source runs they reference are still listed in `sources`, so every stage
        leases and touches the same runs."""
        if data.get("v") != PROGRAM_VERSION:
            raise ValueError(f"unsupported causalboard program version {data.get('v')!r}")
        prog = cls(key=data["key"], n_prompt=int(data["n_prompt"]), max_pos=int(data["max_pos"]), hash=data["hash"])
        op_id = 0
        for s in data["steer"]:
            if s["vec"] is not None:
                vec = decode_vector(s["vec"])
            else:
                vec = named_vector(s["name"])
                if vec is None:
                    prog.errors.append(f"steering vector {s['name']!r} is no longer registered")
                    continue
            if s.get("mask") is not None:
                vec = (vec * decode_mask(s["mask"])).astype(np.float32)
            for site in s["sites"]:
                if not owns_site(site):
                    continue
                prog.adds.append(AddOp(op_id, "steer", site, np.asarray(s["pos"], np.int64), bool(s["gen"]),
                                       s["phase"], vec, float(s["scale"]), name=s["name"]))
                op_id += 1
        for c in data.get("clamp", ()):
            for site in c["sites"]:
                if owns_site(site):
                    prog.clamps.append(clamp_op(op_id, "clamp", site, c))
                    op_id += 1
        if data.get("noise") and owns_site(0):
            nz = data["noise"]
            per_pos = {int(p): decode_vector(v) for p, v in zip(nz["pos"], nz["vecs"])}
            prog.adds.append(AddOp(op_id, "noise", 0, np.asarray(sorted(per_pos), np.int64), False, "both",
                                   None, 1.0, per_pos=per_pos))
            op_id += 1
        for p in data["patch"]:
            site, alpha, src = int(p["site"]), float(p["alpha"]), p["src"]
            mask = decode_mask(p.get("mask"))
            if "run" in src or "mean_of" in src:
                prog.sources.add(src.get("run") or src["mean_of"])
            if not owns_site(site):
                continue
            missing = []
            for j, dst in enumerate(p["dst"]):
                if "run" in src:
                    t = source_value(src["run"], site, int(src["pos"][j]))
                    if t is None:
                        missing.append(int(src["pos"][j]))
                        continue
                elif "vecs" in src:
                    t = decode_vector(src["vecs"][j if len(src["vecs"]) > 1 else 0])
                elif "mean_of" in src:
                    t = source_mean(src["mean_of"], site)
                    if t is None:
                        prog.errors.append(f"source run {src['mean_of']!r} has no values at {site_from_index(site)} (missing or evicted)")
                        continue
                else:
                    t = None
                prog.replaces[(site, int(dst))] = (alpha, t, mask)
            if missing:
                prog.errors.append(f"source run {src['run']!r} has no value at {site_from_index(site)} position(s) "
                                   f"{missing} (never captured there, dropped, or evicted)")
        seg = data.get("segments")
        if seg:
            prog.segment_len = int(seg["len"])
            prog.score_pos = np.unique(np.asarray(seg["score_pos"], np.int64))
            prog.score_ids = [int(t) for t in seg["ids"]]
            prog.entry_layer = entry_layer(prog, int(seg.get("entry", 0)))
        cap = data.get("capture")
        if cap:
            prog.capture_sites = [site for site in cap["sites"] if owns_site(site)]
            prog.capture_values = int(cap.get("values", 0))
            prog.capture_pos = np.asarray(cap["pos"], np.int64)
            prog.capture_gen = bool(cap["gen"])
            prog.keep_as = cap["keep_as"]
            prog.lease_kept = bool(cap.get("lease", False))
            prog.return_captures = bool(cap["return"])
        return prog


def entry_layer(prog: WorkerProgram, layer: int) -> int:
    """`layer` if a segmented request may enter the forward there, else 0: every real position of
    every segment (from the segment's start to its scored position) has its `pre_attn` pair at
    `layer` replaced outright from a stored run (alpha 1, no mask), so nothing computed below
    `layer` can reach the segment's score (docs/segmented-cells.md, "Layer skipping"). Checked
    here, on the worker, so a request that does not hold this runs every layer."""
    if layer <= 0 or not prog.segment_len or prog.voided:
        return 0
    site = site_index(layer, "pre_attn")
    length = prog.segment_len
    for end in prog.score_pos.tolist():
        for dst in range(end - end % length, end + 1):
            rep = prog.replaces.get((site, dst))
            if rep is None or rep[0] != 1.0 or rep[2] is not None or not hasattr(rep[1], "run"):
                return 0
    return layer

