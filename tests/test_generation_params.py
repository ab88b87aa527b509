"""GenerationParams refuses bad values with an error naming the field (no engine needed)."""

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
    ],
)
def test_bad_params_name_the_field(kwargs, field):
    with pytest.raises(SpecError) as err:
        GenerationParams(**kwargs).validate()
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}: ")


def test_good_params_pass():
    GenerationParams(max_tokens=1, temperature=0.7, top_p=0.9, top_k=5, logprobs=20, stop=("\n",)).validate()
