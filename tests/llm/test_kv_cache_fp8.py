"""``kv_cache_dtype="fp8"`` (vLLM's): the engine's KV cache holds FP8 codes, half the bytes per token; generation
close to the model-dtype cache's, and the same across tensor-parallel ranks, prefix-cache hits and KV transfer."""

import pytest
import torch

from ninefold import LLM, SamplingParams
from ninefold.comm.spawn import spawn
from ninefold.llm.disagg import export_prefix, import_prefix

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
# The mean gap in prompt log-probabilities between an FP8 and a bfloat16 cache, every key (a chunk's own too) read as
# a code: about 0.009 nats for the tiny Llama on the CPU (torch) and 0.010 on an H100 (Triton); twice that fails.
FP8_MEAN_NATS = 0.02


def _prompts(lengths=(7, 29, 40), seed=0, vocab=200):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _llm(path, **kw):
    return LLM(str(path), **{"dtype": "float32", "device": "cpu", "block_size": 8, "num_kv_blocks": 64, **kw})


def _tokens(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]


def test_an_fp8_cache_holds_codes_in_half_the_bytes_and_scores_prompts_as_the_full_cache(llama_dir):
    """Chunked prefill (8-token chunks): every chunk after the first reads the earlier tokens' keys and values from the
    cache, so the prompt's log-probabilities see the FP8 codes; they stay within 0.05 nats of the float32 cache's."""
    full = _llm(llama_dir, max_num_batched_tokens=8, dtype="bfloat16")
    fp8 = _llm(llama_dir, max_num_batched_tokens=8, dtype="bfloat16", kv_cache_dtype="fp8")
    assert fp8.engine.pool.dtype == torch.float8_e4m3fn and full.engine.pool.dtype == torch.bfloat16
    assert fp8.engine.pool.bytes_per_block * 2 == full.engine.pool.bytes_per_block
    assert fp8.engine.cache_config["cache_dtype"] == "float8_e4m3fn"
    prompt = _prompts((48,))[0]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    scored = [llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0].prompt_logprobs for llm in (full, fp8)]
    diffs = [abs(a[t] - b[t]) for a, b, t in zip(scored[0][1:], scored[1][1:], prompt[1:])]
    assert max(diffs) < 0.05 and sum(diffs) / len(diffs) < FP8_MEAN_NATS
    assert max(diffs) > 0  # the codes do round (else this would not test the FP8 path)


def test_fp8_cache_greedy_tokens_across_ranks_prefix_hits_preemption_and_batching(llama_dir):
    """Every key a prefill chunk attends, its own included, is read back as a code from the cache (as vLLM's V1 does):
    so an FP8 engine's tokens do not depend on prefix-cache hits, preemption, chunking or the step's other sequences,
    and two tensor-parallel ranks give one's."""
    prompts = _prompts()
    one = _llm(llama_dir, kv_cache_dtype="fp8")
    first = _tokens(one, prompts)
    assert _tokens(one, prompts) == first and one.engine.blocks.hit_tokens > 0
    alone = [_tokens(_llm(llama_dir, kv_cache_dtype="fp8"), [p])[0] for p in prompts]
    assert alone == first
    chunked = _llm(llama_dir, kv_cache_dtype="fp8", max_num_batched_tokens=8)
    assert _tokens(chunked, prompts) == first
    tight = _llm(llama_dir, kv_cache_dtype="fp8", num_kv_blocks=12, enable_prefix_caching=False)
    assert _tokens(tight, prompts) == first and tight.engine.scheduler.num_preemptions > 0
    with _llm(llama_dir, kv_cache_dtype="fp8", tensor_parallel_size=2) as two:
        assert two.engine.model.kv_caches[0][0].dtype == torch.float8_e4m3fn
        assert _tokens(two, prompts) == first


def test_fp8_blocks_move_between_engines_in_and_across_processes(llama_dir):
    prompts = _prompts(seed=3)
    prefill, decode = _llm(llama_dir, kv_cache_dtype="fp8"), _llm(llama_dir, kv_cache_dtype="fp8")
    prefill.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=1))
    for ids in prompts:
        prefix = export_prefix(prefill.engine, ids)
        assert prefix.blocks.dtype == torch.float8_e4m3fn
        import_prefix(decode.engine, prefix)
    assert _tokens(decode, prompts) == _tokens(prefill, prompts)  # both from the same cached codes
    with pytest.raises(ValueError, match="dtype"):  # an FP8 prefix into a float32 cache
        import_prefix(_llm(llama_dir).engine, export_prefix(prefill.engine, prompts[0]))

    import kv_transfer_ranks

    results = spawn(kv_transfer_ranks.prefill_here_decode_there, 2, (str(llama_dir), prompts, 16, 8, "fp8"),
                    timeout_s=240)
    assert results[1][1] == results[0]  # rank 1 decodes from the received codes what rank 0 does from its own


@pytest.mark.parametrize("value", ["fp8_e5m2", "int8", "bfloat16"])
def test_an_unsupported_kv_cache_dtype_is_refused_naming_it(llama_dir, value):
    with pytest.raises(ValueError, match=f"kv_cache_dtype: got '{value}'; supported: 'auto', 'fp8', 'fp8_e4m3'"):
        _llm(llama_dir, kv_cache_dtype=value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_cache_on_cuda_graphs_decode_as_eager_and_scores_as_the_bf16_cache(llama_dir):
    """The Triton kernels write and read the codes: CUDA-graph decode steps give the eager engine's tokens, and the
    prompt's log-probabilities stay within 0.05 nats of the bfloat16 cache's."""
    prompts = _prompts()
    kw = dict(device="cuda", num_kv_blocks=256, max_num_batched_tokens=16, kv_cache_dtype="fp8")
    graphs, eager = _llm(llama_dir, **kw), _llm(llama_dir, enforce_eager=True, **kw)
    assert graphs.engine.runner.graphs is not None
    assert _tokens(graphs, prompts) == _tokens(eager, prompts)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    bf16 = _llm(llama_dir, device="cuda", dtype="bfloat16", num_kv_blocks=256, max_num_batched_tokens=16)
    fp8 = _llm(llama_dir, **{**kw, "dtype": "bfloat16"})
    prompt = _prompts((48,))[0]
    a, b = (llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0].prompt_logprobs for llm in (bf16, fp8))
    diffs = [abs(x[t] - y[t]) for x, y, t in zip(a[1:], b[1:], prompt[1:])]
    assert max(diffs) < 0.05 and sum(diffs) / len(diffs) < FP8_MEAN_NATS
