"""Greedy generation and logits against transformers on tiny random models of every variant."""

import contextlib

import pytest
import torch
from tiny_models import VARIANTS
from transformers import AutoModelForCausalLM

from ninefold import LLM, SamplingParams
from ninefold.llm.engine import LLMEngine

NEW_TOKENS = 32
PROMPT_LENGTHS = (3, 17, 45)


def prompts_for(vocab: int, lengths=PROMPT_LENGTHS, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in lengths]


_reference_cache: dict = {}


def hf_greedy(path, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    """transformers' greedy continuation of ``prompt`` (EOS off)."""
    key = (str(path), tuple(prompt), new_tokens)
    if key not in _reference_cache:
        model = _hf_model(path)
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0)
        _reference_cache[key] = out[0, len(prompt):].tolist()
    return _reference_cache[key]


_models: dict = {}


def _hf_model(path):
    if str(path) not in _models:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        model.generation_config.eos_token_id = None
        _models[str(path)] = model.eval()
    return _models[str(path)]


GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def generate_ids(llm: LLM, prompts: list[list[int]], params=GREEDY) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompt_token_ids=prompts, sampling_params=params)]


@pytest.mark.parametrize("variant", [*VARIANTS, "phi3"])
def test_greedy_matches_transformers_one_prompt_at_a_time_and_batched(model_dirs, variant):
    path = model_dirs[variant]
    llm = LLM(str(path), device="cpu", block_size=8, num_kv_blocks=64)
    prompts = prompts_for(llm.engine.model_config.vocab_size)
    expected = [hf_greedy(path, p) for p in prompts]
    for prompt, want in zip(prompts, expected):
        assert generate_ids(llm, [prompt]) == [want]
    assert generate_ids(llm, prompts) == expected


