"""GenerationParams refuses bad values with an error naming the field (no engine needed), and
what `detokenize=False` changes in a generation (the engine)."""

import math

import pytest

from engine_ext import GenerationParams, SpecError


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"logprobs": 21}, "logprobs"),
        ({"stop": ("",)}, "stop"),
        ({"detokenize": 0}, "detokenize"),
        ({"stop": ("\n",), "detokenize": False}, "detokenize"),
    ],
)
def test_bad_params_name_the_field(kwargs, field):
    with pytest.raises(SpecError) as err:
        GenerationParams(**kwargs).validate()
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}: ")


def test_good_params_pass():
    GenerationParams(max_tokens=1, temperature=0.7, top_p=0.9, top_k=5, logprobs=20, stop=("\n",)).validate()


def test_without_detokenize_a_generation_has_the_same_ids_and_scores_and_no_text(engine):
    """`detokenize=False` (a sweep's cells): vLLM decodes nothing, everything else is unchanged."""
    from engine_ext.specs import Interventions

    spec = Interventions(score_token_ids=(5, 9))
    prompt = "The capital of"
    with_text = engine.generate(prompt, GenerationParams(max_tokens=3), spec)
    without = engine.generate(prompt, GenerationParams(max_tokens=3, detokenize=False), spec)
    assert with_text.text and without.text == ""
    assert without.token_ids == with_text.token_ids
    assert without.scores == with_text.scores
