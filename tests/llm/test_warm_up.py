"""The engine's prefill warm-up (run at start-up on CUDA): it must fit any model and leave no trace."""

import pytest
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


@pytest.mark.parametrize("block_size,budget,classes", [
    (16, 2048, {"short", "medium", "long"}),
    (8, 2048, {"short", "medium", "long"}),  # chunk sizes do not follow the block size
    (16, 300, {"short", "medium"}),  # no chunk beyond the step budget: a long class cannot occur
])
def test_prefill_warm_up_runs_every_prompt_length_class_of_the_attention_kernel(monkeypatch, block_size, budget,
                                                                                 classes):
    # The Triton prefill attention picks tiles by the call's mean new tokens per sequence (short,
    # medium, long, by ``prefill.SHORT`` and ``prefill.MEDIUM``): each class a step can hold, packed
    # and over cached context, must compile before requests come; no warm-up step exceeds the budget.
    prefill = pytest.importorskip("ninefold.ops.triton.prefill")
    import ninefold.ops as ops

    config = dict(architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, num_hidden_layers=1, vocab_size=512, max_position_embeddings=4096)
    engine = LLMEngine(config, load_format="dummy", dtype="float32", device="cpu", max_model_len=4096,
                       num_kv_blocks=600, max_num_batched_tokens=budget, block_size=block_size)
    seen = set()
    real = ops.attention_prefill

    def recording(q, k, v, cu_seqlens_q, cu_seqlens_k, **kwargs):
        assert q.shape[0] <= budget
        mean = q.shape[0] / (cu_seqlens_q.shape[0] - 1)
        kind = "short" if mean <= prefill.SHORT else "medium" if mean <= prefill.MEDIUM else "long"
        seen.add((kind, "paged" if kwargs.get("block_tables") is not None else "packed"))
        return real(q, k, v, cu_seqlens_q, cu_seqlens_k, **kwargs)

    monkeypatch.setattr(ops, "attention_prefill", recording)
    engine._warm_up_prefill()
    assert seen == {(kind, mode) for kind in classes for mode in ("packed", "paged")}