@pytest.mark.parametrize("variant", [*VARIANTS, "phi3"])
def test_last_position_logits_match_transformers(model_dirs, variant):
    path = model_dirs[variant]
    engine = LLMEngine(str(path), device="cpu", block_size=4, num_kv_blocks=64, enable_prefix_caching=False)
    prompts = prompts_for(engine.model_config.vocab_size, lengths=(5, 23))
    for i, prompt in enumerate(prompts):
        engine.add_request(engine.build_request(prompt, GREEDY, f"r{i}"))
    logits = engine.runner.forward_logits(engine.scheduler.schedule())
    model = _hf_model(path)
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            ref = model(torch.tensor([prompt])).logits[0, -1]
        torch.testing.assert_close(logits[row], ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("variant", ["llama", "qwen3", "phi3"])
def test_chunked_prefill_matches_transformers(model_dirs, variant):
    path = model_dirs[variant]
    llm = LLM(str(path), device="cpu", block_size=4, num_kv_blocks=128, max_num_batched_tokens=7, enable_prefix_caching=False)
    prompts = prompts_for(llm.engine.model_config.vocab_size)
    assert generate_ids(llm, prompts) == [hf_greedy(path, p) for p in prompts]


@pytest.mark.parametrize("variant", ["llama", "qwen2"])
def test_prefix_cache_hits_give_the_same_tokens(model_dirs, variant):
    path = model_dirs[variant]
    llm = LLM(str(path), device="cpu", block_size=4, num_kv_blocks=128)
    vocab = llm.engine.model_config.vocab_size
    shared = prompts_for(vocab, lengths=(30,), seed=7)[0]
    prompts = [shared + tail for tail in prompts_for(vocab, lengths=(1, 6, 13), seed=8)]
    expected = [hf_greedy(path, p) for p in prompts]
    assert generate_ids(llm, prompts[:1]) == expected[:1]
    assert llm.engine.blocks.hit_tokens == 0
    assert generate_ids(llm, prompts) == expected  # the shared 28 tokens (7 blocks) now come from the cache
    assert llm.engine.blocks.hit_tokens >= 3 * 28
    assert generate_ids(llm, prompts) == expected  # whole prompts and earlier outputs cached


@pytest.mark.parametrize("variant", ["llama", "mistral"])
def test_preemption_by_recompute_gives_the_same_tokens(model_dirs, variant):
    path = model_dirs[variant]
    # each request needs up to ceil((45 + 32) / 4) = 20 blocks; three at once cannot fit in 24
    llm = LLM(str(path), device="cpu", block_size=4, num_kv_blocks=24, enable_prefix_caching=False)
    prompts = prompts_for(llm.engine.model_config.vocab_size)
    assert generate_ids(llm, prompts) == [hf_greedy(path, p) for p in prompts]
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.pool.num_free == 24


def test_preemption_with_prefix_cache_and_chunking(model_dirs):
    path = model_dirs["llama"]
    llm = LLM(str(path), device="cpu", block_size=4, num_kv_blocks=26, max_num_batched_tokens=9)
    prompts = prompts_for(llm.engine.model_config.vocab_size, lengths=(45, 17, 45, 3), seed=3)
    prompts[2][:20] = prompts[0][:20]
    assert generate_ids(llm, prompts) == [hf_greedy(path, p) for p in prompts]
    assert llm.engine.scheduler.num_preemptions > 0


def test_chat_renders_the_template_and_generates(llama_dir):
    llm = LLM(str(llama_dir), device="cpu", num_kv_blocks=64)
    messages = [{"role": "user", "content": "Hello"}]
    ids = llm.tokenizer.apply_chat_template(messages, tokenize=True)
    assert llm.tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    (out,) = llm.chat(messages, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == hf_greedy(llama_dir, ids, 8)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", [*VARIANTS, "phi3"])
def test_cpu_decode_path_matches_the_generic_path(model_dirs, variant, dtype):
    """llama_cpu.CpuDecoder (the CPU decode step) computes what the ops-by-ops forward computes,
    for a batch of three sequences of different lengths and for one alone."""
    path = model_dirs[variant]
    engine = LLMEngine(str(path), device="cpu", dtype=dtype, block_size=4, num_kv_blocks=64,
                       enable_prefix_caching=False)
    prompts = prompts_for(engine.model_config.vocab_size, lengths=(5, 23, 9))
    for generic, fast in decode_step_both_ways(engine, prompts, GREEDY):
        assert engine.model._cpu_decoder is not None
        torch.testing.assert_close(fast, generic, rtol=1e-6, atol=1e-5)


@contextlib.contextmanager
def next_decode_step(engine, prompts, params, tag: str):
    """``prompts`` added as requests ``{tag}-{i}``, their prefill and two decode steps run; yields the next
    step as scheduled (one new token per sequence), then aborts the requests."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(engine.build_request(prompt, params, rid))
    for _ in range(3):  # prefill, then two decode steps
        engine.step()
    step = engine.scheduler.schedule()
    assert all(s.num_new_tokens == 1 for s in step) and len(step) == len(prompts)
    try:
        yield step
    finally:
        for rid in ids:
            engine.abort_request(rid)


def decode_step_both_ways(engine, prompts, params):
    """For ``prompts`` batched and for the first alone: after their prefill and two decode steps, the
    logits of the next decode step through the ops-by-ops forward and then through the CPU decode
    step (which rewrites the same cache slots with the same values); yields ``(generic, fast)``."""
    for batch in (prompts, prompts[:1]):
        with next_decode_step(engine, batch, params, str(len(batch))) as step:
            engine.model.cpu_fast_decode = False
            generic = engine.runner.forward_logits(step)
            engine.model.cpu_fast_decode = True
            yield generic, engine.runner.forward_logits(step)


@pytest.mark.parametrize("variant", ["llama", "qwen2"])
def test_mixed_steps_send_one_token_rows_through_decode_attention(model_dirs, variant):
    """Sequences that decode while others prefill (chunked or not, with and without a cached
    prefix) are computed by attention_decode inside the prefill step, with the same tokens."""
    path = model_dirs[variant]
    llm = LLM(str(path), device="cpu", block_size=4, num_kv_blocks=128, max_num_batched_tokens=9)
    model = llm.engine.model
    seen = []
    forward = model.forward

    def recording_forward(input_ids, positions, meta):
        seen.append((meta.num_decodes, meta.use_cache, input_ids.shape[0]))
        return forward(input_ids, positions, meta)

    model.forward = recording_forward
    prompts = prompts_for(llm.engine.model_config.vocab_size, lengths=(2, 5, 30, 4))
    assert generate_ids(llm, prompts) == [hf_greedy(path, p) for p in prompts]
    mixed = [(nd, cached) for nd, cached, t in seen if 0 < nd < t]
    assert any(cached for _, cached in mixed) and any(not cached for _, cached in mixed)
