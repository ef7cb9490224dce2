"""From request bodies to SamplingParams: defaults, seeds of n > 1 children, and the 400s."""

import pytest

from ninefold.llm.sampling import SamplingParams
from ninefold.llm.server.errors import APIError
from ninefold.llm.server.preprocess import Limits, Prompt, check_prompt, resolve_max_tokens, sampling_params
from ninefold.llm.server.protocol import ChatCompletionRequest, CompletionRequest

LIMITS = Limits(max_model_len=100, vocab_size=50, kv_capacity_tokens=64, max_sequences=4)


def _params(child=0, defaults=None, **body):
    req = CompletionRequest(prompt="x", **body)
    return sampling_params(req, max_tokens=5, logprobs=None, limits=LIMITS, child=child, defaults=defaults)


def test_fields_left_out_come_from_the_model_defaults():
    model = SamplingParams(temperature=0.0, top_p=0.8, top_k=30, repetition_penalty=1.2)
    p = _params(defaults=model)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.0, 0.8, 30, 1.2)
    p = _params(defaults=model, temperature=0.7, top_k=-1)
    assert (p.temperature, p.top_p, p.top_k) == (0.7, 0.8, -1)
    p = _params()
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 1.0, 0, 0.0)


def test_children_get_distinct_seeds_and_the_request_fields():
    seeds = [_params(child=i, seed=7, stop=["a"], logit_bias={"3": 5}).seed for i in range(3)]
    assert seeds == [7, 8, 9]
    p = _params(seed=7, stop="zz", logit_bias={"3": 5}, ignore_eos=True, min_tokens=2)
    assert p.stop_strings == ["zz"] and p.logit_bias == {3: 5.0} and p.ignore_eos and p.min_tokens == 2
    assert _params().seed is None


@pytest.mark.parametrize(("body", "param"), [
    ({"logit_bias": {"50": 1}}, "logit_bias"),
    ({"stop_token_ids": [50]}, "stop_token_ids"),
    ({"min_tokens": 6}, "min_tokens"),
])
def test_vocabulary_and_length_checks(body, param):
    with pytest.raises(APIError) as err:
        _params(**body)
    assert err.value.status == 400 and err.value.param == param


def test_context_and_kv_limits():
    with pytest.raises(APIError, match="context length"):
        check_prompt(Prompt(list(range(10)) * 10), LIMITS, "prompt")
    with pytest.raises(APIError, match="outside the vocabulary"):
        check_prompt(Prompt([1, 99]), LIMITS, "prompt")
    assert resolve_max_tokens(None, 10, Limits(100, 50), "max_tokens") == 90
    with pytest.raises(APIError, match="KV cache"):
        resolve_max_tokens(60, 10, LIMITS, "max_tokens")
    with pytest.raises(APIError, match="context length"):
        resolve_max_tokens(95, 10, LIMITS, "max_tokens")


def test_chat_request_needs_messages():
    with pytest.raises(ValueError):
        ChatCompletionRequest(messages=[])
