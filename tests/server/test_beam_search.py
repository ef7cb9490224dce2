"""``use_beam_search`` (vLLM's extra) on /v1/completions and /v1/chat/completions, through the official openai
client, against ``LLM.beam_search`` run in this process on the same checkpoint."""

import json
import time

import httpx
import pytest

from ninefold import LLM, BeamSearchParams

from .helpers import check_error

PROMPT = "The quick brown fox jumps"
MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(str(tiny_model.path), device="cpu")


def expected_choices(llm, prompt_ids, width, max_tokens, **options):
    """(text, generated ids, finish reason, cum logprob) of every beam, best first, as the server should show them."""
    result = llm.beam_search([prompt_ids], BeamSearchParams(width, max_tokens, **options))[0]
    choices = []
    for beam in result.sequences:
        generated = beam.tokens[len(prompt_ids):]
        shown = generated[:-1] if beam.finish_reason == "stop" and not options.get("include_stop_str_in_output") \
            else generated
        choices.append((llm.tokenizer.decode(shown), generated, beam.finish_reason, beam.cum_logprob))
    return choices


@pytest.mark.parametrize("length_penalty", [1.0, 0.0])
def test_completions_return_the_best_beams_with_their_logprobs(client, llm, length_penalty):
    ids = llm.tokenizer.encode(PROMPT)
    expected = expected_choices(llm, ids, 3, 8, length_penalty=length_penalty)
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, n=3, logprobs=2,
                                    extra_body={"use_beam_search": True, "length_penalty": length_penalty})
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [(c.text, c.finish_reason) for c in out.choices] == [(e[0], e[2]) for e in expected]
    for choice, (_, generated, _, cum) in zip(out.choices, expected):
        shown = choice.logprobs.token_logprobs
        assert len(shown) == len(generated)
        assert sum(shown) == pytest.approx(cum, abs=1e-3)  # each beam's own tokens' logprobs add up to its score
        assert all(len(top) <= 3 for top in choice.logprobs.top_logprobs)
    assert out.usage.completion_tokens == sum(len(e[1]) for e in expected)


def test_streamed_choices_arrive_whole_and_equal_the_response(client, llm):
    expected = expected_choices(llm, llm.tokenizer.encode(PROMPT), 2, 6, ignore_eos=True)
    texts, reasons = {0: "", 1: ""}, {}
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, n=2, stream=True,
                                       extra_body={"use_beam_search": True, "ignore_eos": True})
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason is not None:
                reasons[choice.index] = choice.finish_reason
    assert [texts[0], texts[1]] == [e[0] for e in expected]
    assert reasons == {0: "length", 1: "length"}


def test_chat_beams_continue_the_rendered_conversation(client, llm):
    ids = llm.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    expected = expected_choices(llm, ids, 2, 8)
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, n=2,
                                         extra_body={"use_beam_search": True})
    assert [(c.message.content, c.finish_reason) for c in out.choices] == [(e[0], e[2]) for e in expected]


@pytest.mark.parametrize("field, value", [
    ("temperature", 0.8), ("top_p", 0.5), ("stop", ["x"]), ("logit_bias", {"5": 3}), ("echo", True),
    ("presence_penalty", 0.5), ("response_format", {"type": "json_object"}), ("min_tokens", 2),
])
def test_fields_beam_search_cannot_honour_are_a_400_naming_them(server, field, value):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "n": 2, "use_beam_search": True, field: value}
    check_error(httpx.post(server.base + "/v1/completions", json=body, timeout=60), 400, field, "use_beam_search")
    assert server.wait_idle()["ninefold:num_sequences_admitted"] == 0


@pytest.mark.parametrize("penalty, status", [("long", 400), (float("inf"), 400), (400, 200), (-1000, 200)])
def test_length_penalty_must_be_a_finite_number_of_any_size(server, penalty, status):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "n": 2, "use_beam_search": True,
            "length_penalty": penalty}
    response = httpx.post(server.base + "/v1/completions", timeout=60,
                          content=json.dumps(body), headers={"content-type": "application/json"})
    if status == 400:
        check_error(response, 400, "length_penalty")
    else:
        assert response.status_code == 200, response.text
        assert len(response.json()["choices"]) == 2


def test_a_client_leaving_mid_search_leaves_nothing_running(server):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3000, "n": 8, "use_beam_search": True,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    m = server.wait_idle()
    assert m["ninefold:num_requests_running"] == 0 and m["ninefold:num_sequences_admitted"] == 0
    assert m["ninefold:num_free_kv_blocks"] == m["ninefold:num_kv_blocks"]
    time.sleep(1.5)  # a search left running would go on admitting rounds, each looking up the prefix cache
    later = server.metrics()
    assert later["ninefold:prefix_cache_queries_total"] == m["ninefold:prefix_cache_queries_total"]
    assert later["ninefold:num_free_kv_blocks"] == later["ninefold:num_kv_blocks"]
