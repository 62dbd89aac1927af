"""SamplingParams: a bad value is refused naming its parameter; defaults and coercion."""
from __future__ import annotations

import pytest

from vinoserve.scheduler.sampling_params import SamplingParams


@pytest.mark.parametrize("kwargs, name", [
    (dict(max_tokens=-1), "max_tokens"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=1.1), "min_p"),
    (dict(min_p=-0.1), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-2.1), "frequency_penalty"),
    (dict(logprobs=-1), "logprobs"),
    (dict(logprobs=21), "logprobs"),
    (dict(max_tokens=4, min_tokens=5), "min_tokens"),
    (dict(n=0), "n"),
])
def test_validation_names_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name}"):
        SamplingParams(**kwargs)


def test_params_defaults_and_coercion():
    p = SamplingParams(stop="\n", stop_token_ids=[3, 4], top_k=-1, logprobs=20)
    assert p.stop == ("\n",) and p.stop_token_ids == (3, 4)
    assert not p.is_greedy and SamplingParams(temperature=0).is_greedy
    assert hash(p) == hash(SamplingParams(stop=("\n",), stop_token_ids=(3, 4), top_k=-1, logprobs=20))
