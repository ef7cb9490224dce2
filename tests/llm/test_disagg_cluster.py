"""A router and prefill/decode workers in real processes: the same tokens as one engine, with the split asked
for or measured."""

from __future__ import annotations

import pytest
import torch

import ninefold.comm as nc
from ninefold import LLM, SamplingParams
from ninefold.comm.spawn import SpawnError, spawn
from ninefold.llm.disagg import Router, start

BLOCK = 4


def _prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 200, (n,), generator=g).tolist() for n in (29, 6, 17, 40, 11)]


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_four_ranks_give_one_engines_tokens_under_every_split(llama_dir, device):
    prompts = _prompts()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    single = LLM(str(llama_dir), dtype="float32", device=device, block_size=BLOCK, num_kv_blocks=256)
    reference = [o.outputs[0].token_ids for o in single.generate(prompt_token_ids=prompts, sampling_params=params)]

    import disagg_ranks  # tests/llm is on sys.path (conftest), and so in the spawned ranks
    results = spawn(disagg_ranks.run_cluster, 4, (str(llama_dir), prompts, 24, [1, 2, None], device),
                    timeout_s=300)
    assert results[1:] == [None, None, None]
    calls, more = results[0][:-1], results[0][-1]
    for (tokens, plan, cached, ranks, errors, costs), asked in zip(calls, [1, 2, None]):
        assert len(costs) == len(plan.decode) and all(c["steps"] > 0 and c["tokens"] > 0 for c in costs)
        assert tokens == reference
        assert errors == []
        assert cached == [(len(ids) - 1) // BLOCK * BLOCK for ids in prompts]  # every full block came over
        if asked is not None:
            assert (len(plan.prefill), len(plan.decode)) == (asked, 3 - asked) and plan.reason == "asked for"
        else:
            assert "balances" in plan.reason and len(plan.prefill) + len(plan.decode) == 3
        assert {p for p, _ in ranks} <= set(plan.prefill) and {d for _, d in ranks} <= set(plan.decode)
    assert {d for _, d in calls[0][3]} == {2, 3}  # one prefill worker feeds both decode workers
    # Per-prompt SamplingParams, every one of n=2 samples returned (only the first came back before).
    per_prompt = disagg_ranks.per_prompt_params(len(prompts), 24)
    want = [[list(c.token_ids) for c in o.outputs] for o in single.generate(prompt_token_ids=prompts,
                                                                             sampling_params=per_prompt)]
    assert more["per_prompt"] == want and len(want[0]) == 2
    # A decode worker that fails mid-call: the call raises naming it, and the next call is not handed the
    # other decode worker's stale reply (it was left unread before, and then taken for the next call's).
    assert more["failed"] == ("decode worker 2 failed: ValueError: prompt_token_ids[0]: prompt: token id(s) [1000000, "
                              "1000000, 1000000, 1000000, 1000000] out of the vocabulary range [0, 320)")
    assert more["after_failure"] == reference
    assert more["after_shutdown"] == "generate: this router was shut down"


def test_a_cluster_needs_three_ranks_and_a_valid_split():
    comm = nc.init(device="cpu")
    try:
        with pytest.raises(ValueError, match="comm: disaggregation needs a router and at least one prefill and one "
                                             "decode worker, so 3 or more ranks; got 1"):
            start(comm, "unused")
        router = Router(comm, max_model_len=100)
        router.workers = [1, 2, 3]  # the split is arithmetic on the worker list
        with pytest.raises(ValueError, match=r"num_prefill: expected an int in 1..2 \(one worker at least must "
                                             r"decode\), got 3"):
            router.plan(100, 100, num_prefill=3)
        assert router.plan(100, 100).reason.startswith("no measurements yet")
        router.prefill_s_per_token, router.decode_s_per_token = 0.001, 0.01
        assert len(router.plan(10000, 100).prefill) == 2  # 10 s of prefill against 1 s of decode
        assert len(router.plan(100, 10000).prefill) == 1
        # Each sample may generate max_tokens, or without it up to the context limit (it once counted as 1 token).
        assert router.max_new_tokens([7] * 30, SamplingParams(max_tokens=None, n=2)) == 140
        assert router.max_new_tokens([7] * 30, SamplingParams(max_tokens=500)) == 70
        assert router.max_new_tokens([7] * 30, SamplingParams(max_tokens=8, n=3)) == 24
        with pytest.raises(ValueError, match=r"prompt_token_ids\[1\]: expected a non-empty list of ints"):
            router.generate([[1, 2], []], SamplingParams(max_tokens=1))
        with pytest.raises(TypeError, match="sampling_params: expected a SamplingParams or a list of them, got dict"):
            router.generate([[1, 2]], {"max_tokens": 1})
        with pytest.raises(ValueError, match="enable_prefix_caching: the KV blocks travel into the decode worker's "
                                             "prefix cache, so it must be True; got False"):
            start(comm, "unused", enable_prefix_caching=False)
    finally:
        comm.close()


def test_a_worker_that_cannot_load_is_named_on_every_rank(tmp_path):
    import disagg_ranks

    with pytest.raises(SpawnError, match=r"workers failed to load the model: rank 1: .*missing"):
        spawn(disagg_ranks.start_only, 3, (str(tmp_path / "missing"),), timeout_s=120)


def test_workers_sharing_a_gpu_load_in_turn_with_their_share_of_memory():
    from ninefold.comm.topology import RankInfo, Topology
    from ninefold.llm.disagg.cluster import _loading_order

    def gpu(rank, uuid):
        return RankInfo(rank, "h", rank, "cuda", 0, uuid, "H200")
    topo = Topology((gpu(0, "a"), gpu(1, "a"), gpu(2, "a"), gpu(3, "b"), gpu(4, "a")))
    assert [_loading_order(topo, r) for r in range(5)] == [
        (3, 0, None), (3, 0, 1 / 3), (3, 1, 2 / 3), (3, 0, 1.0), (3, 2, 1.0)]
    cpus = Topology(tuple(RankInfo(r, "h", r, "cpu", None, None, None) for r in range(3)))
    assert [_loading_order(cpus, r) for r in range(3)] == [(1, 0, None)] * 3


def test_a_worker_sharing_a_gpu_scales_only_the_device_wide_fraction():
    from ninefold.llm.disagg.cluster import worker_llm_args

    assert worker_llm_args({}, 0.5) == {"kv_cache_memory_fraction": 0.45}
    assert worker_llm_args({"kv_cache_memory_fraction": 0.6}, 0.5) == {"kv_cache_memory_fraction": 0.3}
    assert worker_llm_args({"dtype": "bfloat16"}, None) == {"dtype": "bfloat16"}
    # each engine's own share already, and an exact pool: nothing to scale (both would clash with a fraction)
    assert worker_llm_args({"gpu_memory_utilization": 0.3}, 0.5) == {"gpu_memory_utilization": 0.3}
    assert worker_llm_args({"num_kv_blocks": 64}, 0.5) == {"num_kv_blocks": 64}


def test_a_worker_whose_router_went_away_without_stopping_it_says_so():
    from ninefold.comm import CommError
    from ninefold.llm.disagg.cluster import _serve

    class RouterGone:
        rank = 2

        def recv_object(self, src):
            raise CommError("recv over gloo failed: Connection closed by peer")

    with pytest.raises(RuntimeError, match=r"disaggregation worker 2: the router \(rank 0\) went away without stopping "
                                           r"the workers; end its work with Router.shutdown\(\) or a `with router:` "
                                           "block"):
        _serve(RouterGone(), None)
