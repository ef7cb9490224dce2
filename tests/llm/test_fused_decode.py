"""Decode of 1 and of a few (up to 32) sequences on CUDA runs the norm/gate-fused GEMVs (``ops.add_rms_norm_linear``,
``ops.silu_and_mul_linear``; the one-row and the 2..16-row kernels): CUDA-graph logits equal eager ones
and agree with the unfused path."""

import pytest
import torch

import ninefold.ops as ops
from ninefold import SamplingParams
from ninefold.llm.engine import LLMEngine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

UNFUSED = dict(add_rms_norm_linear="vendor", silu_and_mul_linear="vendor", linear="vendor")


@pytest.mark.parametrize("variant", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("pdl", ["0", "1"])
@pytest.mark.parametrize("batch", [1, 5, 20])
def test_decode_graph_eager_and_unfused_agree(model_dirs, variant, pdl, batch, monkeypatch):
    from ninefold.ops.triton import gemv_pdl

    if pdl == "1" and not gemv_pdl.pdl_available():
        pytest.skip("no PDL on this GPU/Triton")
    monkeypatch.setenv("NINEFOLD_GEMV_PDL", pdl)
    from ninefold.ops.triton import gemv_pdl_ops

    # the few-rows GEMV runs where a table lists the call: list every call of this model
    monkeypatch.setattr(gemv_pdl_ops, "rows_config", lambda n, k, prologue="none", rows=16: (16, 64, 1, 4, 3)
                        if k % 64 == 0 else ())
    engine = LLMEngine(str(model_dirs[variant]), dtype=torch.bfloat16, device="cuda", block_size=16,
                       num_kv_blocks=128, cuda_graph_max_batch=24)
    model = engine.runner.model
    layer = model.layers[0]
    x = torch.randn(batch, layer.gate_up.shape[1], device="cuda", dtype=torch.bfloat16)
    assert ops.choose("add_rms_norm_linear", x, x, layer.post_norm, layer.gate_up, 1e-6, None) == "triton"
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for i in range(batch):
        engine.add_request(engine.build_request([7, 200, 13, 99] * (5 + i), params, str(i)))
    engine.step()
    engine.sync()
    for _ in range(4):
        step = engine.scheduler.schedule()
        assert len(step) == batch and all(s.num_new_tokens == 1 for s in step)
        graph_logits = engine.runner.forward_logits(step).clone()
        graphs, engine.runner.graphs = engine.runner.graphs, None
        eager = engine.runner.forward_logits(step).clone()
        with ops.use(**UNFUSED):
            unfused = engine.runner.forward_logits(step).clone()
        engine.runner.graphs = graphs
        torch.testing.assert_close(graph_logits.float(), eager.float(), atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(eager.float(), unfused.float(), atol=3e-2, rtol=3e-2)
        for row, scheduled in enumerate(step):
            scheduled.seq.num_computed_tokens += 1
            scheduled.seq.append(int(eager[row].float().argmax(-1)))
