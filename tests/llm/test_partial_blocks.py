"""The prefix cache's partly filled blocks: a finished sequence's last block serves a later sequence that goes on
from exactly its tokens (a beam one token longer, a prompt continuing an earlier output) through a copy."""

import pytest
import torch

from ninefold import LLM, SamplingParams
from ninefold.runtime.kv_pool import KVCachePool

BLOCK = 8
PROMPT = [5, 9, 14, 33, 71, 2, 40, 8, 19, 27, 60]  # 11 tokens: one full block and 3 tokens of the next


def run(llm, prompt, max_tokens=6):
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=3))[0]
    seq = out.outputs[0]
    return seq.token_ids, seq.logprobs


def cached(llm):
    """Prompt tokens the prefix cache served so far."""
    return llm.engine.blocks.hit_tokens


@pytest.fixture(scope="module")
def reference(llama_dir):
    return LLM(str(llama_dir), device="cpu", block_size=BLOCK, num_kv_blocks=64, enable_prefix_caching=False)


def assert_same(got, expected):
    assert got[0] == expected[0]
    for a, b in zip(got[1], expected[1]):
        assert a.keys() == b.keys() and all(a[t] == pytest.approx(b[t], abs=1e-4) for t in a)


def test_children_of_one_finished_sequence_each_compute_only_their_new_token(llama_dir, reference):
    llm = LLM(str(llama_dir), device="cpu", block_size=BLOCK, num_kv_blocks=64)
    run(llm, PROMPT, max_tokens=1)  # computes the 11 prompt tokens; its block of 3 is cached when it finishes
    for child in (PROMPT + [100], PROMPT + [101], PROMPT + [100]):
        before = cached(llm)
        got = run(llm, child)
        assert cached(llm) - before == len(PROMPT)  # all but the new token, the last 3 through a copy
        assert_same(got, run(reference, child))  # and the copies left the cached block as it was


def test_a_prompt_continuing_an_earlier_output_reuses_its_last_block(llama_dir, reference):
    llm = LLM(str(llama_dir), device="cpu", block_size=BLOCK, num_kv_blocks=64)
    output, _ = run(llm, PROMPT, max_tokens=4)  # computed: the prompt and the first 3 outputs (14 tokens)
    for extra in ([], [77]):
        continued = PROMPT + output + extra
        before = cached(llm)
        got = run(llm, continued)
        assert cached(llm) - before == len(PROMPT) + 3
        assert_same(got, run(reference, continued))


def test_an_aborted_sequence_leaves_no_partial_block(llama_dir):
    llm = LLM(str(llama_dir), device="cpu", block_size=BLOCK, num_kv_blocks=64)
    engine = llm.engine
    request = engine.build_request(PROMPT, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.add_request(request)
    seq = request.seqs[0]
    while seq.num_computed_tokens <= len(PROMPT) or seq.num_computed_tokens % BLOCK == 0:
        engine.step()
    engine.sync()
    computed = seq.num_computed_tokens
    follower = seq.token_ids[:computed] + [100]  # exactly what the aborted sequence's last block would serve
    engine.abort_request(request.request_id)
    before = cached(llm)
    run(llm, follower)
    assert cached(llm) - before == computed // BLOCK * BLOCK  # full blocks only: aborted, so not cached


def test_no_partial_reuse_without_prefix_caching(llama_dir, reference):
    run(reference, PROMPT, max_tokens=1)
    run(reference, PROMPT + [100])
    assert cached(reference) == 0


def test_partial_blocks_are_evicted_like_full_ones_under_pressure(llama_dir, reference):
    llm = LLM(str(llama_dir), device="cpu", block_size=BLOCK, num_kv_blocks=12, max_model_len=64)
    for i in range(8):  # each finished sequence leaves blocks cached; the pool holds 12
        prompt = [3 + i] + PROMPT
        run(llm, prompt, max_tokens=1)
        assert_same(run(llm, prompt + [100 + i], max_tokens=4), run(reference, prompt + [100 + i], max_tokens=4))
    assert llm.engine.blocks.num_available == 12


def test_pool_copy_blocks_copies_every_layer_and_checks_its_arguments():
    pool = KVCachePool(num_layers=2, num_kv_heads=1, head_dim=4, block_size=2, dtype=torch.float32,
                       device="cpu", num_blocks=4)
    data = torch.randn(2, *pool.block_shape)
    pool.write_blocks([0, 1], data)
    pool.copy_blocks([1, 0], [2, 3])
    assert torch.equal(pool.read_blocks([2, 3]), data.flip(0))
    with pytest.raises(ValueError, match="targets: 1 given for 2 sources"):
        pool.copy_blocks([0, 1], [2])
    with pytest.raises(ValueError, match="sources"):
        pool.copy_blocks([9], [2])
