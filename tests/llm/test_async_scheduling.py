"""Overlapped ("async") scheduling: step n+1 is launched before step n's tokens are read.

On the CPU nothing overlaps (every launch computes at once), but the bookkeeping is the same as
on CUDA: placeholders for tokens still on the device, token ids taken from the previous step's
tensor, one wasted row after a stop, aborts between launch and read. Every scenario runs in both
modes and must give identical results.
"""

import pytest
import torch

from ninefold import LLM, SamplingParams
from ninefold.llm.sequence import PLACEHOLDER

from .test_parity import prompts_for

PROMPT_LENGTHS = (3, 17, 45, 9, 30)


def _prompts(vocab: int) -> list[list[int]]:
    return prompts_for(vocab, PROMPT_LENGTHS, seed=7)


def _summary(outputs):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs) for c in out.outputs] for out in outputs]


def _pair(path, **kwargs):
    """The same engine settings without and with overlapped scheduling."""
    return (LLM(str(path), device="cpu", async_scheduling=False, **kwargs),
            LLM(str(path), device="cpu", async_scheduling=True, **kwargs))


def _assert_no_leak(llm):
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.blocks.num_available == engine.pool.num_blocks  # every block free or evictable


@pytest.mark.parametrize("kwargs", [
    dict(block_size=4, num_kv_blocks=128),  # batched decode, prefix caching on
    dict(block_size=4, num_kv_blocks=128, max_num_batched_tokens=9),  # chunked prefill, mixed steps
    dict(block_size=4, num_kv_blocks=26, max_num_batched_tokens=9),  # preemption by recompute
    dict(block_size=4, num_kv_blocks=64, max_num_seqs=2),  # requests wait for a free slot
], ids=["batched", "chunked", "preempted", "queued"])
def test_greedy_batches_match_the_synchronous_engine(llama_dir, kwargs):
    sync, overlapped = _pair(llama_dir, **kwargs)
    prompts = _prompts(sync.engine.model_config.vocab_size)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 24, 7, 31, 2)]
    want = _summary(sync.generate(prompt_token_ids=prompts, sampling_params=params))
    got = _summary(overlapped.generate(prompt_token_ids=prompts, sampling_params=params))
    assert got == want
    assert [len(o[0][0]) for o in got] == [1, 24, 7, 31, 2]
    assert overlapped.engine.num_steps_ahead > 20 and sync.engine.num_steps_ahead == 0
    # the prefix cache filled by the overlapped run serves a second pass identically
    assert _summary(overlapped.generate(prompt_token_ids=prompts, sampling_params=params)) == want
    _assert_no_leak(sync)
    _assert_no_leak(overlapped)


def test_stops_sampling_and_logprobs_match_the_synchronous_engine(llama_dir):
    sync, overlapped = _pair(llama_dir, block_size=4, num_kv_blocks=256)
    vocab = sync.engine.model_config.vocab_size
    prompts = _prompts(vocab)
    greedy = sync.generate(prompt_token_ids=prompts[:1], sampling_params=SamplingParams(
        temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0].token_ids
    eos = sync.engine.eos_token_ids[0]
    params = [
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[greedy[5]], ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=3, n=3, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=20, min_tokens=4, logit_bias={eos: 100.0}),
        SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3, frequency_penalty=0.5, ignore_eos=True),
    ]
    want = sync.generate(prompt_token_ids=prompts, sampling_params=params)
    got = overlapped.generate(prompt_token_ids=prompts, sampling_params=params)
    assert _summary(got) == _summary(want)
    assert got[0].outputs[0].finish_reason == "stop" and got[0].outputs[0].token_ids[-1] == greedy[5]
    assert len(got[2].outputs[0].token_ids) == 5 and got[2].outputs[0].token_ids[-1] == eos
    _assert_no_leak(overlapped)


def test_stop_strings_match_the_synchronous_engine(llama_dir):
    sync, overlapped = _pair(llama_dir, block_size=4, num_kv_blocks=128)
    base = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    text = sync.generate(["The quick brown fox"], base)[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop])
    prompts = ["The quick brown fox", "Hello there", "One two three four five"]
    want = sync.generate(prompts, params)
    assert want[0].outputs[0].finish_reason == "stop"
    assert _summary(overlapped.generate(prompts, params)) == _summary(want)
    _assert_no_leak(overlapped)


def test_streamed_outputs_never_show_a_placeholder_and_only_grow(llama_dir):
    llm = LLM(str(llama_dir), device="cpu", block_size=4, num_kv_blocks=128, async_scheduling=True)
    engine = llm.engine
    prompts = _prompts(engine.model_config.vocab_size)
    seen: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(engine.build_request(prompt, SamplingParams(temperature=0, max_tokens=10 + i,
                                                                       ignore_eos=True), f"r{i}"))
    finished = set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            ids = out.outputs[0].token_ids
            assert PLACEHOLDER not in ids
            assert ids[: len(seen.get(out.request_id, []))] == seen.get(out.request_id, [])
            seen[out.request_id] = ids
            if out.finished:
                finished.add(out.request_id)
    assert finished == {f"r{i}" for i in range(len(prompts))}
    assert [len(seen[f"r{i}"]) for i in range(len(prompts))] == [10 + i for i in range(len(prompts))]
    _assert_no_leak(llm)


