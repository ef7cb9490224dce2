"""scheduling_policy="priority": admission, budget and preemption by (priority, arrival), as vLLM's."""

import pytest

from ninefold import LLM, SamplingParams
from ninefold.llm.sequence import Status

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 6, 7], [8, 9, 10], [11, 12, 13], [14, 15, 16]]


def finish_order(llm, priority=None) -> list[int]:
    engine = llm.engine
    requests = [engine.build_request(p, PARAMS, priority=priority[i] if priority else 0) for i, p in enumerate(PROMPTS)]
    for r in requests:
        engine.add_request(r)
    index = {r.request_id: i for i, r in enumerate(requests)}
    order = []
    while engine.has_unfinished_requests():
        order += [index[o.request_id] for o in engine.step() if o.finished]
    return order


def test_one_at_a_time_runs_in_priority_then_arrival_order(llama_dir):
    fcfs = LLM(str(llama_dir), device="cpu", max_num_seqs=1)
    ranked = LLM(str(llama_dir), device="cpu", max_num_seqs=1, scheduling_policy="priority")
    assert finish_order(fcfs) == [0, 1, 2, 3]
    assert finish_order(ranked, [5, 0, 3, 0]) == [1, 3, 2, 0]
    assert finish_order(ranked, [-1, -1, -1, -1]) == [0, 1, 2, 3]  # ties: first come first served


def test_the_least_urgent_sequence_is_preempted(llama_dir):
    # two sequences of 40 tokens in 12 blocks of 4 tokens: one must make room for the other
    llm = LLM(str(llama_dir), device="cpu", block_size=4, num_kv_blocks=12, max_model_len=48,
              scheduling_policy="priority")
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=38, ignore_eos=True)
    low = engine.build_request([5, 6], params, priority=9)   # arrives first
    high = engine.build_request([7, 8], params, priority=1)
    for r in (low, high):
        engine.add_request(r)
    preempted = {low.request_id: 0, high.request_id: 0}
    outputs = {}
    while engine.has_unfinished_requests():
        before = {r.request_id: r.seqs[0].status for r in (low, high)}
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        for r in (low, high):
            if before[r.request_id] is Status.RUNNING and r.seqs[0].status is Status.WAITING:
                preempted[r.request_id] += 1
    assert preempted[low.request_id] > 0 and preempted[high.request_id] == 0
    plain = LLM(str(llama_dir), device="cpu").generate([[5, 6], [7, 8]], params)
    assert [outputs[low.request_id], outputs[high.request_id]] == [o.outputs[0].token_ids for o in plain]


def test_priority_is_refused_where_it_means_nothing(llama_dir):
    fcfs = LLM(str(llama_dir), device="cpu")
    with pytest.raises(ValueError, match="priority: got 2"):
        fcfs.generate(["x"], PARAMS, priority=[2])
    fcfs.generate(["x"], PARAMS, priority=[0])  # the default is fine anywhere
    ranked = LLM(str(llama_dir), device="cpu", scheduling_policy="priority")
    with pytest.raises(ValueError, match="priority: expected a list of 2"):
        ranked.generate(["x", "y"], PARAMS, priority=[1])
    with pytest.raises(TypeError, match="priority"):
        ranked.engine.build_request("x", PARAMS, priority=1.5)
    with pytest.raises(ValueError, match="scheduling_policy"):
        LLM(str(llama_dir), device="cpu", scheduling_policy="lifo")
