"""``echo`` and prompt logprobs on /v1/completions (what lm-evaluation-harness's loglikelihood requests
send: ``echo=True, logprobs=N, max_tokens`` 0 or 1), through the official openai client, against the
engine run in this process on the same checkpoint."""

import httpx
import pytest
from tokenizers import Tokenizer

from ninefold import LLM, SamplingParams

from .helpers import check_error

PROMPT = "The quick brown fox jumps"


@pytest.fixture(scope="module")
def reference_tokenizer(tiny_model):
    return Tokenizer.from_file(str(tiny_model.path / "tokenizer.json"))


@pytest.fixture(scope="module")
def reference(tiny_model, reference_tokenizer):
    """The prompt's ids and prompt logprobs (top 3) from the engine in this process."""
    llm = LLM(str(tiny_model.path), device="cpu")
    ids = reference_tokenizer.encode(PROMPT).ids
    out = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(temperature=0, max_tokens=1,
                                                                              prompt_logprobs=3))[0]
    return ids, out.prompt_logprobs


def _check_offsets(lp) -> None:
    for i in range(1, len(lp.tokens)):
        assert lp.text_offset[i] == lp.text_offset[i - 1] + len(lp.tokens[i - 1])


def test_echo_prepends_the_prompt_to_the_completion(client):
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True})
    echoed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, echo=True,
                                       extra_body={"ignore_eos": True})
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    assert echoed.usage == plain.usage


def test_echo_with_logprobs_scores_every_prompt_token(client, reference, reference_tokenizer):
    ids, entries = reference
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, temperature=0, echo=True, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 1  # the prompt's tokens, then the generated one
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for p in range(1, len(ids)):
        assert lp.token_logprobs[p] == pytest.approx(entries[p][ids[p]], abs=1e-5)
        best = sorted(((v, t) for t, v in entries[p].items()), reverse=True)[:2]
        top = lp.top_logprobs[p]
        assert len(top) in (2, 3)  # the two best, and the prompt token when it is not among them
        for value, token in best:
            assert top[reference_tokenizer.decode([token], skip_special_tokens=False)] == pytest.approx(value, abs=1e-5)
    assert lp.token_logprobs[-1] <= 0.0
    assert out.choices[0].text.startswith(PROMPT)
    _check_offsets(lp)


def test_max_tokens_zero_with_echo_scores_the_prompt_only(client, reference):
    ids, entries = reference
    out = client.completions.create(model="tiny", prompt=ids, max_tokens=0, echo=True, logprobs=0)
    (choice,) = out.choices
    assert len(choice.logprobs.tokens) == len(ids)
    assert choice.logprobs.token_logprobs[1:] == pytest.approx([entries[p][ids[p]] for p in range(1, len(ids))],
                                                               abs=1e-5)
    assert choice.finish_reason == "length"
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)
    assert choice.text == "".join(choice.logprobs.tokens)  # token-id prompts echo as their decoded text


def test_streamed_echo_matches_the_whole_response(client):
    args = dict(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, echo=True, logprobs=1,
                extra_body={"ignore_eos": True})
    whole = client.completions.create(**args).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **args) if c.choices]
    assert chunks[0].text.startswith(PROMPT)
    assert "".join(c.text for c in chunks) == whole.text
    tokens = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
    offsets = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
    assert tokens == whole.logprobs.tokens and offsets == whole.logprobs.text_offset


def test_n_choices_each_echo_their_prompt(client):
    out = client.completions.create(model="tiny", prompt=[PROMPT, "Hello"], max_tokens=2, n=2, seed=3, echo=True,
                                    logprobs=1, extra_body={"ignore_eos": True})
    by_index = {c.index: c for c in out.choices}
    for index, prompt in ((0, PROMPT), (1, PROMPT), (2, "Hello"), (3, "Hello")):
        choice = by_index[index]
        assert choice.text.startswith(prompt)
        assert choice.logprobs.token_logprobs[0] is None


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_prompt_logprobs_extension(client, reference, endpoint, reference_tokenizer):
    if endpoint == "completions":
        out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 3})
        ids, entries = reference
    else:
        out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=1, extra_body={"prompt_logprobs": 1})
        ids, entries = None, None
    scored = out.choices[0].model_extra["prompt_logprobs"]
    assert scored[0] is None and all(isinstance(e, dict) and e for e in scored[1:])
    for entry in scored[1:]:
        for token_id, item in entry.items():
            assert int(token_id) >= 0 and item["logprob"] <= 0.0 and isinstance(item["decoded_token"], str)
    if ids is not None:
        assert len(scored) == len(ids)
        for p in range(1, len(ids)):
            assert scored[p][str(ids[p])]["logprob"] == pytest.approx(entries[p][ids[p]], abs=1e-5)
            assert scored[p][str(ids[p])]["decoded_token"] == reference_tokenizer.decode([ids[p]],
                                                                                         skip_special_tokens=False)


def test_prompt_logprobs_hold_the_asked_top_and_the_prompt_token_whatever_echo_asks(client, reference):
    ids, _ = reference
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, echo=True, logprobs=3,
                                    extra_body={"prompt_logprobs": 0})
    scored = out.choices[0].model_extra["prompt_logprobs"]
    assert [list(e) if e else None for e in scored] == [None] + [[str(t)] for t in ids[1:]]
    # echo's own top 3 (and the prompt token); tokens that render alike share a key
    assert all(1 <= len(top) <= 4 for top in out.choices[0].logprobs.top_logprobs[1:])


def test_bad_echo_and_prompt_logprobs_requests_are_400(server):
    url = server.base + "/v1/completions"
    check_error(httpx.post(url, json={"prompt": "x", "max_tokens": 0}), 400, "max_tokens", text="echo")
    check_error(httpx.post(url, json={"prompt": "x", "prompt_logprobs": 21}), 400, "prompt_logprobs")
    check_error(httpx.post(url, json={"prompt": "x", "prompt_logprobs": -1}), 400, "prompt_logprobs")
    check_error(httpx.post(url, json={"prompt": "x", "echo": "yes"}), 400, "echo")
    assert httpx.get(server.base + "/health").status_code == 200
