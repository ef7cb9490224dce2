"""Prefill on one engine, decode on another: KV blocks exported, sent between real processes, imported."""

from __future__ import annotations

import pytest
import torch

from ninefold import LLM, SamplingParams
from ninefold.comm.spawn import spawn
from ninefold.llm.disagg import PrefixKV, export_prefix, import_prefix

BLOCK = 4
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def _prompts(n_tokens=(37, 9, 20), seed=0, vocab=200):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in n_tokens]


def _llm(model_dir, **kw):
    return LLM(str(model_dir), **{"dtype": "float32", "device": "cpu", "block_size": BLOCK, **kw})


def _tokens(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]


def test_imported_blocks_decode_the_same_tokens_and_are_not_recomputed(llama_dir):
    prompts = _prompts()
    reference = _tokens(_llm(llama_dir), prompts)
    prefill, decode = _llm(llama_dir), _llm(llama_dir)
    prefill.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=1))
    written = []
    for ids in prompts:
        prefix = export_prefix(prefill.engine, ids)
        assert prefix.num_tokens == len(ids) // BLOCK * BLOCK and prefix.token_ids == ids[: prefix.num_tokens]
        written.append(import_prefix(decode.engine, prefix))
    assert written == [len(ids) // BLOCK for ids in prompts]
    assert _tokens(decode, prompts) == reference
    full = sum(len(ids) // BLOCK * BLOCK for ids in prompts)
    # The 37-token prompt's 9 blocks cover 36 tokens; one is always left to compute: 9 (of 9 blocks) hit;
    # the 20-token prompt keeps its 5th block to compute (its last token), the 9-token one 2 of 2.
    assert decode.engine.blocks.hit_tokens == full - BLOCK
    assert import_prefix(decode.engine, export_prefix(prefill.engine, prompts[0])) == 0  # already cached


def test_the_transfer_between_two_processes(llama_dir):
    prompts = _prompts(seed=1)
    reference = _tokens(_llm(llama_dir), prompts)
    results = spawn(_rank_fn(), 2, (str(llama_dir), prompts, 32, BLOCK), timeout_s=240)
    assert results[0] == reference  # (the sender, from its own cached blocks)
    imported, tokens, hit, queried = results[1]
    assert imported == [len(ids) // BLOCK for ids in prompts]
    assert tokens == reference
    assert hit == sum(len(ids) // BLOCK * BLOCK for ids in prompts) - BLOCK and queried == sum(map(len, prompts))


def _rank_fn():
    import kv_transfer_ranks  # tests/llm is on sys.path (conftest), and so in the spawned ranks
    return kv_transfer_ranks.prefill_here_decode_there


def test_a_layout_that_differs_is_named(llama_dir):
    prefill = _llm(llama_dir)
    ids = _prompts()[0]
    prefill.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(temperature=0, max_tokens=1))
    prefix = export_prefix(prefill.engine, ids)
    with pytest.raises(ValueError, match="block_size 4 does not match the receiving engine's 8"):
        import_prefix(_llm(llama_dir, block_size=8).engine, prefix)
    with pytest.raises(ValueError, match="dtype torch.float16 does not match"):
        import_prefix(_llm(llama_dir).engine, PrefixKV(prefix.token_ids, prefix.blocks.half()))
    with pytest.raises(ValueError, match="hold 36 tokens, got 35 token ids"):
        import_prefix(_llm(llama_dir).engine, PrefixKV(prefix.token_ids[:-1], prefix.blocks))
    with pytest.raises(ValueError, match="enable_prefix_caching=False"):
        import_prefix(_llm(llama_dir, enable_prefix_caching=False).engine, prefix)
    with pytest.raises(ValueError, match="9 new blocks do not fit"):
        import_prefix(_llm(llama_dir, num_kv_blocks=8, max_model_len=32).engine, prefix)
    with pytest.raises(TypeError, match="prefix: expected a PrefixKV"):
        import_prefix(prefill.engine, prefix.blocks)


def test_imported_blocks_are_evicted_tail_first_when_memory_runs_out(llama_dir):
    prefill = _llm(llama_dir)
    ids = _prompts()[0]
    prefill.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(temperature=0, max_tokens=1))
    decode = _llm(llama_dir, num_kv_blocks=12, max_model_len=48)
    assert import_prefix(decode.engine, export_prefix(prefill.engine, ids)) == 9
    blocks = decode.engine.blocks
    assert blocks.num_available == 12
    other = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    decode.generate(prompt_token_ids=[[5] * 20], sampling_params=other)  # needs 6 blocks: 3 evicted
    assert len(blocks.cached_blocks(ids)) == 6  # the prompt's first blocks survive, its tail went first


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_imported_blocks_on_cuda_decode_the_same_tokens(llama_dir):
    prompts = _prompts(seed=2)
    on_gpu = {"device": "cuda", "num_kv_blocks": 256}  # a fixed pool: other tests may hold most of the GPU
    reference = _tokens(_llm(llama_dir, **on_gpu), prompts)
    prefill, decode = _llm(llama_dir, **on_gpu), _llm(llama_dir, **on_gpu)
    prefill.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=1))
    for ids in prompts:
        prefix = export_prefix(prefill.engine, ids)
        assert prefix.blocks.is_cuda
        import_prefix(decode.engine, prefix)
    assert _tokens(decode, prompts) == reference
    assert decode.engine.blocks.hit_tokens == sum(len(ids) // BLOCK * BLOCK for ids in prompts) - BLOCK


def _consistent(blocks) -> None:
    """The prefix cache's two maps agree, and every evictable block is registered with no sequence holding it."""
    assert all(blocks._hash_of[block] == h for h, (block, _) in blocks._by_hash.items())
    assert len(blocks._hash_of) == len(blocks._by_hash)
    assert all(block in blocks._hash_of and blocks.pool.ref_count(block) == 1 for block in blocks._evictable)


def test_an_import_into_a_nearly_full_cache_keeps_the_head_it_builds_on():
    """The cached head of a prefix is not evicted to make room for its tail, leftovers of an evicted head
    are replaced, and the cache stays consistent (a stale entry once made a later eviction raise KeyError)."""
    from ninefold.llm.kv_cache import BlockManager
    from ninefold.runtime.kv_pool import KVCachePool

    pool = KVCachePool(1, 1, 2, 2, torch.float32, "cpu", 4)
    blocks = BlockManager(pool)

    def data(n, fill):
        return torch.full((n, *pool.block_shape), float(fill))

    x, y = [1, 2, 3, 4, 5, 6], [7, 8, 9, 10]
    assert blocks.insert_prefix(x[:2], data(1, 1)) == 1  # x's head, the oldest cached block
    assert blocks.insert_prefix(y, data(2, 2)) == 2  # one block left free
    assert blocks.insert_prefix(x, data(3, 3)) == 2  # needs an eviction: y's, not x's head
    assert len(blocks.cached_blocks(x)) == 3 and len(blocks.cached_blocks(y)) == 1  # y's tail went
    head = blocks.cached_blocks(x)[0]
    assert torch.equal(pool.read_blocks([head]), data(1, 1))  # kept, not rewritten
    _consistent(blocks)
    # x's head evicted alone (it was the oldest before the fix): its tail is left unreachable ...
    blocks._evictable.move_to_end(head, last=False)
    blocks.insert_prefix([11, 12, 13, 14, 15, 16, 17, 18], data(4, 4)[:3])
    assert blocks.cached_blocks(x) == []
    # ... and importing x again replaces those leftovers instead of registering a second block per hash
    assert blocks.insert_prefix(x, data(3, 5)) == 3
    assert len(blocks.cached_blocks(x)) == 3
    _consistent(blocks)
    blocks.reset_prefix_cache()  # evicts everything: a stale entry raised KeyError here
    assert pool.num_free == 4 and blocks._by_hash == {} and blocks._hash_of == {}


def test_held_blocks_survive_imports_that_need_the_room_until_released():
    """A decode worker holds an imported prefix until the request reusing it is admitted: imports that need the
    room cannot evict it meanwhile, and once released it is evictable again, after the older cached blocks."""
    from ninefold.llm.kv_cache import BlockManager
    from ninefold.runtime.kv_pool import KVCachePool

    pool = KVCachePool(1, 1, 2, 2, torch.float32, "cpu", 4)
    blocks = BlockManager(pool)

    def data(n, fill):
        return torch.full((n, *pool.block_shape), float(fill))

    x, y = [1, 2, 3, 4], [5, 6, 7, 8]
    blocks.insert_prefix(x, data(2, 1))
    held = blocks.hold(x)
    assert len(held) == 2 and blocks.num_available == 2
    with pytest.raises(ValueError, match="3 new blocks do not fit; 2 can be had"):
        blocks.insert_prefix([*y, 9, 10], data(3, 2))
    assert blocks.insert_prefix(y, data(2, 2)) == 2
    assert blocks.cached_blocks(x) == held and torch.equal(pool.read_blocks(held), data(2, 1))
    blocks.release(held)
    assert blocks.num_available == 4
    assert blocks.insert_prefix([11, 12], data(1, 3)) == 1  # evicts y's tail, the oldest evictable block
    assert blocks.cached_blocks(x) == held and len(blocks.cached_blocks(y)) == 1
    _consistent(blocks)
