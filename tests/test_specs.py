"""Spec parsing, canonical form and program compilation (client side; no engine)."""

import numpy as np
import pytest

from engine_ext.worker.checksum import ActionChecksum, compare_ranks
from engine_ext.errors import SpecError
from engine_ext.program import ModelDims, PromptInfo, WorkerProgram, compile_program, resolve_positions, noise_vectors
from engine_ext.specs import Capture, Interventions, Noise, Patch, Steer, canonical_json, positions_from_json, spec_hash
from engine_ext.sites import HOOKS, SITES_PER_LAYER, Site

DIMS = ModelDims(num_layers=4, hidden_size=8, vocab_size=100, embedding_std=0.5)
TEXT = "The capital of North Kell is"
# BOS + 6 word tokens, with character offsets as a word-level tokenizer gives them
PROMPT = PromptInfo([1, 10, 11, 12, 13, 14, 15], TEXT,
                    [(0, 0), (0, 3), (4, 11), (12, 14), (15, 20), (21, 25), (26, 28)], max_tokens=3)


def spec_of(data: dict) -> Interventions:
    """An `Interventions` built through the `make` constructors from their keyword arguments
    (field names as the HTTP API spells them)."""
    return Interventions(
        steer=tuple(Steer.make(**s, field_name=f"steer[{k}]") for k, s in enumerate(data.get("steer", []))),
        patch=tuple(Patch.make(**p, field_name=f"patch[{k}]") for k, p in enumerate(data.get("patch", []))),
        capture=Capture.make(**data["capture"]) if "capture" in data else None,
        noise=Noise.make(**data["noise"]) if "noise" in data else None,
        score_token_ids=tuple(data.get("score_token_ids", ())),
    )


def compile_(spec: dict, named=lambda n: None):
    return compile_program(spec_of(spec), PROMPT, DIMS, key="k", named_vector_dims=named)


def test_site_text_form_round_trips():
    s = Site(3, "post_attn")
    assert str(s) == "L3.post_attn" and Site.parse("L3.post_attn") == s
    assert s.index() == 3 * SITES_PER_LAYER + HOOKS.index("post_attn")


@pytest.mark.parametrize("sel, expected", [
    ("last_prompt", ([6], False)), ("all_prompt", (list(range(7)), False)), ("all_generated", ([], True)),
    ("all", (list(range(7)), True)), ([-1, 0], ([0, 6], False)), ([{"span": "North Kell"}], ([4, 5], False)),
    ([7], ([7], False)),  # first generated token fed back (max_tokens=3 -> positions 7, 8)
])
def test_position_resolution(sel, expected):
    assert resolve_positions(positions_from_json(sel), PROMPT, "p") == expected


@pytest.mark.parametrize("spec, field", [
    ({"steer": [{"sites": ["L4.pre_attn"], "vector": [0.0] * 8}]}, "steer[0].sites[0]"),
    ({"steer": [{"sites": ["L1.attn_out"], "vector": [0.0] * 8}]}, "steer[0].sites[0]"),
    ({"steer": [{"sites": ["L1.pre_attn"], "vector": [0.0] * 7}]}, "steer[0].vector"),
    ({"steer": [{"sites": ["L1.pre_attn"], "vector": [float("nan")] * 8}]}, "steer[0].vector"),
    ({"steer": [{"sites": ["L1.pre_attn"], "name": "nope"}]}, "steer[0].name"),
    ({"steer": [{"sites": ["L1.pre_attn"], "vector": [0.0] * 8, "positions": [9]}]}, "steer[0].positions[0]"),
    ({"patch": [{"site": "L1.pre_attn", "positions": [{"span": "Varnia"}], "source": "zeros"}]}, "patch[0].positions[0].span"),
    ({"patch": [{"site": "L1.pre_attn", "positions": [{"span": "is", "occurrence": 1}], "source": "zeros"}]}, "patch[0].positions[0].span"),
    ({"patch": [{"site": "L1.pre_attn", "positions": [1, 2], "source": {"run": "r", "positions": [1]}}]}, "patch[0].source.positions"),
    ({"patch": [{"site": "L1.pre_attn", "positions": "all", "source": "zeros"}]}, "patch[0].positions"),
    ({"patch": [{"site": "L1.pre_attn", "positions": [1], "source": "ones"}]}, "patch[0].source"),
    ({"patch": [{"site": "L1.pre_attn", "positions": [1], "source": "zeros", "alpha": float("inf")}]}, "patch[0].alpha"),
    ({"noise": {"positions": [1], "scale": -1}}, "noise.scale"),
    ({"capture": {"sites": ["L9.pre_attn"]}}, "capture.sites[0]"),
])
def test_bad_specs_name_the_field(spec, field):
    with pytest.raises(SpecError) as err:
        compile_(spec)
    assert err.value.field == field, str(err.value)


