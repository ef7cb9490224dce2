"""``SamplingParams.prompt_logprobs``: every prompt token's log-probability, through chunking, the
prefix cache, preemption, ``n`` and one-token prompt chunks, against transformers in float64."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from ninefold import LLM, SamplingParams

PROMPT = [5, 40, 77, 12, 150, 33, 9, 81, 64, 3, 27]


@pytest.fixture(scope="module")
def hf(llama_dir):
    return AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float64).eval()


def _reference(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0], dim=-1)


def _check(entries, prompt: list[int], logp: torch.Tensor, top: int) -> None:
    """``entries`` are the prompt logprobs of ``prompt``: None first, then its token and the ``top`` best."""
    assert len(entries) == len(prompt)
    assert entries[0] is None
    for p in range(1, len(prompt)):
        entry, ref, token = entries[p], logp[p - 1], prompt[p]
        assert token in entry
        best = set(ref.topk(top).indices.tolist()) if top else set()
        assert set(entry) == best | {token}, f"position {p}"
        for tid, value in entry.items():
            assert abs(value - ref[tid].item()) < 1e-4, f"position {p}, token {tid}"


def _prompt_logprobs(llm: LLM, prompts: list[list[int]], top: int, **params):
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=top, **params)
    return llm.generate(prompt_token_ids=prompts, sampling_params=sp)


def test_prompt_logprobs_are_the_models_log_softmax_at_every_prompt_position(llama_dir, hf):
    llm = LLM(str(llama_dir), device="cpu", block_size=4, num_kv_blocks=64)
    out = _prompt_logprobs(llm, [PROMPT], 3)[0]
    _check(out.prompt_logprobs, PROMPT, _reference(hf, PROMPT), 3)
    assert len(out.outputs[0].token_ids) == 3  # generation is unchanged by scoring the prompt


def test_without_prompt_logprobs_the_output_has_none(llama_dir):
    llm = LLM(str(llama_dir), device="cpu", block_size=4, num_kv_blocks=64)
    out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(temperature=0, max_tokens=2))[0]
    assert out.prompt_logprobs is None


def test_zero_top_gives_only_the_prompt_tokens(llama_dir, hf):
    llm = LLM(str(llama_dir), device="cpu", block_size=4, num_kv_blocks=64)
    out = _prompt_logprobs(llm, [PROMPT], 0)[0]
    _check(out.prompt_logprobs, PROMPT, _reference(hf, PROMPT), 0)


def test_chunked_prefill_scores_every_chunk_once(llama_dir, hf):
    llm = LLM(str(llama_dir), device="cpu", block_size=4, num_kv_blocks=64, max_num_batched_tokens=4)
    prompts = [PROMPT, PROMPT[3:] + [99, 100]]
    outs = _prompt_logprobs(llm, prompts, 2)
    for prompt, out in zip(prompts, outs):
        _check(out.prompt_logprobs, prompt, _reference(hf, prompt), 2)


def test_a_one_token_prompt_chunk_in_a_decode_shaped_step_is_scored(llama_dir, hf):
    # A budget of 2: once the short prompt decodes, the long one advances one token per step beside it,
    # so its prompt chunks are one-token rows in steps where every row has one token.
    llm = LLM(str(llama_dir), device="cpu", block_size=4, num_kv_blocks=64, max_num_batched_tokens=2)
    prompts = [PROMPT[:2], PROMPT]
    outs = _prompt_logprobs(llm, prompts, 2)
    for prompt, out in zip(prompts, outs):
        _check(out.prompt_logprobs, prompt, _reference(hf, prompt), 2)


def test_a_prefix_cache_hit_does_not_skip_scoring(llama_dir, hf):
    llm = LLM(str(llama_dir), device="cpu", block_size=4, num_kv_blocks=64, enable_prefix_caching=True)
    plain = llm.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(temperature=0, max_tokens=2))
    assert plain[0].prompt_logprobs is None
    first = _prompt_logprobs(llm, [PROMPT], 2)[0]  # the prompt's blocks are cached: scoring must not skip them
    second = _prompt_logprobs(llm, [PROMPT], 2)[0]
    logp = _reference(hf, PROMPT)
    _check(first.prompt_logprobs, PROMPT, logp, 2)
    _check(second.prompt_logprobs, PROMPT, logp, 2)
    again = llm.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(temperature=0, max_tokens=2))[0]
    assert again.num_cached_tokens > 0  # requests without prompt logprobs still hit the cache


def test_preemption_by_recompute_scores_each_prompt_token_once(llama_dir, hf):
    llm = LLM(str(llama_dir), device="cpu", block_size=4, num_kv_blocks=14, enable_prefix_caching=False)
    prompts = [PROMPT, PROMPT[::-1], PROMPT[2:] + [7, 8], PROMPT[:9]]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        _check(out.prompt_logprobs, prompt, _reference(hf, prompt), 1)


def test_n_sequences_share_one_set_of_prompt_logprobs(llama_dir, hf):
    llm = LLM(str(llama_dir), device="cpu", block_size=4, num_kv_blocks=64)
    sp = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=4, prompt_logprobs=2)
    out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=sp)[0]
    assert len(out.outputs) == 3
    _check(out.prompt_logprobs, PROMPT, _reference(hf, PROMPT), 2)


def test_more_logprobs_than_the_vocabulary_holds_are_refused(llama_dir):
    llm = LLM(str(llama_dir), device="cpu", block_size=4, num_kv_blocks=64)
    vocab = llm.engine.vocab_size
    for name in ("prompt_logprobs", "logprobs"):
        with pytest.raises(ValueError, match=f"{name}: got {vocab + 1}"):
            llm.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(**{name: vocab + 1}))


@pytest.mark.parametrize("value", [-1, 1.5, True, "3"])
def test_invalid_prompt_logprobs_are_refused_naming_the_field(value):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)
