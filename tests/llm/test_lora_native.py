"""LoRA on the native CPU decode step (``nf_decode.c``): a decode step whose rows use different adapters (and none)
computes what the ops-by-ops forward computes for them, within the int8 activations' rounding, and the adapters'
deltas are far larger than that rounding (so the comparison sees them)."""

from __future__ import annotations

import json

import pytest
import torch
from gguf import GGMLQuantizationType as T
from safetensors.torch import save_file

from ninefold.llm.engine import LLMEngine
from ninefold.llm.lora import LoRARequest
from ninefold.llm.sampling import SamplingParams
from ninefold.ops import cpu_native

from .test_cpu_native import _prompts, _weights
from .test_gguf import FFN, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, LAYERS, write_gguf

pytestmark = pytest.mark.skipif(not cpu_native.fast(), reason=cpu_native.slow_reason())

SIZES = {"self_attn.q_proj": (HIDDEN, HEADS * HEAD_DIM), "self_attn.k_proj": (HIDDEN, KV_HEADS * HEAD_DIM),
         "self_attn.v_proj": (HIDDEN, KV_HEADS * HEAD_DIM), "self_attn.o_proj": (HEADS * HEAD_DIM, HIDDEN),
         "mlp.gate_proj": (HIDDEN, FFN), "mlp.up_proj": (HIDDEN, FFN), "mlp.down_proj": (FFN, HIDDEN)}


def write_adapter(path, modules, r, seed):
    """A PEFT-format adapter of rank ``r`` for ``modules`` of every layer (keys as peft saves them)."""
    path.mkdir()
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(LAYERS):
        for module in modules:
            d_in, d_out = SIZES[module]
            key = f"base_model.model.model.layers.{i}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn((r, d_in), generator=g) / d_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn((d_out, r), generator=g) * 0.5
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": r}))
    return path


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_native_step_adds_each_rows_adapter_as_the_generic_path_does(tmp_path, arch, dtype):
    path = write_gguf(tmp_path / f"{arch}.gguf", _weights(arch, tied=True), T.Q4_1, arch=arch)
    engine = LLMEngine(str(path), dtype=dtype, device="cpu", block_size=4, num_kv_blocks=64,
                       enable_prefix_caching=False, enable_lora=True, max_loras=2, max_lora_rank=8)
    attention = write_adapter(tmp_path / "attn", ["self_attn.q_proj", "self_attn.v_proj", "self_attn.o_proj"], 8, 1)
    mlp = write_adapter(tmp_path / "mlp", ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "self_attn.k_proj"], 4, 2)
    adapters = [LoRARequest("attn", 1, str(attention)), None, LoRARequest("mlp", 2, str(mlp))]
    prompts = _prompts(engine.model_config.vocab_size)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for i, (prompt, lora) in enumerate(zip(prompts, adapters)):
        engine.add_request(engine.build_request(prompt, params, f"r{i}", lora_request=lora))
    for _ in range(3):  # prefill, then two decode steps
        engine.step()
    step = engine.scheduler.schedule()
    assert [s.num_new_tokens for s in step] == [1, 1, 1] and {s.seq.lora_slot for s in step} == {0, 1, -1}
    runner, model = engine.runner, engine.model
    model.cpu_fast_decode = False
    generic = runner.forward_logits(step)
    model.cpu_fast_decode = True
    native = runner.forward_logits(step)
    assert model._cpu_decoder.native._lora_bound is not None  # the adapters ran on the native step
    scale = generic.abs().max().item()
    tol = 0.01 if dtype == "float32" else 0.05
    torch.testing.assert_close(native, generic, rtol=0, atol=tol * scale)
    # the same rows without their adapters: far from what the adapters give
    slots = [s.seq.lora_slot for s in step]
    for s in step:
        s.seq.lora_slot = -1
    plain = runner.forward_logits(step)
    for s, slot in zip(step, slots):
        s.seq.lora_slot = slot
    for row, s in enumerate(step):
        moved = (native[row] - plain[row]).abs().max().item()
        assert moved > 3 * tol * scale if s.seq.lora is not None else moved == 0.0
