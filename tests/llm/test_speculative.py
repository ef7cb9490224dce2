"""Speculative decoding by n-gram prompt lookup: the same tokens as without it, fewer steps."""

import pytest
import torch

from ninefold import LLM, SamplingParams
from ninefold.llm.speculative import DraftRow, SpeculativeConfig, accepted_count, ngram_drafts

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
# Prompts with repeats, so that drafts exist from the first decode step; the tiny random models also
# fall into loops of their own, which the lookup then follows.
PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7], [20, 21, 22, 23, 20, 21], list(range(30, 70)), [3] * 10,
           [100, 200, 100, 201, 100]]


def engines(model_dir, **kwargs):
    plain = LLM(str(model_dir), device="cpu", dtype="float32", **kwargs)
    spec = LLM(str(model_dir), device="cpu", dtype="float32", speculative_config=NGRAM, **kwargs)
    return plain, spec


@pytest.fixture(scope="module")
def pair(llama_dir):
    return engines(llama_dir, block_size=4, num_kv_blocks=512)


def token_ids(outputs):
    return [[c.token_ids for c in out.outputs] for out in outputs]


def test_config_is_checked_naming_the_key():
    assert SpeculativeConfig.parse(None) is None
    assert SpeculativeConfig.parse({"method": "ngram"}) == SpeculativeConfig(prompt_lookup_max=5, prompt_lookup_min=5)
    # as vLLM: a missing bound takes the other's value
    assert SpeculativeConfig.parse({"method": "[ngram]", "prompt_lookup_max": 3}).prompt_lookup_min == 3
    assert SpeculativeConfig.parse({"prompt_lookup_min": 2}).prompt_lookup_max == 2
    bad = [({"method": "eagle"}, "speculative_config.method"),
           ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
           ({"num_speculative_tokens": 33}, "num_speculative_tokens"),
           ({"prompt_lookup_max": True}, "prompt_lookup_max"),
           ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
           ({"draft_model": "x"}, "unknown key"), ("ngram", "expected a dict")]
    for value, message in bad:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.parse(value)


def test_engine_refuses_a_bad_config(llama_dir):
    with pytest.raises(ValueError, match="speculative_config.num_speculative_tokens"):
        LLM(str(llama_dir), device="cpu", speculative_config={"method": "ngram", "num_speculative_tokens": -1})


def test_ngram_drafts_follow_the_latest_longest_match():
    # suffix [1, 2] occurs at 0 and at 4: the later one's followers are taken
    assert ngram_drafts([1, 2, 3, 9, 1, 2, 4, 5, 1, 2], 3, 3, 1) == [4, 5, 1]
    # the 3-gram [7, 1, 2] beats the more recent 2-gram [1, 2]
    assert ngram_drafts([7, 1, 2, 8, 8, 1, 2, 6, 7, 1, 2], 2, 3, 1) == [8, 8]
    assert ngram_drafts([1, 2, 3], 4, 2, 1) == []  # nothing recurs
    assert ngram_drafts([4, 4, 4, 4], 2, 2, 2) == [4]  # the match may overlap the suffix; followers run to the end
    assert ngram_drafts([1, 2, 1, 2], 0, 2, 1) == []
    assert ngram_drafts([5], 3, 2, 1) == []


def test_accepted_count_stops_at_the_first_disagreement():
    assert accepted_count([4, 5, 6], [4, 5, 9, 1]) == 2
    assert accepted_count([4, 5], [4, 5, 7]) == 2
    assert accepted_count([4], [3, 4]) == 0
    assert accepted_count([], [8]) == 0


def test_draft_row_counts_drafts_as_output(pair):
    class Seq:
        token_ids, output_ids, num_output_tokens, params, guide = [1, 2, 3], [3], 1, "p", object()

    row = DraftRow(Seq(), [7, 8])
    assert row.token_ids == [1, 2, 3, 7, 8] and row.output_ids == [3, 7, 8] and row.num_output_tokens == 3
    assert row.params == "p" and row.guide is None