def test_score_token_ids_are_checked_once():
    from engine_ext.program import check_score_token_ids

    assert check_score_token_ids([5, 3, 5], 100) == [5, 3]
    for ids, field in (([100], "score_token_ids[0]"), ([1, -1], "score_token_ids[1]"), (list(range(129)), "score_token_ids")):
        with pytest.raises(SpecError) as err:
            check_score_token_ids(ids, 100)
        assert err.value.field == field


def test_too_many_sites_is_refused():
    from engine_ext.program import Limits

    spec = spec_of({"capture": {"sites": [f"L{i}.{h}" for i in range(4) for h in ("pre_attn", "post_attn", "post_block")],
                                "positions": "all_prompt"}})
    with pytest.raises(SpecError, match="too many sites"):
        compile_program(spec, PROMPT, DIMS, key="k", named_vector_dims=lambda n: None, limits=Limits(max_site_positions=50))


def test_canonical_form_and_hash_are_stable():
    a = compile_({"steer": [{"sites": ["L1.pre_attn"], "vector": [1.0] * 8, "scale": 2.0}]})
    b = compile_({"steer": [{"scale": 2.0, "vector": [1.0] * 8, "sites": ["L1.pre_attn"]}]})
    assert canonical_json(a) == canonical_json(b) and a["hash"] == b["hash"]
    c = compile_({"steer": [{"sites": ["L1.pre_attn"], "vector": [1.0] * 8, "scale": 2.5}]})
    assert c["hash"] != a["hash"]
    assert spec_hash({"x": 1, "y": 2}) == spec_hash({"y": 2, "x": 1})


def test_worker_program_voids_missing_sources_and_resolves_present_ones():
    prog = compile_({"patch": [{"site": "L1.post_attn", "positions": [5, 6], "source": {"run": "clean"}}]})
    pair = (np.ones(8, np.float32), np.zeros(8, np.float32))
    wp = WorkerProgram.parse(prog, named_vector=lambda n: None, source_value=lambda run, s, p: pair if p == 5 else None,
                             source_mean=lambda r, s: None)
    assert wp.voided and "[6]" in wp.errors[0]
    assert (Site(1, "post_attn").index(), 5) in wp.replaces


def test_noise_is_seeded():
    a, b, c = noise_vectors(3, 8, 3.0, 0.5, 7), noise_vectors(3, 8, 3.0, 0.5, 7), noise_vectors(3, 8, 3.0, 0.5, 8)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert abs(float(np.std(noise_vectors(400, 64, 3.0, 0.5, 0))) - 1.5) < 0.05


def test_checksum_is_order_sensitive_and_comparison_reports_mismatch():
    a, b = ActionChecksum(), ActionChecksum()
    for ck in (a, b):
        ck.begin_step()
    a.fold("steer", "k1", 3, [1, 2]); a.fold("patch", "k2", 4, [5])
    b.fold("patch", "k2", 4, [5]); b.fold("steer", "k1", 3, [1, 2])
    assert a.count == b.count == 2 and a.value != b.value
    one = compare_ranks([{"tp_rank": 0, "pp_rank": 0, **a.status()}])
    assert one["consistent"] is True
    two = compare_ranks([{"tp_rank": 0, "pp_rank": 0, **a.status()}, {"tp_rank": 1, "pp_rank": 0, **b.status()}])
    assert two["consistent"] is False and set(two["mismatches"]["pp0"]) == {"tp0/pp0", "tp1/pp0"}
    assert two["checksums"] == {"tp0/pp0": a.status()["action_checksum"], "tp1/pp0": b.status()["action_checksum"]}
    # ranks of different pipeline stages are not compared with each other
    stages = compare_ranks([{"tp_rank": 0, "pp_rank": 0, **a.status()}, {"tp_rank": 0, "pp_rank": 1, **b.status()}])
    assert stages["consistent"] is True
