"""The engine's prefill warm-up (run at start-up on CUDA): it must fit any model and leave no trace."""

import torch

from ninefold.llm.engine import LLMEngine
from ninefold.llm.sampling import SamplingParams


def _generate(engine, prompt):
    request = engine.build_request(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), "r")
    engine.add_request(request)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs[-1].outputs[0].token_ids


def test_prefill_warm_up_fits_a_short_rotary_table_and_writes_no_cache(model_dirs):
    # max_model_len 48 with blocks of 16: the long cached chunk (8 blocks) would not fit and shrinks
    engine = LLMEngine(str(model_dirs["llama"]), device="cpu", max_model_len=48, num_kv_blocks=8)
    caches = [t.clone() for pair in engine.model.kv_caches for t in pair]
    expected = _generate(engine, [5, 6, 7, 8])
    for pair in engine.model.kv_caches:
        for t in pair:
            t.copy_(caches.pop(0))
    snapshot = [t.clone() for pair in engine.model.kv_caches for t in pair]
    engine._warm_up_prefill()
    assert all(torch.equal(a, b) for a, b in zip(snapshot, [t for pair in engine.model.kv_caches for t in pair]))
    assert _generate(engine, [5, 6, 7, 8]) == expected
