"""quantization="fp8": every layer's projections as ops.Fp8Weight, checked against a checkpoint whose projections
are those FP8 values written out in float32 (so the only difference left is where the rounding happens)."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from ninefold import LLM, SamplingParams
from ninefold.ops import Fp8Weight

PROMPTS = [[5, 9, 33], list(range(40, 57)), [7, 200, 13, 99] * 11]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ROW_PARALLEL = ("o_proj", "down_proj")  # split by columns under tensor parallelism


def _fp8_values(weight: torch.Tensor, column_parts: int = 1) -> torch.Tensor:
    """``weight`` rounded as an Fp8Weight (per row; per row of each of ``column_parts`` column slices)."""
    parts = weight.float().chunk(column_parts, dim=1)
    return torch.cat([Fp8Weight.quantize(p).dequantize(torch.float32) for p in parts], dim=1)


def _rounded_copy(source, target, tensor_parallel: int = 1):
    """``source``'s checkpoint with every projection replaced by its FP8 values, as ``tensor_parallel`` ranks hold
    them (the o and down projections of each rank are its own columns)."""
    shutil.copytree(source, target)
    tensors = load_file(target / "model.safetensors")
    for name, tensor in tensors.items():
        if name.endswith(".weight") and any(f".{p}." in name for p in PROJECTIONS):
            parts = tensor_parallel if any(f".{p}." in name for p in ROW_PARALLEL) else 1
            tensors[name] = _fp8_values(tensor, parts).to(tensor.dtype)
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


def _greedy(llm, new_tokens=32):
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)]


def _first_logprobs(llm) -> list[list[float]]:
    """The top-5 log-probabilities of the first token after each prompt."""
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    return [sorted(o.outputs[0].logprobs[0].values(), reverse=True) for o in outs]


@pytest.mark.parametrize("variant", ["llama", "llama_tied", "qwen2", "qwen3"])
def test_fp8_model_generates_what_its_rounded_weights_do(model_dirs, tmp_path, variant):
    path = model_dirs[variant]
    fp8 = LLM(str(path), device="cpu", dtype="float32", quantization="fp8", num_kv_blocks=64)
    layer = fp8.engine.model.layers[0]
    assert all(type(m) is Fp8Weight for m in (layer.qkv, layer.o, layer.gate_up, layer.down))
    rounded = LLM(str(_rounded_copy(path, tmp_path / "rounded")), device="cpu", dtype="float32", num_kv_blocks=64)
    assert _greedy(fp8) == _greedy(rounded)
    plain = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=64)
    got, want, unrounded = (torch.tensor(_first_logprobs(llm)) for llm in (fp8, rounded, plain))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (got - unrounded).abs().max() > 1e-4  # the rounding is real: without it the log-probabilities move
    # the projections take a byte per value instead of four, plus a float32 scale per row
    c = fp8.engine.model.config
    values = c.num_layers * c.hidden_size * (2 * c.num_heads * c.head_dim + 2 * c.num_kv_heads * c.head_dim
                                             + 3 * c.intermediate_size)
    scales = sum(m.scales.nbytes for m in fp8.engine.model.packed.values())
    assert plain.engine.model.weight_bytes - fp8.engine.model.weight_bytes == 3 * values - scales


def test_two_ranks_each_quantize_their_own_slices(model_dirs, tmp_path):
    path = model_dirs["llama"]
    rounded = LLM(str(_rounded_copy(path, tmp_path / "rounded", tensor_parallel=2)), device="cpu", dtype="float32",
                  num_kv_blocks=64)
    with LLM(str(path), device="cpu", dtype="float32", quantization="fp8", num_kv_blocks=64,
             tensor_parallel_size=2) as two:
        assert _greedy(two) == _greedy(rounded)


def test_unknown_quantization_lists_fp8(model_dirs):
    with pytest.raises(ValueError, match="quantization: got 'fp4'; supported: 'auto', 'int4', 'none', 'fp8'"):
        LLM(str(model_dirs["llama"]), device="cpu", quantization="fp4")


def test_a_quantized_gguf_is_dequantized_then_stored_in_fp8(tmp_path):
    """A GGUF's Q4_0 matrices are decoded before the FP8 rounding (the packed codes cannot be requantized as they
    are): each FP8 layer holds exactly the FP8 rounding of the matrix the GGUF read with quantization="none" holds,
    and the engine generates."""
    from gguf import GGMLQuantizationType as T

    from .test_gguf import hf_weights, write_gguf

    path = write_gguf(tmp_path / "q4.gguf", hf_weights(), T.Q4_0)
    fp8 = LLM(str(path), device="cpu", dtype="float32", quantization="fp8", num_kv_blocks=64)
    layer = fp8.engine.model.layers[0]
    assert all(type(m) is Fp8Weight for m in (layer.qkv, layer.o, layer.gate_up, layer.down))
    exact = LLM(str(path), device="cpu", dtype="float32", quantization="none", num_kv_blocks=64)
    for got, dense in zip(fp8.engine.model.layers, exact.engine.model.layers):
        for name in ("qkv", "o", "gate_up", "down"):
            matrix = getattr(dense, name)
            assert not torch.equal(getattr(got, name).dequantize(), matrix)
            assert torch.equal(getattr(got, name).dequantize(), Fp8Weight.quantize(matrix).dequantize())
    assert all(len(ids) == 32 for ids in _greedy(fp8))