def test_greedy_tokens_equal_those_without_speculation(pair):
    plain, spec = pair
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    before = spec.engine.stats()
    assert token_ids(spec.generate(PROMPTS, params)) == token_ids(plain.generate(PROMPTS, params))
    after = spec.engine.stats()
    drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    assert drafted > 0 and 0 < accepted <= drafted


@pytest.mark.parametrize("variant", ["qwen3", "mistral"])
def test_greedy_parity_on_other_variants(model_dirs, variant):
    plain, spec = engines(model_dirs[variant])
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert token_ids(spec.generate(PROMPTS, params)) == token_ids(plain.generate(PROMPTS, params))
    assert spec.engine.stats()["num_accepted_tokens"] > 0


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 7])
def test_max_tokens_is_never_exceeded(pair, max_tokens):
    plain, spec = pair
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    out = spec.generate(PROMPTS, params)
    assert all(len(c) == max_tokens for ids in token_ids(out) for c in ids)
    assert token_ids(out) == token_ids(plain.generate(PROMPTS, params))


def test_stop_tokens_and_strings_end_inside_accepted_drafts(pair):
    plain, spec = pair
    reference = plain.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    for ref in reference:
        ids = ref.outputs[0].token_ids
        stop_id = ids[len(ids) // 2]
        text = ref.outputs[0].text
        stop_text = text[len(text) // 2 : len(text) // 2 + 2]
        for params in (SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id]),
                       SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop_text])):
            a = plain.generate([ref.prompt_token_ids], params)[0].outputs[0]
            b = spec.generate([ref.prompt_token_ids], params)[0].outputs[0]
            assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == (
                a.token_ids, a.text, a.finish_reason, a.stop_reason)
            assert a.finish_reason == "stop"


def test_penalties_and_min_tokens_see_the_drafts_as_history(pair):
    plain, spec = pair
    eos = plain.engine.eos_token_ids[0]
    for params in (SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.3),
                   SamplingParams(temperature=0, max_tokens=30, presence_penalty=0.5, frequency_penalty=0.7),
                   SamplingParams(temperature=0, max_tokens=20, min_tokens=12, logit_bias={eos: 30.0})):
        assert token_ids(spec.generate(PROMPTS, params)) == token_ids(plain.generate(PROMPTS, params)), params


def test_logprobs_match_those_without_speculation(pair):
    plain, spec = pair
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3)
    for a, b in zip(plain.generate(PROMPTS, params), spec.generate(PROMPTS, params)):
        x, y = a.outputs[0], b.outputs[0]
        assert x.token_ids == y.token_ids and len(y.logprobs) == len(y.token_ids)
        for ex, ey in zip(x.logprobs, y.logprobs):
            assert set(ex) == set(ey)
            assert all(abs(ex[t] - ey[t]) < 1e-4 for t in ex)
        assert y.cumulative_logprob == pytest.approx(x.cumulative_logprob, abs=1e-3)


def test_preemption_prefix_cache_and_a_small_token_budget(llama_dir):
    # 20 blocks of 4 tokens for 5 sequences of up to ~80 tokens: sequences are preempted and recomputed;
    # an 8-token budget leaves drafts only what decode rows do not take.
    plain, spec = engines(llama_dir, block_size=4, num_kv_blocks=20, max_num_batched_tokens=8,
                          max_model_len=80)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    shared = [[9, 8, 7, 6, 5, 4, 3, 2] + p for p in PROMPTS]  # a common prefix: prefix-cache hits
    expected = token_ids(plain.generate(shared, params))
    assert token_ids(spec.generate(shared, params)) == expected
    assert token_ids(spec.generate(shared, params)) == expected  # again, over the filled prefix cache
    stats = spec.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["num_accepted_tokens"] > 0
    assert stats["num_free_blocks"] == stats["num_blocks"]  # nothing leaked