def test_abort_while_a_step_is_in_flight_frees_blocks_and_drops_the_placeholder(llama_dir):
    sync, overlapped = _pair(llama_dir, block_size=4, num_kv_blocks=128)
    prompts = _prompts(sync.engine.model_config.vocab_size)[:3]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in sync.generate(prompt_token_ids=prompts, sampling_params=params)]
    engine = overlapped.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(engine.build_request(prompt, params, f"a{i}"))
    for _ in range(6):
        engine.step()
    assert engine._in_flight is not None  # a step is launched and not read: the case under test
    aborted = engine.abort_request("a1")
    ids = aborted.outputs[0].token_ids
    assert aborted.outputs[0].finish_reason == "abort"
    assert PLACEHOLDER not in ids and ids == want[1][: len(ids)] and 0 < len(ids) < 16
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out.outputs[0].token_ids
    assert done == {"a0": want[0], "a2": want[2]}
    _assert_no_leak(overlapped)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
def test_a_step_that_fails_at_launch_can_be_retried(llama_dir, overlap):
    llm = LLM(str(llama_dir), device="cpu", block_size=4, num_kv_blocks=64, async_scheduling=overlap)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=params)[0].outputs[0].token_ids
    engine.add_request(engine.build_request([5, 6, 7], params, "a"))
    launch, calls = engine.runner.launch, [0]

    def flaky(step, previous=None):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("a transient failure in one step")
        return launch(step, previous)

    engine.runner.launch = flaky
    finished, errors = [], 0
    for _ in range(30):
        if not engine.has_unfinished_requests():
            break
        try:
            finished += [o for o in engine.step() if o.finished]
        except RuntimeError:
            errors += 1
    assert errors == 1
    assert [o.outputs[0].token_ids for o in finished] == [want]
    _assert_no_leak(llm)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
def test_a_one_token_prompt_chunk_beside_sampled_decodes(llama_dir, overlap):
    # A budget of 3 tokens leaves one token of the third prompt beside two decodes: a one-token
    # row that samples nothing yet. Non-greedy sampling must get one row of logits per sampler.
    llm = LLM(str(llama_dir), device="cpu", block_size=4, num_kv_blocks=64, max_num_batched_tokens=3,
              async_scheduling=overlap)
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=4, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=[[5, 6], [7, 8], [9, 10, 11, 12, 13]], sampling_params=params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4, 4]
    reference = LLM(str(llama_dir), device="cpu", block_size=4, num_kv_blocks=64, async_scheduling=False)
    again = reference.generate(prompt_token_ids=[[5, 6], [7, 8], [9, 10, 11, 12, 13]], sampling_params=params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in again]
    _assert_no_leak(llm)


def test_async_scheduling_is_validated():
    from ninefold.llm.config import split_engine_args

    with pytest.raises(ValueError, match="async_scheduling"):
        split_engine_args({"async_scheduling": "yes"})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("graphs", [True, False], ids=["cuda-graphs", "eager"])
def test_overlapped_scheduling_on_cuda_matches_the_synchronous_engine(llama_dir, graphs):
    kwargs = dict(dtype="float32", device="cuda", block_size=16, num_kv_blocks=64, max_num_batched_tokens=40,
                  cuda_graph_max_batch=4, enforce_eager=not graphs)
    sync = LLM(str(llama_dir), async_scheduling=False, **kwargs)
    overlapped = LLM(str(llama_dir), **kwargs)  # on by default on CUDA
    assert overlapped.engine.async_scheduling
    prompts = _prompts(sync.engine.model_config.vocab_size)
    greedy = sync.generate(prompt_token_ids=prompts[:1], sampling_params=SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0].token_ids
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 24, 7)]
    params += [SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[greedy[6]], ignore_eos=True),
               SamplingParams(temperature=0.7, seed=5, n=2, max_tokens=16, ignore_eos=True)]
    want = _summary(sync.generate(prompt_token_ids=prompts, sampling_params=params))
    assert _summary(overlapped.generate(prompt_token_ids=prompts, sampling_params=params)) == want
    assert overlapped.engine.num_steps_ahead > 10
    _assert_no_leak(overlapped)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_page_locked_token_buffers_on_cuda_are_reused_once_read():
    from ninefold.llm.sampler import Sampler
    from ninefold.llm.sequence import Sequence

    sampler = Sampler(torch.device("cuda"), 50, ())
    seqs = [Sequence("r", i, [1], 1, SamplingParams(temperature=0)) for i in range(3)]
    logits = torch.randn(3, 50, device="cuda")
    first, second = sampler.sample(logits, seqs), sampler.sample(-logits, seqs)  # two steps in flight
    buffers = {first._host.data_ptr(), second._host.data_ptr()}
    assert len(buffers) == 2  # one buffer each while unread
    assert first.read().token_ids == logits.argmax(-1).tolist()
    assert second.read().token_ids == (-logits).argmax(-1).tolist()
    third = sampler.sample(logits[:2], seqs[:2])
    assert third._host.data_ptr() in buffers  # a read buffer serves the next step
    assert third.read().token_ids == logits[:2].argmax(-1).tolist()
