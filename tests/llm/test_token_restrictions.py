"""vLLM's allowed_token_ids, bad_words and truncate_prompt_tokens, with and without speculation."""

import pytest

from ninefold import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7], [20, 21, 22, 23, 20, 21], "Hello world", "The capital of France"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def spec(llama_dir):
    return LLM(str(llama_dir), device="cpu", dtype="float32", speculative_config=NGRAM)


@pytest.mark.parametrize("field, value", [("allowed_token_ids", []), ("allowed_token_ids", [-1]),
                                          ("allowed_token_ids", 5), ("bad_words", [" "]), ("bad_words", "x"),
                                          ("truncate_prompt_tokens", 0), ("truncate_prompt_tokens", 1.5)])
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_out_of_vocabulary_allowed_ids_are_refused(llm):
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate(["x"], SamplingParams(allowed_token_ids=[1, llm.engine.vocab_size]))


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_allowed_token_ids_restrict_every_token(llm, spec, temperature):
    allowed = [40, 41, 42, 97]
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=24, ignore_eos=True, allowed_token_ids=allowed)
    for engine in (llm, spec):
        for out in engine.generate(PROMPTS, params):
            assert set(out.outputs[0].token_ids) <= set(allowed) and len(out.outputs[0].token_ids) == 24
    if temperature == 0:  # greedy: the best allowed token, with or without drafts
        assert ([o.outputs[0].token_ids for o in spec.generate(PROMPTS, params)]
                == [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)])


def test_bad_words_are_never_completed(llm, spec):
    free = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    checked = 0
    for prompt in PROMPTS:
        ids = llm.generate([prompt], free)[0].outputs[0].token_ids
        tokenizer = llm.engine.tokenizer
        # a piece of the free output that tokenizes back to the same two tokens
        pieces = [tokenizer.decode(ids[i : i + 2]) for i in range(len(ids) - 1)]
        text = next((t for i, t in enumerate(pieces) if t.strip()
                     and tokenizer.encode(t, add_special_tokens=False) == ids[i : i + 2]), None)
        if text is None:
            continue
        banned = llm.engine._bad_word_ids([text])
        checked += 1
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, bad_words=[text])
        outputs = [e.generate([prompt], params)[0].outputs[0].token_ids for e in (llm, spec)]
        assert outputs[0] == outputs[1]
        out = outputs[0]
        assert out != ids  # the free output held the word
        for word in banned:
            assert not any(tuple(out[i : i + len(word)]) == word for i in range(len(out) - len(word) + 1))
    assert checked >= 2


def test_a_one_token_bad_word_is_banned_everywhere(llm):
    tokenizer = llm.engine.tokenizer
    free = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    seen = [t for o in free for t in o.outputs[0].token_ids]
    token = next(t for t in seen if tokenizer.decode([t]).strip()
                 and tokenizer.encode(tokenizer.decode([t]), add_special_tokens=False) == [t])
    out = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                               bad_words=[tokenizer.decode([token])]))
    assert all(token not in o.outputs[0].token_ids for o in out)


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    long = list(range(5, 60))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    cut = llm.generate([long], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, truncate_prompt_tokens=8))[0]
    assert cut.prompt_token_ids == long[-8:]
    assert cut.outputs[0].token_ids == llm.generate([long[-8:]], params)[0].outputs[0].token_ids
    short = llm.generate([long[:5]], SamplingParams(max_tokens=2, truncate_prompt_tokens=8))[0]
    assert short.prompt_token_ids == long[:5]
    limit = llm.engine.max_model_len
    too_long = [5 + i % 200 for i in range(limit + 30)]
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([too_long], params)
    fitted = llm.generate([too_long], SamplingParams(max_tokens=1, truncate_prompt_tokens=-1))[0]
    assert fitted.prompt_token_ids == too_long[-(limit - 1):] and len(fitted.outputs[0].token_ids) == 1


def test_cuda_restrictions_match_the_cpu(llama_dir, llm):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    gpu = LLM(str(llama_dir), device="cuda", dtype="float32", block_size=16, num_kv_blocks=64, cuda_graph_max_batch=4)
    word = llm.engine.tokenizer.decode([40, 41])
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, allowed_token_ids=[40, 41, 42],
                            bad_words=[word], truncate_prompt_tokens=6)
    assert ([o.outputs[0].token_ids for o in gpu.generate(PROMPTS, params)]
            == [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)])