def test_seeded_sampling_gives_the_tokens_of_plain_decoding_whatever_the_load(pair, llama_dir):
    plain, spec = pair
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=30, seed=11, n=3, ignore_eos=True)
    first = token_ids(spec.generate(PROMPTS, params))
    assert all(len(c) == 30 for ids in first for c in ids)
    assert first == token_ids(spec.generate(PROMPTS, params))
    # a token depends on the seed and its position only: not on refused drafts, nor on the step budget
    assert first == token_ids(plain.generate(PROMPTS, params))
    _, tight = engines(llama_dir, max_num_batched_tokens=3)
    assert token_ids(tight.generate(PROMPTS[:1], params)) == first[:1]
    assert token_ids(spec.generate(PROMPTS[:1], params)) == first[:1]  # alone instead of in a batch


def test_sampled_tokens_follow_the_model_distribution(llama_dir):
    """Four tokens after a repeating prompt, 3000 seeds: the joint distribution with speculation matches
    the one without. A logit bias leaves two likely tokens, so the 16 outcomes are well sampled and the
    drafts (the prompt's alternation) are right often but not always."""
    plain, spec = engines(llama_dir, max_num_seqs=512)
    prompt = [40, 41, 40, 41, 40]
    frequencies = []
    for llm in (plain, spec):
        params = [SamplingParams(temperature=1.0, max_tokens=4, seed=s, ignore_eos=True,
                                 logit_bias={40: 30.0, 41: 29.2}) for s in range(3000)]
        outcomes = [tuple(o.outputs[0].token_ids) for o in llm.generate([prompt] * len(params), params)]
        frequencies.append({k: outcomes.count(k) / len(outcomes) for k in set(outcomes)})
    keys = set(frequencies[0]) | set(frequencies[1])
    total_variation = sum(abs(frequencies[0].get(k, 0) - frequencies[1].get(k, 0)) for k in keys) / 2
    stats = spec.engine.stats()
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]  # some drafts kept, some refused
    # sampling noise at 3000 draws over 16 outcomes is about 0.02; accepting drafts unchecked moves it by 0.3
    assert total_variation < 0.06, (total_variation, frequencies)


def test_guided_requests_do_not_speculate_and_stay_valid(pair):
    import json

    from ninefold import GuidedDecodingParams

    _, spec = pair
    before = spec.engine.stats()["num_draft_tokens"]
    params = SamplingParams(temperature=0, max_tokens=60, guided_decoding=GuidedDecodingParams(json_object=True))
    out = spec.generate(["Hello"], params)[0].outputs[0]
    assert spec.engine.stats()["num_draft_tokens"] == before
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)


def test_prompt_dicts_as_vllm_takes_them(pair):
    plain, _ = pair
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    by_dict = plain.generate([{"prompt_token_ids": PROMPTS[0]}, {"prompt": "Hello"}], params)
    direct = plain.generate([PROMPTS[0], "Hello"], params)
    assert token_ids(by_dict) == token_ids(direct)
    assert plain.generate({"prompt": "Hello"}, params)[0].outputs[0].token_ids == direct[1].outputs[0].token_ids
    with pytest.raises(TypeError, match="prompt: a dict must be"):
        plain.generate([{"text": "Hello"}], params)


def test_cuda_speculation_matches_plain_decoding(llama_dir):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    small = dict(device="cuda", dtype="float32", block_size=16, num_kv_blocks=64, cuda_graph_max_batch=4)  # beside other workers
    plain = LLM(str(llama_dir), **small)
    spec = LLM(str(llama_dir), **small, speculative_config=NGRAM)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert token_ids(spec.generate(PROMPTS, params)) == token_ids(plain.generate(PROMPTS, params))
    assert spec.engine.stats()["num_accepted_tokens"] > 0


def test_step_cost_times_a_checkpoint_given_as_a_path(llama_dir, tmp_path):
    """``bench.speculative --step-cost`` on real files: one timing per draft count, written as JSON."""
    import json

    from ninefold.bench.speculative import main

    assert main(["--step-cost", "--model", str(llama_dir), "--context", "12", "--repeats", "1",
                 "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "speculative_step_cost.json").read_text())
    assert result["model"] == str(llama_dir)
    assert sorted(int(k) for k in result["ms_per_step"]) == [0, 1, 2, 4, 8]
    assert all(ms > 0 for ms in result["ms_per_step"].values())
