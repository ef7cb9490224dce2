"""AsyncEngine: streaming, abort, bad requests, stats."""

import asyncio

import numpy as np
import pytest

from ninefold.llm.async_engine import AsyncEngine
from ninefold.llm.sampling import SamplingParams


@pytest.fixture(scope="module")
def engine(llama_dir):
    eng = AsyncEngine(str(llama_dir), device="cpu", block_size=4, num_kv_blocks=64)
    yield eng
    eng.shutdown()


async def collect(engine, prompt, params, rid):
    return [out async for out in engine.generate(prompt, params, rid)]


def test_streams_cumulative_outputs_concurrently(engine):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def main():
        return await asyncio.gather(*(collect(engine, f"Hello number {i}", params, f"s{i}") for i in range(3)))

    for outs in asyncio.run(main()):
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert [len(o.outputs[0].token_ids) for o in outs] == list(range(1, 13))
        texts = [o.outputs[0].text for o in outs]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert engine.stats()["num_running"] == 0


def test_abort_mid_stream_frees_blocks_and_ends_the_stream(engine):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        seen = []
        async for out in engine.generate([5, 6, 7, 8, 9], params, "to-abort"):
            seen.append(out)
            if len(seen) == 3:
                await engine.abort("to-abort")
        await engine.abort("never-existed")
        return seen

    seen = asyncio.run(main())
    assert seen[-1].finished and seen[-1].outputs[0].finish_reason == "abort"
    assert len(seen[-1].outputs[0].token_ids) < 200
    stats = engine.stats()
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"] == 64


def test_closing_the_iterator_aborts_the_request(engine):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        stream = engine.generate([5, 6, 7], params, "closed")
        await stream.__anext__()
        await stream.aclose()
        for _ in range(100):
            if engine.stats()["num_running"] == 0:
                return True
            await asyncio.sleep(0.05)
        return False

    assert asyncio.run(main())


def test_bad_requests_raise_before_the_first_output_and_others_keep_going(engine):
    good = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def main():
        ok = asyncio.create_task(collect(engine, "fine", good, "ok"))
        with pytest.raises(ValueError, match="vocabulary"):
            await collect(engine, [1, 10**6], good, "bad1")
        with pytest.raises(ValueError, match="max_model_len"):
            await collect(engine, [3] * engine.max_model_len, good, "bad2")
        return await ok

    outs = asyncio.run(main())
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4


def test_stats_and_attributes(engine):
    stats = engine.stats()
    for key in ("num_running", "num_waiting", "kv_usage", "num_free_blocks", "num_blocks", "block_size",
                "prefix_cache_hit_rate"):
        assert key in stats
    assert 0 <= stats["kv_usage"] <= 1 and stats["block_size"] == 4
    assert engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]).endswith("assistant\n")
    assert engine.max_model_len == 256


def test_embed_jobs_share_steps_and_a_cancelled_one_is_dropped(llama_dir):
    """Steps of at most 32 tokens: jobs of several prompts span steps and steps hold prompts of several jobs;
    results equal the offline engine's. A cancelled job stops being computed and the next one is answered."""
    from ninefold.llm.api import LLM
    from ninefold.llm.pooling import PoolingParams

    prompts = [f"Hello number {i}, the quick brown fox" for i in range(12)]
    offline = [o.outputs.embedding for o in LLM(str(llama_dir), device="cpu").embed(prompts)]
    eng = AsyncEngine(str(llama_dir), device="cpu", max_num_batched_tokens=32)
    try:
        async def main():
            jobs = [eng.embed(prompts[i:i + 4], None, f"e{i}") for i in range(0, 12, 4)]
            together = await asyncio.gather(*jobs)
            doomed = asyncio.ensure_future(eng.embed(prompts * 20, PoolingParams(), "doomed"))
            await asyncio.sleep(0)
            doomed.cancel()
            after = await eng.embed(prompts[:2], [PoolingParams(normalize=False), PoolingParams()], "after")
            return together, doomed, after

        together, doomed, after = asyncio.run(main())
        got = [o.outputs.embedding for job in together for o in job]
        assert [o.request_id for o in together[1]] == ["e4-0", "e4-1", "e4-2", "e4-3"]
        np.testing.assert_allclose(got, offline, atol=1e-5)
        assert doomed.cancelled() and not eng._embed_jobs
        np.testing.assert_allclose(after[1].outputs.embedding, offline[1], atol=1e-5)
        assert abs(np.linalg.norm(after[0].outputs.embedding) - 1) > 1e-3  # normalize=False kept the raw state
        with pytest.raises(ValueError, match="pooling_params: 1 given for 2 prompts"):
            asyncio.run(eng.embed(prompts[:2], [PoolingParams()], "bad"))
    finally:
        eng.shutdown()


def test_beam_search_matches_the_offline_search_beside_other_requests_and_cancels_cleanly(engine, llama_dir):
    import time

    from ninefold import LLM, BeamSearchParams

    prompt, params = [5, 9, 14, 33, 71], BeamSearchParams(beam_width=3, max_tokens=8)

    async def beside_a_generation():
        return await asyncio.gather(engine.beam_search(prompt, params, "beam-a"),
                                    collect(engine, "Hello", SamplingParams(temperature=0, max_tokens=5), "plain-a"))

    got, plain = asyncio.run(beside_a_generation())
    assert plain[-1].finished
    expected = LLM(str(llama_dir), device="cpu", block_size=4, num_kv_blocks=64).beam_search([prompt], params)[0]
    assert [s.tokens for s in got.sequences] == [s.tokens for s in expected.sequences]
    assert [s.cum_logprob for s in got.sequences] == pytest.approx([s.cum_logprob for s in expected.sequences],
                                                                   abs=1e-5)
    assert [s.text for s in got.sequences] == [s.text for s in expected.sequences]

    async def cancelled():
        task = asyncio.create_task(engine.beam_search(prompt, BeamSearchParams(2, 100, ignore_eos=True), "beam-b"))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancelled())
    deadline = time.monotonic() + 10
    while (engine.stats()["num_running"] or engine.stats()["num_waiting"]) and time.monotonic() < deadline:
        time.sleep(0.02)
    looked_up = engine.stats()["prefix_cache_queries"]
    time.sleep(0.5)  # no round is admitted any more
    assert engine.stats()["prefix_cache_queries"] == looked_up and engine.stats()["num_running"] == 0
    with pytest.raises(TypeError, match="params: expected BeamSearchParams"):
        asyncio.run(engine.beam_search(prompt, {"beam_width": 2}, "beam-c"))
    with pytest.raises(ValueError, match="prompt: 300 tokens"):
        asyncio.run(engine.beam_search([5] * 300, params, "beam-d"))
