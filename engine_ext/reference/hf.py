"""The Hugging Face transformers reference implementation (the test oracle).

Loads the same local weights with transformers and computes, with plain PyTorch, what the vLLM
engine must reproduce: greedy continuations and per-token logprobs (full recomputation each step,
no KV cache, so it is simple enough to trust) — and, for causal tracing / steering, the same
forward with interventions at the engine's sites (residual stream and MLP branch) and captures
of the values there.

Sites
-----
A site is `(layer, hook)` of decoder layer `i` (`model.model.layers[i]`):

* `pre_attn`   — the stream entering layer i (the layer's input; HF `hidden_states[i]`);
* `post_attn`  — after the attention add of layer i (the input of `post_attention_layernorm`,
  which HF also keeps as the residual of the MLP add; it is edited in place so both see it);
* `mlp_in`     — the MLP's input (`layer.mlp`'s argument: the output of
  `post_attention_layernorm`);
* `mlp_out`    — the MLP's output (`layer.mlp`'s return value, before the residual add);
* `post_block` — the stream leaving layer i (the layer's output; HF `hidden_states[i+1]`, but
  for the last layer the value *before* the final norm).

The hooks are generic: any decoder layer that takes the stream as its first input, feeds
`post_attention_layernorm` the post-attention stream and returns the stream is covered — Llama,
Qwen2, Qwen3, and Qwen3-Next's gated delta-net and full-attention layers alike (hybrids: compare
in bf16, tolerance in docs/hybrid-models.md). `run` refuses a layer whose hooks do not fire
exactly once.

Interventions (exactly the engine's `planner._slot_value` / `intervention_op._apply`)
----------------------------------------------------------------------------------
Per site and absolute position `p` (prompt first, then generated tokens fed back):

1. patch first — the replace edit covering `p` (the *last* one given wins, as in the engine's
   per-(site, position) table): `a = f32(1 - alpha)`, `c = f32(alpha) * t` (zero-ablation:
   no `c`); with a dimension mask `m` (per-dimension weights), per dimension
   `a = f32(1 - alpha * m)`, `c = f32(alpha * m) * t` (the products in float64);
2. then every add (steer / noise) that applies at `p`, in the order given:
   `c = c + vec * f32(scale)` (masked: `c = c + f32(vec * m) * f32(scale)`);
3. `new = c if a == 0 else a * s + c`, all float32;
3b. a row gate (`kind="gate"`: the reference fork's `this_token` probe gate, the engine's
   `slot_gate`) covering `p`: from `s` (before the edit), `score = sum(s * probe)`,
   `g = 1 / (1 + exp(-(sharpness * (score - threshold))))`, `new = new + (g - 1) * term`; the
   `(score, g)` are reported in `RefRun.gates`;
4. then the directional clamps that apply at `p` (in the order given; the engine's order is the
   global clamps, then the request's): with unit directions `d_k` (normalised in float64, as the
   reference fork does), every projection from the same `new`:
   `p_k = sum(new * d_k)`, `new = new + sum_k st_k * (min(max(p_k, lo_k), hi_k) - p_k) * d_k`;
5. written back in the model dtype.

Captures record the stream after the interventions at that site. The engine applies its adds
in this order: steering entries (in spec order, each entry's sites in order), then noise, then
the global steering set — give `RefEdit`s in the same order to reproduce its rounding exactly
(`edits_from_program` does this for a compiled wire program).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine_ext.bundled import bundled_model_path
from engine_ext.errors import SpecError
from engine_ext.sites import HOOKS, PHASES, Site, site_from_index

KINDS: tuple[str, ...] = ("add", "replace", "clamp", "gate")

SiteKey = tuple[int, str]


@dataclass
class ReferenceGeneration:
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    #: per step, the gap between the best and second-best logprob (to recognise near-ties)
    top2_gaps: list[float]
    #: (`generate` only) per step, the full float32 logprob row over the vocabulary,
    #: a tensor [len(token_ids), vocab] — read any token id's logprob at any step
    step_logprobs: Any = None
    #: (`generate` only) captures of the final forward (prompt + all generated tokens but the
    #: last, i.e. every position ever fed to the model): {(layer, hook): tensor [len, H]}
    captures: dict[SiteKey, Any] = field(default_factory=dict)


@dataclass
class RefRun:
    """One forward over `ids` with interventions."""

    ids: list[int]
    n_prompt: int
    #: float32 next-token logits at every position: [len(ids), vocab]
    logits: Any
    #: {(layer, hook): float32 tensor [len(ids), H]} — the post-intervention stream
    captures: dict[SiteKey, Any]
    #: {(layer, hook): {position: (score, g)}} — what each row gate (`RefEdit.gate`) used
    gates: dict[SiteKey, dict[int, tuple[float, float]]] = field(default_factory=dict)

    def logprobs(self, position: int = -1) -> Any:
        """Float32 log-softmax row at `position` (default: the last)."""
        import torch

        return torch.log_softmax(self.logits[position], dim=-1)


def parse_site(site: Any) -> SiteKey:
    """`(layer, hook)` from a tuple, an object with `.layer`/`.hook` (e.g. `specs.Site`) or the
    text form `"L3.post_attn"`."""
    if isinstance(site, str):
        try:
            parsed = Site.parse(site)
        except SpecError as exc:
            raise ValueError(exc.message) from None
        layer, hook = parsed.layer, parsed.hook
    elif hasattr(site, "layer") and hasattr(site, "hook"):
        layer, hook = site.layer, site.hook
    else:
        layer, hook = site
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or layer < 0:
        raise ValueError(f"site layer must be a non-negative integer, got {layer!r}")
    if hook not in HOOKS:
        raise ValueError(f"unknown hook {hook!r}; expected one of {', '.join(HOOKS)}")
    return int(layer), str(hook)


@dataclass
class RefEdit:
    """One intervention at one site.

    * `kind="add"` (steering, noise): add `scale * v` at `positions` (absolute) and, when `gen`,
      at every generated position (>= n_prompt); `phase` restricts it to the prompt
      ("prefill": positions < n_prompt) or to generated tokens ("decode": >= n_prompt).
    * `kind="replace"` (patch): `(1 - alpha) * s + alpha * t` at `positions`; `vectors=None`
      is zero-ablation (t = 0). Patches are explicit positions only (no `gen`, no `phase`).
    * `kind="gate"` (row gate, `RefEdit.gate`): at `positions` (and `gen` / `phase` as for an add),
      the term `vectors` (one vector) scaled by `g` of the pre-edit value `s`: see the module
      docstring, step 3b. At most one gate per (site, position).
    * `kind="clamp"` (directional clamp): after the patch and adds, the projection onto the unit
      direction of `vectors` (one vector) is clipped to [`lo`, `hi`] with `strength`; positions,
      `gen` and `phase` as for an add.

    `vectors`: one vector `[H]` (or `[1, H]`) for all positions, or `[len(positions), H]`, one
    per position in the order of `positions`. Positions beyond the sequence are ignored.
    `mask`: per-dimension weights `[H]` in [0, 1] (or None: every dimension fully) — a replace
    acts only on the masked dimensions, an add adds only there.
    """

    layer: int
    hook: str
    positions: Sequence[int] = ()
    kind: str = "add"
    vectors: Any = None
    alpha: float = 1.0
    scale: float = 1.0
    gen: bool = False
    phase: str = "both"
    mask: Any = None
    lo: float = float("-inf")
    hi: float = float("inf")
    strength: float = 1.0
    probe: Any = None
    threshold: float = 0.0
    sharpness: float = 1.0

    def __post_init__(self) -> None:
        self.layer, self.hook = parse_site((self.layer, self.hook))
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.phase not in PHASES:
            raise ValueError(f"phase must be one of {', '.join(PHASES)}, got {self.phase!r}")
        pos = [int(p) for p in self.positions]
        if any(p < 0 for p in pos):
            raise ValueError(f"positions are absolute token indices (>= 0), got {pos}")
        if len(set(pos)) != len(pos):
            raise ValueError(f"positions must not repeat, got {pos}")
        self.positions = pos
        self._index = {p: j for j, p in enumerate(pos)}
        self.alpha, self.scale = float(self.alpha), float(self.scale)
        if self.mask is not None:
            m = np.asarray(self.mask.detach().cpu().numpy() if hasattr(self.mask, "detach") else self.mask)
            if m.dtype == bool:
                m = m.astype(np.float32)
            m = np.ascontiguousarray(m, np.float32)
            if m.ndim != 1 or not np.all((m >= 0) & (m <= 1)):
                raise ValueError("mask must be a 1-D vector of weights in [0, 1]")
            self.mask = m
        if self.kind == "replace":
            if self.gen or self.phase != "both":
                raise ValueError("a replace edit takes explicit positions only (no gen / phase)")
        elif self.vectors is None:
            raise ValueError(f"an {self.kind} edit needs vectors")
        if self.kind == "gate":
            pr = np.ascontiguousarray(np.asarray(self.probe, np.float32))
            if pr.ndim != 1 or not np.isfinite(pr).all() or self.mask is not None:
                raise ValueError("a gate needs one finite probe vector and no mask")
            self.probe, self.threshold, self.sharpness = pr, float(self.threshold), float(self.sharpness)
        if self.kind == "clamp":
            self.lo, self.hi, self.strength = float(self.lo), float(self.hi), float(self.strength)
            if not self.lo <= self.hi or not 0.0 <= self.strength <= 1.0 or self.mask is not None:
                raise ValueError("a clamp needs lo <= hi, a strength in [0, 1] and no mask")
            v = np.asarray(self.vectors.detach().cpu().numpy() if hasattr(self.vectors, "detach") else self.vectors, np.float64)
            if v.ndim != 1 or not np.isfinite(v).all() or not np.linalg.norm(v) > 0:
                raise ValueError("a clamp needs one finite, non-zero direction vector")
            self.vectors = (v / np.linalg.norm(v)).astype(np.float32)
        if self.vectors is None:
            self._vecs = None
            return
        v = self.vectors
        if hasattr(v, "detach"):
            v = v.detach().float().cpu().numpy()
        v = np.ascontiguousarray(np.asarray(v, dtype=np.float32))
        if v.ndim == 1:
            v = v[None, :]
        if v.ndim != 2 or v.shape[1] == 0 or v.shape[0] not in (1, len(pos)):
            raise ValueError(f"vectors must be [H], [1, H] or [len(positions)={len(pos)}, H], got shape {list(v.shape)}")
        if v.shape[0] > 1 and self.gen:
            raise ValueError("gen=True needs a single vector (generated positions have no per-position vector)")
        if not np.all(np.isfinite(v)):
            raise ValueError("vectors contain NaN or infinite values")
        self._vecs = v

    # ---- constructors ---------------------------------------------------------------------
    @classmethod
    def steer(cls, site: Any, vector: Any, *, scale: float = 1.0, positions: Sequence[int] = (),
              gen: bool = False, phase: str = "both", mask: Any = None) -> "RefEdit":
        layer, hook = parse_site(site)
        return cls(layer, hook, positions, "add", vector, scale=scale, gen=gen, phase=phase, mask=mask)

    @classmethod
    def patch(cls, site: Any, positions: Sequence[int], targets: Any, *, alpha: float = 1.0, mask: Any = None) -> "RefEdit":
        layer, hook = parse_site(site)
        return cls(layer, hook, positions, "replace", targets, alpha=alpha, mask=mask)

    @classmethod
    def zero(cls, site: Any, positions: Sequence[int], *, alpha: float = 1.0, mask: Any = None) -> "RefEdit":
        layer, hook = parse_site(site)
        return cls(layer, hook, positions, "replace", None, alpha=alpha, mask=mask)

    @classmethod
    def clamp(cls, site: Any, vector: Any, *, min: float | None = None, max: float | None = None, strength: float = 1.0,
              positions: Sequence[int] = (), gen: bool = False, phase: str = "both") -> "RefEdit":
        """A directional clamp of the projection onto `vector / |vector|` to [min, max] (None: open)."""
        layer, hook = parse_site(site)
        return cls(layer, hook, positions, "clamp", vector, gen=gen, phase=phase,
                   lo=float("-inf") if min is None else min, hi=float("inf") if max is None else max, strength=strength)

    @classmethod
    def gate(cls, site: Any, probe: Any, term: Any, *, threshold: float, sharpness: float,
             positions: Sequence[int] = (), gen: bool = False, phase: str = "both") -> "RefEdit":
        """A row gate: `term` applied scaled by `sigmoid(sharpness * (s . probe - threshold))` of
        the same position's pre-edit value `s` (the fork's per-row `this_token` monitor)."""
        layer, hook = parse_site(site)
        return cls(layer, hook, positions, "gate", term, gen=gen, phase=phase, probe=probe, threshold=threshold,
                   sharpness=sharpness)

    @classmethod
    def noise(cls, positions: Sequence[int], vectors: Any) -> "RefEdit":
        """The ROME corruption: per-position vectors added to the input embeddings (L0.pre_attn)."""
        return cls(0, "pre_attn", positions, "add", vectors, scale=1.0)

    # ---- semantics --------------------------------------------------------------------------
    @property
    def site(self) -> SiteKey:
        return (self.layer, self.hook)

    @property
    def hidden_size(self) -> int | None:
        return None if self._vecs is None else int(self._vecs.shape[1])

    def applies(self, position: int, n_prompt: int) -> bool:
        """Does this edit act at `position` (the engine's `AddOp.applies` for adds)?"""
        if self.kind == "replace":
            return position in self._index
        is_gen = position >= n_prompt
        if self.phase == "prefill" and is_gen or self.phase == "decode" and not is_gen:
            return False
        if self.gen and is_gen:
            return True
        return position in self._index

    def target_at(self, position: int) -> np.ndarray | None:
        """Replace: the float32 target at `position` (None = zero-ablation)."""
        if self._vecs is None:
            return None
        return self._vecs[self._index[position] if self._vecs.shape[0] > 1 else 0]

    def add_at(self, position: int) -> np.ndarray:
        """Add: the float32 vector added at `position`: `vec * f32(scale)` (masked: `f32(vec * m) * f32(scale)`)."""
        v = self._vecs[self._index[position] if self._vecs.shape[0] > 1 else 0]
        if self.mask is not None:
            v = (v * self.mask).astype(np.float32)
        return v * np.float32(self.scale)

    def coefficients(self, hidden: int) -> tuple[np.ndarray, np.float32 | None]:
        """Replace: (`a` per dimension, `f32(alpha * m)` per dimension or None without a mask)."""
        if self.mask is None:
            return np.full(hidden, np.float32(1.0 - self.alpha), np.float32), None
        am = np.float64(self.alpha) * self.mask.astype(np.float64)
        return (1.0 - am).astype(np.float32), am.astype(np.float32)


def edits_from_program(program: dict, *, named_vector: Callable[[str], Any] | None = None,
                       source_value: Callable[[str, int, int], Any] | None = None,
                       source_mean: Callable[[str, int], Any] | None = None,
                       ) -> tuple[list[RefEdit], list[SiteKey]]:
    """The `RefEdit`s (in the engine's order) and capture sites of a compiled wire program
    (`program.compile_program`'s output). Named vectors and stored source runs are resolved
    with the callbacks (`source_value(run_id, site_index, position)`,
    `source_mean(run_id, site_index)`, site_index as in `engine_ext.sites.site_index`); a missing one
    raises KeyError."""
    from engine_ext.program import decode_mask
    from engine_ext.specs import decode_vector

    def site_of(index: int) -> SiteKey:
        site = site_from_index(int(index))
        return site.layer, site.hook

    def need(value: Any, what: str) -> Any:
        if value is None:
            raise KeyError(f"{what} is not available")
        return value

    edits: list[RefEdit] = []
    patches: list[RefEdit] = []
    for p in program.get("patch") or []:
        site, src, dst = int(p["site"]), p["src"], [int(x) for x in p["dst"]]
        if "run" in src:
            if source_value is None:
                raise KeyError(f"source run {src['run']!r}: no source_value callback")
            t: Any = [np.asarray(need(source_value(src["run"], site, int(q)), f"run {src['run']!r} at {q}"),
                                 np.float32) for q in src["pos"]]
        elif "vecs" in src:
            t = [decode_vector(v) for v in src["vecs"]]
        elif "mean_of" in src:
            if source_mean is None:
                raise KeyError(f"source run {src['mean_of']!r}: no source_mean callback")
            t = [np.asarray(need(source_mean(src["mean_of"], site), f"mean of run {src['mean_of']!r}"), np.float32)]
        else:
            t = None
        patches.append(RefEdit(*site_of(site), dst, "replace", None if t is None else np.stack(t), alpha=float(p["alpha"]),
                               mask=decode_mask(p.get("mask"))))
    clamps: list[RefEdit] = []
    for c in program.get("clamp") or []:
        for site in c["sites"]:
            clamps.append(RefEdit(*site_of(site), [int(x) for x in c["pos"]], "clamp", decode_vector(c["dir"]), gen=bool(c["gen"]),
                                  phase=c["phase"], lo=float("-inf") if c["lo"] is None else c["lo"],
                                  hi=float("inf") if c["hi"] is None else c["hi"], strength=float(c["st"])))
    for s in program.get("steer") or []:
        if s["vec"] is not None:
            vec = decode_vector(s["vec"])
        else:
            if named_vector is None:
                raise KeyError(f"named vector {s['name']!r}: no named_vector callback")
            vec = need(named_vector(s["name"]), f"named vector {s['name']!r}")
        for site in s["sites"]:
            edits.append(RefEdit(*site_of(site), [int(x) for x in s["pos"]], "add", vec, scale=float(s["scale"]),
                                 gen=bool(s["gen"]), phase=s["phase"], mask=decode_mask(s.get("mask"))))
    nz = program.get("noise")
    if nz:
        edits.append(RefEdit.noise([int(x) for x in nz["pos"]], np.stack([decode_vector(v) for v in nz["vecs"]])))
    cap = program.get("capture")
    capture = [site_of(s) for s in cap["sites"]] if cap else []
    return patches + edits + clamps, capture


@dataclass
class _SitePlan:
    rows: Any  # LongTensor of positions touched
    a: Any  # float32 [k, H]
    c: Any  # float32 [k, H]
    #: clamps: indices into `rows` of the clamped ones, their unit directions [m, K, H] (zero-padded),
    #: bounds and strengths [m, K] (or None: no clamp at this site)
    cl_rows: Any = None
    cl_dirs: Any = None
    cl_lo: Any = None
    cl_hi: Any = None
    cl_st: Any = None
    #: row gates: indices into `rows`, probes [m, H], [threshold, sharpness] [m, 2], terms [m, H];
    #: `g_out` (score, g) [m] set by `_apply`
    g_rows: Any = None
    g_probe: Any = None
    g_params: Any = None
    g_term: Any = None
    g_out: Any = None


class HFReference:
    """A transformers model + tokenizer on CPU (float32 by default)."""

    def __init__(self, model_path: str | Path | None = None, dtype: str = "float32", device: str = "cpu"):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_path = Path(model_path) if model_path else bundled_model_path()
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=getattr(torch, dtype)).to(device).eval()
        self.device = device

    @classmethod
    def from_model(cls, model: Any, tokenizer: Any = None, device: str = "cpu") -> "HFReference":
        """Wrap an already loaded causal LM (e.g. a random one in a test); `tokenizer` may be
        None when only token ids are used (`generate` then takes eos from the model config)."""
        self = cls.__new__(cls)
        self.model_path = None
        self.tokenizer = tokenizer
        self.model = model.to(device).eval()
        self.device = device
        return self

    # ---- model geometry ----------------------------------------------------------------------
    @property
    def layers(self) -> Any:
        inner = getattr(self.model, "model", None)
        layers = getattr(inner, "layers", None)
        if layers is None:
            layers = self.model.get_decoder().layers
        return layers

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    @property
    def embedding_std(self) -> float:
        """Std of the input embedding matrix (the unit of the noise scale), as the engine computes it."""
        return float(self.model.get_input_embeddings().weight.float().std().item())

    def all_sites(self) -> list[SiteKey]:
        return [(i, h) for i in range(self.num_layers) for h in HOOKS]

    def noise_edit(self, positions: Sequence[int], *, scale: float = 3.0, seed: int = 0,
                   std: float | None = None) -> RefEdit:
        """The ROME corruption the engine draws for `Noise(positions, scale, seed)`:
        `program.noise_vectors` added to the input embeddings (positions absolute, sorted as
        the engine resolves them)."""
        from engine_ext.program import noise_vectors

        pos = sorted(set(int(p) for p in positions))
        vecs = noise_vectors(len(pos), self.hidden_size, scale, self.embedding_std if std is None else std, seed)
        return RefEdit.noise(pos, vecs)

    # ---- plain API ---------------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def logits(self, ids: list[int]) -> Any:
        """Next-token logits (float32) at every position of `ids`: shape [len(ids), vocab]."""
        import torch

        with torch.no_grad():
            x = torch.tensor([ids], device=self.device)
            return self.model(input_ids=x).logits[0].float()

    def greedy(self, prompt: str | list[int], max_tokens: int) -> ReferenceGeneration:
        """Greedy continuation without interventions (stops after EOS)."""
        return self.generate(prompt, max_tokens)

    # ---- interventions ---------------------------------------------------------------------
    def _check(self, edits: Sequence[RefEdit], capture: Iterable[Any] | str) -> tuple[list[RefEdit], list[SiteKey]]:
        edits = list(edits)
        for k, e in enumerate(edits):
            if not isinstance(e, RefEdit):
                raise TypeError(f"edits[{k}] is not a RefEdit: {e!r}")
            if e.layer >= self.num_layers:
                raise ValueError(f"edits[{k}]: layer {e.layer} is out of range (the model has layers 0..{self.num_layers - 1})")
            if e.hidden_size is not None and e.hidden_size != self.hidden_size:
                raise ValueError(f"edits[{k}]: vectors have dimension {e.hidden_size}, the hidden size is {self.hidden_size}")
            if e.mask is not None and e.mask.shape[0] != self.hidden_size:
                raise ValueError(f"edits[{k}]: the mask has {e.mask.shape[0]} weights, the hidden size is {self.hidden_size}")
        sites = self.all_sites() if capture == "all" else [parse_site(s) for s in capture]
        for layer, hook in sites:
            if layer >= self.num_layers:
                raise ValueError(f"capture site L{layer}.{hook}: layer out of range (the model has layers 0..{self.num_layers - 1})")
        return edits, list(dict.fromkeys(sites))

    def _plan(self, edits: list[RefEdit], n: int, n_prompt: int) -> dict[SiteKey, _SitePlan]:
        """Per site: the rows touched and their (a, c), composed exactly as the engine does."""
        import torch

        by_site: dict[SiteKey, list[RefEdit]] = {}
        for e in edits:
            by_site.setdefault(e.site, []).append(e)
        plans: dict[SiteKey, _SitePlan] = {}
        H = self.hidden_size
        for site, es in by_site.items():
            reps = [e for e in es if e.kind == "replace"]
            adds = [e for e in es if e.kind == "add"]
            clamps = [e for e in es if e.kind == "clamp"]
            gates = [e for e in es if e.kind == "gate"]
            rows, a_list, c_list, cl, gl = [], [], [], [], []
            for p in range(n):
                rep = None
                for e in reps:  # the last replace covering p wins (the engine's per-(site, pos) table)
                    if e.applies(p, n_prompt):
                        rep = e
                here = [e for e in adds if e.applies(p, n_prompt)]
                cl_here = [e for e in clamps if e.applies(p, n_prompt)]
                g_here = [e for e in gates if e.applies(p, n_prompt)]
                if rep is None and not here and not cl_here and not g_here:
                    continue
                if len(g_here) > 1:
                    raise ValueError(f"{len(g_here)} row gates at site L{site[0]}.{site[1]}, position {p}: at most one")
                if g_here:
                    gl.append((len(rows), g_here[0], p))
                if cl_here:
                    cl.append((len(rows), cl_here))
                if rep is not None:
                    t = rep.target_at(p)
                    a, am = rep.coefficients(H)
                    if t is None:
                        c = None
                    else:
                        c = np.float32(rep.alpha) * t if am is None else am * t
                else:
                    a, c = np.ones(H, np.float32), None
                for e in here:
                    v = e.add_at(p)
                    c = v.astype(np.float32) if c is None else c + v
                rows.append(p)
                a_list.append(a)
                c_list.append(np.zeros(H, np.float32) if c is None else np.asarray(c, np.float32))
            if rows:
                plans[site] = _SitePlan(torch.tensor(rows, dtype=torch.long, device=self.device),
                                        torch.from_numpy(np.stack(a_list)).to(self.device),
                                        torch.from_numpy(np.stack(c_list)).to(self.device))
            if gl:
                sp = plans[site]
                sp.g_rows = torch.tensor([r for r, _, _ in gl], dtype=torch.long, device=self.device)
                sp.g_probe = torch.from_numpy(np.stack([e.probe for _, e, _ in gl])).to(self.device)
                sp.g_params = torch.tensor([[e.threshold, e.sharpness] for _, e, _ in gl], dtype=torch.float32,
                                           device=self.device)
                sp.g_term = torch.from_numpy(np.stack([e.add_at(p) for _, e, p in gl])).to(self.device)
            if cl:
                k = max(len(es_) for _, es_ in cl)
                dirs = np.zeros((len(cl), k, H), np.float32)
                lo = np.full((len(cl), k), -np.inf, np.float32)
                hi = np.full((len(cl), k), np.inf, np.float32)
                st = np.ones((len(cl), k), np.float32)
                for i, (_, es_) in enumerate(cl):
                    for j, e in enumerate(es_):
                        dirs[i, j], lo[i, j], hi[i, j], st[i, j] = e.vectors, e.lo, e.hi, e.strength
                sp = plans[site]
                sp.cl_rows = torch.tensor([r for r, _ in cl], dtype=torch.long, device=self.device)
                sp.cl_dirs, sp.cl_lo, sp.cl_hi, sp.cl_st = (torch.from_numpy(t).to(self.device) for t in (dirs, lo, hi, st))
        return plans

    @staticmethod
    def _apply(h: Any, plan: _SitePlan | None) -> None:
        """In place on `h` [1, T, H]: `new = c if a == 0 else a * s + c` on the planned rows."""
        import torch

        if plan is None:
            return
        s = h[0, plan.rows].float()
        new = torch.where(plan.a == 0, plan.c, plan.a * s + plan.c)
        if plan.g_rows is not None:
            score = (s[plan.g_rows] * plan.g_probe).sum(dim=-1)
            g = 1.0 / (1.0 + torch.exp(-(plan.g_params[:, 1] * (score - plan.g_params[:, 0]))))
            new[plan.g_rows] = new[plan.g_rows] + (g - 1.0).unsqueeze(1) * plan.g_term
            plan.g_out = (score, g)
        if plan.cl_rows is not None:
            v = new[plan.cl_rows]
            proj = (v.unsqueeze(1) * plan.cl_dirs).sum(dim=-1)
            delta = plan.cl_st * (torch.minimum(torch.maximum(proj, plan.cl_lo), plan.cl_hi) - proj)
            new[plan.cl_rows] = v + (delta.unsqueeze(-1) * plan.cl_dirs).sum(dim=1)
        h[0, plan.rows] = new.to(h.dtype)

    def run(self, ids: Sequence[int], edits: Sequence[RefEdit] = (), capture: Iterable[Any] | str = (),
            n_prompt: int | None = None) -> RefRun:
        """One full forward over `ids` with `edits` applied at every position they cover.

        `capture`: sites (`(layer, hook)`, `"L3.post_attn"`, `specs.Site`) or `"all"`; each is
        recorded at every position, after the interventions at that site. `n_prompt` (default:
        all of `ids`) splits prompt from generated positions for `gen` / `phase`."""
        import torch

        ids = [int(t) for t in ids]
        n = len(ids)
        if n == 0:
            raise ValueError("ids must not be empty")
        n_prompt = n if n_prompt is None else int(n_prompt)
        edits, cap_sites = self._check(edits, capture)
        plans = self._plan(edits, n, n_prompt)
        wanted = set(cap_sites)
        captures: dict[SiteKey, Any] = {}
        fired: dict[SiteKey, int] = {}
        layers = self.layers

        def visit(site: SiteKey, h: Any) -> None:
            fired[site] = fired.get(site, 0) + 1
            self._apply(h, plans.get(site))
            if site in wanted:
                captures[site] = h[0].detach().float().clone()

        def pre_attn_hook(i: int):
            def hook(_mod, args, kwargs):
                if args:
                    h = args[0].clone()
                    visit((i, "pre_attn"), h)
                    return (h, *args[1:]), kwargs
                h = kwargs["hidden_states"].clone()
                visit((i, "pre_attn"), h)
                return args, {**kwargs, "hidden_states": h}
            return hook

        def post_attn_hook(i: int):
            def hook(_mod, args):
                # in place: the same tensor is the residual of the MLP add
                visit((i, "post_attn"), args[0])
            return hook

        def mlp_in_hook(i: int):
            def hook(_mod, args):
                h = args[0].clone()
                visit((i, "mlp_in"), h)
                return (h, *args[1:])
            return hook

        def mlp_out_hook(i: int):
            def hook(_mod, _args, output):
                out = output[0] if isinstance(output, tuple) else output  # MoE blocks may add router logits
                h = out.clone()
                visit((i, "mlp_out"), h)
                return (h, *output[1:]) if isinstance(output, tuple) else h
            return hook

        def post_block_hook(i: int):
            def hook(_mod, _args, output):
                out = output[0] if isinstance(output, tuple) else output
                h = out.clone()
                visit((i, "post_block"), h)
                return (h, *output[1:]) if isinstance(output, tuple) else h
            return hook

        active = set(plans) | wanted
        handles = []
        try:
            for layer, hook in sorted(active):
                mod = layers[layer]
                if hook == "pre_attn":
                    handles.append(mod.register_forward_pre_hook(pre_attn_hook(layer), with_kwargs=True))
                elif hook == "post_attn":
                    handles.append(mod.post_attention_layernorm.register_forward_pre_hook(post_attn_hook(layer)))
                elif hook == "mlp_in":
                    handles.append(mod.mlp.register_forward_pre_hook(mlp_in_hook(layer)))
                elif hook == "mlp_out":
                    handles.append(mod.mlp.register_forward_hook(mlp_out_hook(layer)))
                else:
                    handles.append(mod.register_forward_hook(post_block_hook(layer)))
            with torch.no_grad():
                x = torch.tensor([ids], device=self.device)
                logits = self.model(input_ids=x).logits[0].float()
        finally:
            for hd in handles:
                hd.remove()
        bad = sorted(s for s in active if fired.get(s) != 1)
        if bad:
            raise RuntimeError(f"site hooks fired {[fired.get(s, 0) for s in bad]} times at {bad} (expected once): "
                               "unsupported decoder layer structure")
        gates = {site: {int(plan.rows[i]): (float(sc), float(g))
                        for i, sc, g in zip(plan.g_rows.tolist(), plan.g_out[0].tolist(), plan.g_out[1].tolist())}
                 for site, plan in plans.items() if plan.g_rows is not None}
        return RefRun(ids, n_prompt, logits, {s: captures[s] for s in cap_sites}, gates)

    def generate(self, prompt: str | Sequence[int], max_tokens: int, edits: Sequence[RefEdit] = (),
                 capture: Iterable[Any] | str = (), stop_at_eos: bool = True) -> ReferenceGeneration:
        """Greedy generation with interventions, recomputing the whole sequence each step (no KV
        cache): edits at prompt positions act in every step; `gen` / explicit generated
        positions act on generated tokens once they are fed back. Returns the tokens, their
        logprobs, top-2 gaps, the full logprob row of every step (`step_logprobs`) and the
        captures of the final forward (every position ever fed to the model)."""
        import torch

        ids = self.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        prompt_ids = list(ids)
        n_prompt = len(prompt_ids)
        edits, cap_sites = self._check(edits, capture)
        out, lps, gaps, rows = [], [], [], []
        captures: dict[SiteKey, Any] = {}
        eos = self.tokenizer.eos_token_id if self.tokenizer is not None else self.model.config.eos_token_id
        eos_ids = set() if eos is None else {int(eos)} if isinstance(eos, (int, np.integer)) else {int(e) for e in eos}
        for _ in range(max_tokens):
            r = self.run(ids, edits, cap_sites, n_prompt=n_prompt)
            captures = r.captures
            logp = torch.log_softmax(r.logits[-1], dim=-1)
            top2 = torch.topk(logp, 2)
            tid = int(top2.indices[0])
            out.append(tid)
            lps.append(float(top2.values[0]))
            gaps.append(float(top2.values[0] - top2.values[1]))
            rows.append(logp)
            ids.append(tid)
            if stop_at_eos and tid in eos_ids:
                break
        step_logprobs = torch.stack(rows) if rows else torch.zeros(0, self.model.config.vocab_size)
        return ReferenceGeneration(prompt_ids, out, lps, gaps, step_logprobs, captures)

    def score(self, prompt: str | Sequence[int], token_ids: Iterable[int],
              edits: Sequence[RefEdit] = ()) -> dict[int, float]:
        """Exact logprobs of `token_ids` at the last prompt position (next-token distribution
        after the prompt), with `edits` applied."""
        ids = self.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        logp = self.run(ids, edits, n_prompt=len(ids)).logprobs(-1)
        return {int(t): float(logp[int(t)]) for t in token_ids}
