"""GGUF matrices kept quantized (``quantization="auto"``/``"int4"``) against the dequantized path.

What is asserted and why:
* the loader's codes/scales dequantize to exactly the float32 tensors the plain loader gives
  (same products in float32), so packing loses nothing before the kernel;
* with float32 activations the packed engine computes the same weights as the dequantized one, only
  summed in another order: logits agree to 1e-4 relative, and greedy tokens are equal; with the
  bfloat16 activations "auto" uses on CPUs, a float32 model stays as close to the float32
  dequantized model as a bfloat16 model of the same weights is;
* on SmolLM2 in bfloat16 the packed and the dequantized paths round differently (bf16 weights vs
  bf16 group scales), so whole greedy continuations may part at a near tie: we check that the
  packed model's first-step logits are about as far from the float32 model's as the dequantized
  bf16 model's are, and that its greedy pick is the float32 pick or a tie within that error;
* the default path (float32 model, "auto") answers the chat test's question like the float32
  dequantized model does (``tests/llm/test_chat.py``).
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

from ninefold.llm.engine import LLMEngine
from ninefold.llm.gguf import load_gguf
from ninefold.llm.gguf_packed import GGUFRows, Int4Codes, PackedLinear, Q8Codes
from ninefold.llm.sampling import SamplingParams
from ninefold.ops import cpu_native

from .test_gguf import hf_weights, write_gguf

PACKED_TYPES = [T.Q4_0, T.Q4_1, T.Q4_K, T.Q8_0]
ROWS_TYPES = [T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q5_K, T.Q6_K]  # kept as raw blocks (GGUFRows)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 77, 130, 9, 41], [200, 3, 3, 17, 88, 61, 150, 12, 99], [42]]


@pytest.mark.parametrize("qtype", PACKED_TYPES + ROWS_TYPES, ids=lambda t: t.name)
def test_kept_codes_dequantize_exactly_like_the_float_loader(tmp_path, qtype):
    path = write_gguf(tmp_path / f"t-{qtype.name}.gguf", hf_weights(arch="llama", tied=False), qtype)
    dense = load_gguf(path).tensors
    kept = load_gguf(path, keep_quantized=True).tensors
    assert set(dense) == set(kept)
    kind = Q8Codes if qtype == T.Q8_0 else GGUFRows if qtype in ROWS_TYPES else Int4Codes
    for name, tensor in dense.items():
        got = kept[name]
        if tensor.dim() == 1:
            assert isinstance(got, torch.Tensor)
            continue
        assert isinstance(got, kind), name
        assert got.shape == tuple(tensor.shape)
        torch.testing.assert_close(got.dequantize(), tensor, rtol=0, atol=0)  # q/k rows in HF order too


def _engine(path, dtype, quantization, **kw):
    return LLMEngine(str(path), dtype=dtype, device="cpu", block_size=4, num_kv_blocks=64,
                     enable_prefix_caching=False, quantization=quantization, **kw)


def _first_step_logits(engine) -> torch.Tensor:
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(engine.build_request(prompt, GREEDY, f"r{i}"))
    logits = engine.runner.forward_logits(engine.scheduler.schedule())
    for i in range(len(PROMPTS)):
        engine.abort_request(f"r{i}")
    return logits


def _greedy(engine, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(engine.build_request(prompt, params, f"g{i}"))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[f"g{i}"] for i in range(len(prompts))]


def _packed_linears(engine) -> list[PackedLinear]:
    m = engine.model
    return [w for w in (m.lm_head, *(getattr(layer, f) for layer in m.layers for f in ("qkv", "o", "gate_up", "down")))
            if isinstance(w, PackedLinear)]


@pytest.mark.parametrize("qtype", PACKED_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_float32_engine_matches_the_dequantized_one(tmp_path, qtype, arch):
    path = write_gguf(tmp_path / f"{arch}-{qtype.name}.gguf", hf_weights(arch=arch, tied=qtype != T.Q4_K), qtype, arch=arch)
    exact = _engine(path, "float32", "none")
    with cpu_native.enabled(False):  # torch's int4 kernel: it takes float32 activations as they are
        packed = _engine(path, "float32", "int4")
    assert not _packed_linears(exact)
    assert all(isinstance(layer.gate_up, PackedLinear) for layer in packed.model.layers)
    assert isinstance(packed.model.lm_head, PackedLinear)
    # packs on CPUs with bfloat16 (native kernels with int8 activations where they build, else torch's
    # int4 kernel in bfloat16) and where the native kernels build with vector code
    auto = _engine(path, "float32", "auto")
    blocks = cpu_native.fast()
    assert bool(_packed_linears(auto)) == (torch.ops.mkldnn._is_mkldnn_bf16_supported() or blocks)
    assert all((p.blocks is not None) == blocks for p in _packed_linears(auto))
    want = _first_step_logits(exact)
    # Packed codes with float32 activations: the same weights summed in another order.
    for linear in _packed_linears(packed):
        linear.compute_dtype = None
    got = _first_step_logits(packed)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    assert _greedy(packed) == _greedy(exact)
    if _packed_linears(auto):
        # bfloat16 or int8 activations in the GEMMs ("auto" on this CPU): no further from the float32
        # model than a bfloat16 model of the dequantized weights is.
        bf16_err = (_first_step_logits(_engine(path, "bfloat16", "none")) - want).abs().max()
        auto_err = (_first_step_logits(auto) - want).abs().max()
        assert auto_err <= 2 * bf16_err, (auto_err, bf16_err)


def test_int4_mode_keeps_no_dense_copy_and_auto_does(tmp_path):
    path = write_gguf(tmp_path / "q41.gguf", hf_weights(), T.Q4_1)
    auto, int4 = _engine(path, "float32", "auto"), _engine(path, "float32", "int4")
    if auto.model.pack:  # packing pays on this CPU (bfloat16 or a native build): packed, with a dense copy
        assert all(layer.down.dense is not None for layer in auto.model.layers)
    else:  # neither: "auto" keeps the dequantized weights only
        assert all(isinstance(layer.down, torch.Tensor) for layer in auto.model.layers)
    assert all(layer.down.dense is None for layer in int4.model.layers)
    assert int4.model.weight_bytes < auto.model.weight_bytes
    # a prefill of more than DENSE_MIN_ROWS tokens runs on the dense copy in "auto" and on the packed
    # codes in "int4"; both are the same Q4_1 weights
    long_prompt = [[(7 * i) % 250 + 3 for i in range(40)]]
    outs = []
    for engine in (auto, int4):
        engine.add_request(engine.build_request(long_prompt[0], GREEDY, "long"))
        outs.append(engine.runner.forward_logits(engine.scheduler.schedule()))
    scale = outs[0].abs().max().item()
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0.05 * scale)


def test_half_models_keep_a_dense_copy_only_where_torch_multiplies_them_fast(tmp_path):
    """Without a fast bfloat16 GEMM the native blocks prefill faster than a bfloat16 copy (docs/perf/cpu.md)."""
    from ninefold.ops import cpu_upcast

    path = write_gguf(tmp_path / "q41.gguf", hf_weights(), T.Q4_1)
    engine = _engine(path, "bfloat16", "auto")
    if not engine.model.pack:
        pytest.skip("nothing is packed on this CPU")
    slow = (all(p.blocks is not None for p in _packed_linears(engine))
            and not cpu_upcast.native_half_gemm(torch.bfloat16))
    assert all((layer.down.dense is None) == slow for layer in engine.model.layers)


def test_float32_layer_blocks_round_finely_only_beside_a_dense_copy(tmp_path, monkeypatch):
    """Two-term int8 activations cost twice the work: kept for the output layer and for matrices whose packed
    calls are only short prefill chunks (a dense copy takes the long ones); one term where the blocks prefill."""
    import ninefold.llm.models.llama as llama

    if not cpu_native.fast():
        pytest.skip(f"native CPU kernels without vector code here: {cpu_native.slow_reason()}")
    path = write_gguf(tmp_path / "q41.gguf", hf_weights(), T.Q4_1)
    for budget, layer_terms in ((llama.DENSE_COPY_BUDGET, 2), (0, 1)):
        monkeypatch.setattr(llama, "DENSE_COPY_BUDGET", budget)
        model = _engine(path, "float32", "auto").model
        assert model.lm_head.blocks.activation_terms == 2
        assert {getattr(ly, f).blocks.activation_terms for ly in model.layers for f in ("qkv", "o", "gate_up", "down")} \
            == {layer_terms}
        assert all((ly.down.dense is not None) == (layer_terms == 2) for ly in model.layers)


def test_bad_quantization_is_refused(tmp_path):
    path = write_gguf(tmp_path / "q41.gguf", hf_weights(), T.Q4_1)
    with pytest.raises(ValueError, match="quantization: got 'q4'; supported: 'auto', 'int4', 'none'"):
        _engine(path, "float32", "q4")


def test_smollm2_packed_bfloat16_stays_close_to_the_dequantized_model():
    from ninefold.llm import hub

    try:
        path = hub.resolve_model(None)
    except hub.ModelNotAvailable as error:
        pytest.skip(f"SmolLM2 GGUF not cached and not fetchable here: {error}")
    engines = {name: _engine(path, dtype, q, max_model_len=256)
               for name, dtype, q in (("f32", "float32", "none"), ("bf16", "bfloat16", "none"),
                                      ("packed", "bfloat16", "auto"))}
    tok = engines["f32"].tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True)
               for text in ("What is the capital of France?", "Name three colors.", "Write a haiku about rain.")]
    logits = {}
    for name, engine in engines.items():
        for i, prompt in enumerate(prompts):
            engine.add_request(engine.build_request(prompt, GREEDY, f"r{i}"))
        logits[name] = engine.runner.forward_logits(engine.scheduler.schedule())
    err_bf16 = (logits["bf16"] - logits["f32"]).abs()
    err_packed = (logits["packed"] - logits["f32"]).abs()
    # The packed model is about as far from the float32 model as bf16 dequantized weights are.
    assert err_packed.mean() <= 2 * err_bf16.mean(), (err_packed.mean(), err_bf16.mean())
    assert err_packed.max() <= 2 * err_bf16.max() + 0.1, (err_packed.max(), err_bf16.max())
    # Greedy choices: the packed model's pick is the float32 model's, or a near tie in float32 (within
    # the bf16 model's own error), and so is the bf16 model's.
    f32 = logits["f32"]
    for name in ("bf16", "packed"):
        picked = f32.gather(1, logits[name].argmax(-1, keepdim=True))[:, 0]
        assert (picked >= f32.max(-1).values - err_bf16.max()).all(), (name, picked, f32.max(-1).values)
