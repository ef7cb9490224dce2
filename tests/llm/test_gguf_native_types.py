"""Every quantized GGUF type on the native CPU kernels' blocks (``gguf_packed.native_matrix``).

What is asserted and why:
* the conversions that can be exact are (Q8_0, Q5_0, Q4_0, IQ4_NL as 8-bit codes; Q4_0/Q4_1 as 4-bit; Q5_0/Q5_1
  and 4-bit parts as 5-bit), bit for bit;
* Q4_K's and Q5_K's per-block products ``d * sc`` and ``dmin * m`` (IQ4_XS's ``d * (ls - 32)``), rounded to float16, move
  no weight by more than 2^-11 of its block's scale and offset;
* requantized types (Q5_1, Q2_K..Q6_K, the lattice IQ types, TQ2_0, MXFP4; 4-bit parts stacked with 8-bit ones)
  move no weight by more than half an 8-bit step of its block, which is at most a quarter of a Q6_K step;
* IQ4_NL/IQ4_XS rows stay 4-bit codes of the IQ4 levels, and a model of them decodes natively on those;
* a model mixed like llama.cpp's Q4_K_M (Q4_K beside Q6_K, Q5_0 and Q8_0) runs its decode step natively,
  and its logits stay as close to the dequantized float32 model as a bfloat16 model of the same weights does.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from ninefold import ops
from ninefold.llm import gguf_packed
from ninefold.llm.engine import LLMEngine
from ninefold.llm.gguf_dequant import IQ4_VALUES, int4_codes, q8_0_codes
from ninefold.llm.gguf_packed import (
    GGUFRows,
    Int4Codes,
    Int5Codes,
    LevelCodes,
    PackedLinear,
    Q8Codes,
    QuantizedEmbedding,
    native_matrix,
    requantize_q8,
)
from ninefold.llm.models import llama, llama_cpu
from ninefold.llm.sampling import SamplingParams
from ninefold.ops import cpu_native

from .test_gguf import LATTICE_TYPES, hf_weights, quantize, write_gguf

N, K = 48, 512


def _weights(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((N, K)).astype(np.float32)
    w[3, :64] += 4.0  # blocks far from zero-centred: offsets matter
    w[5, 32:64] = 0.0  # an all-zero block
    return w


def _kept(qtype: T, w: np.ndarray) -> Int4Codes | Q8Codes | GGUFRows:
    """What ``load_gguf(keep_quantized=True)`` returns for ``w`` stored as ``qtype``."""
    raw = torch.from_numpy(np.ascontiguousarray(quantize(w, qtype)).view(np.uint8).reshape(w.shape[0], -1).copy())
    if qtype in (T.Q4_0, T.Q4_1, T.Q4_K):
        return Int4Codes(*int4_codes(raw.reshape(-1), int(qtype), w.shape), qtype.name)
    if qtype == T.Q8_0:
        return Q8Codes(*q8_0_codes(raw.reshape(-1), w.shape))
    return GGUFRows(raw, int(qtype), w.shape[1])


def _block_bound(exact: torch.Tensor) -> torch.Tensor:
    """Half an 8-bit step (``max|w| / 127`` of its block, float16-rounded) of every weight, ``[N, K]``."""
    n, k = exact.shape
    step = exact.abs().reshape(n, k // 32, 32).amax(-1) / 127 * (1 + 2.0**-10)
    return (step / 2).repeat_interleave(32, dim=1) + 1e-12


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q5_0, T.Q4_0, T.IQ4_NL], ids=lambda t: t.name)
def test_exact_8_bit_forms(qtype):
    kept = _kept(qtype, _weights())
    q8 = kept.to_q8()
    assert q8.codes.dtype == torch.int8 and int(q8.codes.abs().max()) <= 127
    torch.testing.assert_close(q8.dequantize(), kept.dequantize(), rtol=0, atol=0)
    assert ops.BlockWeight.fits(q8.scales)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1], ids=lambda t: t.name)
def test_legacy_4_bit_stays_4_bit_and_exact(qtype):
    kept = _kept(qtype, _weights())
    whole = native_matrix([kept, kept])
    assert isinstance(whole, Int4Codes) and whole.shape == (2 * N, K)
    torch.testing.assert_close(whole.dequantize(), torch.cat([kept.dequantize()] * 2), rtol=0, atol=0)


def test_q4_k_scales_rounded_to_float16_within_their_precision():
    kept = _kept(T.Q4_K, _weights())
    assert not ops.BlockWeight.fits(kept.scales, kept.offsets)  # products of d and 6-bit sc: not float16 values
    whole = native_matrix([kept])
    assert isinstance(whole, Int4Codes) and ops.BlockWeight.fits(whole.scales, whole.offsets)
    bound = (kept.scales.abs() * 15 + kept.offsets.abs()) * 2.0**-11
    err = (whole.dequantize() - kept.dequantize()).abs().reshape(N, K // 32, 32).amax(-1)
    assert (err <= bound + 1e-12).all()
    assert err.max() > 0  # the rounding is real, not skipped


def test_iq4_xs_scales_rounded_to_float16_within_their_precision():
    kept = _kept(T.IQ4_XS, _weights())
    exact = kept.dequantize()
    q8 = kept.to_q8()
    assert q8.codes.dtype == torch.int8 and ops.BlockWeight.fits(q8.scales)
    assert set(q8.codes.unique().tolist()) <= {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113}
    err = (q8.dequantize() - exact).abs().reshape(N, K // 32, 32).amax(-1)
    assert (err <= exact.abs().reshape(N, K // 32, 32).amax(-1) * 2.0**-11 + 1e-12).all()
    assert err.max() > 0  # d * (ls - 32) is not always a float16 value: the rounding is real


@pytest.mark.parametrize("qtype", [T.Q5_1, T.Q2_K, T.Q3_K, T.Q5_K, T.Q6_K, T.TQ2_0, T.MXFP4, *LATTICE_TYPES],
                         ids=lambda t: t.name)
def test_requantized_types_within_half_an_8_bit_step(qtype):
    kept = _kept(qtype, _weights())
    exact = kept.dequantize()
    q8 = kept.to_q8()
    err = (q8.dequantize() - exact).abs()
    assert (err <= _block_bound(exact)).all()
    if qtype not in LATTICE_TYPES:  # random lattice blocks (no encoder here) have no zero block
        assert torch.equal(q8.dequantize()[5, 32:64], torch.zeros(32))  # the zero block stays zero, no NaN
    if qtype == T.Q6_K:  # a quarter of Q6_K's own step: max|w| / 127 / 2 against d * max(sc) (~max|w| / 32)
        assert (err.reshape(N, K // 32, 32).amax(-1) <= exact.abs().reshape(N, K // 32, 32).amax(-1) / 250).all()


def test_4_bit_parts_over_8_bit_ones_stay_4_bit_in_row_order():
    w = _weights()
    parts = [_kept(T.Q4_K, w[:16]), _kept(T.Q4_K, w[16:32]), _kept(T.Q6_K, w[32:])]
    head, tail = native_matrix(parts)
    assert isinstance(head, Int4Codes) and head.shape == (32, K) and isinstance(tail, Q8Codes) and tail.shape == (16, K)
    torch.testing.assert_close(head.dequantize(), native_matrix(parts[:2]).dequantize(), rtol=0, atol=0)
    exact = parts[2].dequantize()
    assert ((tail.dequantize() - exact).abs() <= _block_bound(exact)).all()


def test_other_mixes_become_8_bit_in_row_order():
    w = _weights()
    for parts in ([_kept(T.Q6_K, w[:16]), _kept(T.Q4_K, w[16:])],  # 8-bit first
                  [_kept(T.Q4_K, w[:8]), _kept(T.Q6_K, w[8:])]):  # a 4-bit head of 8 rows: not whole 16-row groups
        whole = native_matrix(parts)
        assert isinstance(whole, Q8Codes) and whole.shape == (N, K)
        exact = torch.cat([p.dequantize() for p in parts])
        assert ((whole.dequantize() - exact).abs() <= _block_bound(exact)).all()


def test_requantize_q8_natively_is_the_torch_result():
    w = torch.from_numpy(_weights()) * torch.linspace(0.001, 3, K)  # scales of many sizes
    scale = (w[7, 96:128].abs().max() / 127).half().float()
    w[7, 100], w[7, 101] = 2.5 * scale, -3.5 * scale  # half way between two codes: rounded to even (2, -4)
    native = requantize_q8(w)
    assert native.codes[7, 100] == 2 and native.codes[7, 101] == -4
    with cpu_native.enabled(False):
        plain = requantize_q8(w)
    assert torch.equal(native.codes, plain.codes) and torch.equal(native.scales, plain.scales)


def test_q6_k_requantized_block_by_block_is_the_torch_result():
    kept = _kept(T.Q6_K, _weights() * np.linspace(0.001, 3, K, dtype=np.float32))
    native = kept.to_q8()
    with cpu_native.enabled(False):
        plain = kept.to_q8()
    assert torch.equal(native.codes, plain.codes) and torch.equal(native.scales, plain.scales)


def test_requantize_q8_refuses_scales_beyond_float16():
    with pytest.raises(ValueError, match="Q6_K matrix has block scales beyond float16's range"):
        requantize_q8(torch.full((1, 32), 1e7), "Q6_K")


@pytest.mark.parametrize("qtype", [T.Q5_0, T.Q5_1], ids=lambda t: t.name)
def test_legacy_5_bit_stays_5_bit_and_exact(qtype):
    kept = _kept(qtype, _weights())
    whole = native_matrix([kept, kept])
    assert isinstance(whole, Int5Codes) and whole.codes.shape == (2 * N, K) and int(whole.codes.max()) <= 31
    torch.testing.assert_close(_affine_values(whole), torch.cat([kept.dequantize()] * 2), rtol=0, atol=0)


def _affine_values(whole) -> torch.Tensor:
    n, k = whole.codes.shape
    return (whole.codes.float().reshape(n, k // 32, 32) * whole.scales[..., None]
            + whole.offsets[..., None]).reshape(n, k)


def test_q5_k_and_4_bit_parts_become_5_bit_within_float16_rounding():
    w = _weights()
    parts = [_kept(T.Q4_K, w[:16]), _kept(T.Q5_K, w[16:]), _kept(T.Q4_0, w[:16])]
    whole = native_matrix(parts)
    assert isinstance(whole, Int5Codes) and ops.BlockWeight.fits(whole.scales, whole.offsets)
    exact = torch.cat([p.dequantize() for p in parts])
    err = (_affine_values(whole) - exact).abs().reshape(-1, K // 32, 32).amax(-1)
    bound = (whole.scales.abs() * 31 + whole.offsets.abs()) * 2.0**-11
    assert (err <= bound + 1e-12).all() and err.max() > 0
    torch.testing.assert_close(_affine_values(whole)[-16:], parts[2].dequantize(), rtol=0, atol=0)  # Q4_0: exact


def test_5_bit_parts_over_8_bit_ones_stay_5_bit_in_row_order():
    w = _weights()
    parts = [_kept(T.Q5_0, w[:16]), _kept(T.Q4_K, w[16:32]), _kept(T.Q6_K, w[32:])]
    head, tail = native_matrix(parts)
    assert isinstance(head, Int5Codes) and head.codes.shape == (32, K) and isinstance(tail, Q8Codes)
    weight = gguf_packed._block_weight((head, tail), 1)
    assert (weight.bits, weight.lead, weight.lead_bits) == (8, 32, 5)
    torch.testing.assert_close(weight.dequantize()[:32], _affine_values(head), rtol=0, atol=0)
    torch.testing.assert_close(weight.dequantize()[32:], tail.dequantize(), rtol=0, atol=0)


def test_iq4_parts_stay_4_bit_levels_in_row_order():
    w = _weights()
    parts = [_kept(T.IQ4_NL, w[:16]), _kept(T.IQ4_XS, w[16:])]
    whole = native_matrix(parts)
    assert isinstance(whole, LevelCodes) and whole.codes.shape == (N, K) and int(whole.codes.max()) <= 15
    values = (IQ4_VALUES[whole.codes.long()].float().reshape(N, K // 32, 32) * whole.scales[..., None]).reshape(N, K)
    torch.testing.assert_close(values, torch.cat([p.to_q8().dequantize() for p in parts]), rtol=0, atol=0)
    # with an 8-bit part beside them, every row is 8-bit: the IQ4 rows as their levels, exactly as above
    mixed = native_matrix([*parts, _kept(T.Q8_0, w[:16])])
    assert isinstance(mixed, Q8Codes)
    torch.testing.assert_close(mixed.dequantize()[:N], values, rtol=0, atol=0)


def test_gguf_rows_keep_the_row_permutation():
    w = _weights()
    kept = _kept(T.Q6_K, w)
    order = torch.randperm(N, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(kept.map_rows(lambda t: t[order]).dequantize(), kept.dequantize()[order], rtol=0, atol=0)


# -- a Q4_K_M-like model --------------------------------------------------------------------------------------

def _q4_k_m(name: str) -> T:
    """llama.cpp's Q4_K_M mix: Q4_K, Q6_K for v and down, Q5_0 for o (its fallback type), Q8_0 embeddings."""
    if "v_proj" in name or "down_proj" in name:
        return T.Q6_K
    if "o_proj" in name:
        return T.Q5_0
    if "embed" in name or "lm_head" in name:
        return T.Q8_0
    return T.Q4_K


def _engine(path, dtype, quantization, device="cpu"):
    return LLMEngine(str(path), dtype=dtype, device=device, block_size=4, num_kv_blocks=64,
                     enable_prefix_caching=False, quantization=quantization)


def _decode_shaped_logits(engine) -> torch.Tensor:
    """Logits of one step of three one-token prompts: a decode-shaped step (the native decode step on the CPU)."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for i, token in enumerate((5, 77, 130)):
        engine.add_request(engine.build_request([token], params, f"r{i}"))
    logits = engine.runner.forward_logits(engine.scheduler.schedule())
    for i in range(3):
        engine.abort_request(f"r{i}")
    return logits


def test_q4_k_m_mix_runs_natively_and_close_to_the_float_model(tmp_path):
    path = write_gguf(tmp_path / "q4_k_m.gguf", hf_weights(arch="llama", tied=True), _q4_k_m, arch="llama")
    exact = _engine(path, "float32", "none")
    want = _decode_shaped_logits(exact)
    with cpu_native.enabled(False):  # no native kernels: the mixed matrices are dequantized exactly
        plain = _engine(path, "float32", "auto")
    for layer in plain.model.layers:
        assert isinstance(layer.qkv, torch.Tensor) and isinstance(layer.down, torch.Tensor)
    if not plain.model.pack:  # (on a CPU with bfloat16, the all-Q4_K gate_up runs on torch's int4 kernel in bf16)
        torch.testing.assert_close(_decode_shaped_logits(plain), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    if not cpu_native.fast():
        pytest.skip(f"native CPU kernels without vector code here: {cpu_native.slow_reason()}")
    auto = _engine(path, "float32", "auto")
    m = auto.model
    bits = {f: {(getattr(layer, f).blocks.bits, getattr(layer, f).blocks.lead) for layer in m.layers}
            for f in ("qkv", "o", "gate_up", "down")}
    # q and k (Q4_K) stay 4-bit over v's 8-bit rows (Q6_K); o is Q5_0, 5-bit exactly
    assert bits == {"qkv": {(8, m.q_size + m.kv_size)}, "o": {(5, 0)}, "gate_up": {(4, 0)}, "down": {(8, 0)}}
    assert isinstance(m.lm_head, PackedLinear) and m.lm_head.blocks.bits == 8
    assert llama_cpu.NativeDecoder.why_not(m) is None
    bf16_err = (_decode_shaped_logits(_engine(path, "bfloat16", "none")) - want).abs().max()
    auto_err = (_decode_shaped_logits(auto) - want).abs().max()
    assert auto_err <= 2 * bf16_err, (auto_err, bf16_err)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mix", ["q4_k_m", "iq4_xs"])
def test_quantized_mixes_on_cuda_are_the_dequantized_model(tmp_path, mix):
    """On a GPU every GGUF matrix is dequantized (GGUFRows included): the CPU's exact float32 logits."""
    types = {"q4_k_m": _q4_k_m, "iq4_xs": _iq4_xs}[mix]
    path = write_gguf(tmp_path / f"{mix}.gguf", hf_weights(arch="llama", tied=True), types, arch="llama")
    want = _decode_shaped_logits(_engine(path, "float32", "none"))
    cuda = _engine(path, "float32", "auto", device="cuda")
    assert not any(isinstance(getattr(layer, f), PackedLinear) for layer in cuda.model.layers
                   for f in ("qkv", "o", "gate_up", "down"))
    got = _decode_shaped_logits(cuda).float().cpu()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-3 * want.abs().max().item())


def test_a_tied_quantized_embedding_is_decoded_once(tmp_path, monkeypatch):
    """The embedding table and the output layer of a tied Q6_K embedding share one decode of its blocks."""
    import ninefold.llm.gguf_packed as gguf_packed

    path = write_gguf(tmp_path / "q6k.gguf", hf_weights(arch="llama", tied=True), T.Q6_K, arch="llama")
    decoded = []
    real = gguf_packed.dequantize

    def counting(raw, ggml_type, shape, dtype=torch.float32):
        decoded.append(tuple(shape))
        return real(raw, ggml_type, shape, dtype)

    monkeypatch.setattr(gguf_packed, "dequantize", counting)
    engine = _engine(path, "float32", "auto")
    vocab, hidden = engine.model.embed.shape
    assert decoded.count((vocab, hidden)) == 1
    exact = _engine(path, "float32", "none")
    assert torch.equal(engine.model.embed, exact.model.embed)


@pytest.mark.parametrize("tied,qtype", [(True, T.Q6_K), (False, T.Q8_0), (True, T.Q4_K)],
                         ids=["tied-Q6_K", "untied-Q8_0", "tied-Q4_K"])
def test_a_quantized_embedding_table_stays_quantized_without_dense_copies(tmp_path, monkeypatch, tied, qtype):
    """Models packed without dense copies keep the embedding table in its GGUF form and decode only the looked-up
    rows: the same values as the float table, so the same logits and tokens."""
    monkeypatch.setattr(llama, "DENSE_COPY_BUDGET", 0)  # the tiny model as a large one: no dense copies
    types = {"embed": qtype, "lm_head": qtype}
    path = write_gguf(tmp_path / f"{qtype.name}.gguf", hf_weights(arch="llama", tied=tied),
                      lambda name: next((t for key, t in types.items() if key in name), T.Q4_K), arch="llama")
    kept = _engine(path, "float32", "auto")
    monkeypatch.setattr(llama, "KEEP_TABLES_QUANTIZED", False)
    dense = _engine(path, "float32", "auto")
    assert isinstance(kept.model.embed, QuantizedEmbedding) and isinstance(dense.model.embed, torch.Tensor)
    assert kept.model.weight_bytes < dense.model.weight_bytes
    ids = torch.tensor([[0, 5, 77], [130, 255, 5]])
    assert torch.equal(kept.model.embed(ids), dense.model.embed[ids])
    if cpu_native.fast():
        assert llama_cpu.NativeDecoder.why_not(kept.model) is None
    assert torch.equal(_decode_shaped_logits(kept), _decode_shaped_logits(dense))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 77, 130, 9, 41], [200, 3, 3, 17, 88, 61, 150, 12, 99, 7, 7, 7, 1, 2, 3, 4, 5, 6, 8]]
    assert _greedy(kept, prompts, params) == _greedy(dense, prompts, params)


def _greedy(engine, prompts: list[list[int]], params: SamplingParams) -> dict[str, list[int]]:
    """The token ids each prompt generates on ``engine`` (all prompts batched)."""
    for i, prompt in enumerate(prompts):
        engine.add_request(engine.build_request(prompt, params, f"g{i}"))
    done = {}
    while engine.has_unfinished_requests():
        done.update({out.request_id: list(out.outputs[0].token_ids) for out in engine.step() if out.finished})
    return done


def _q5_k_m(name: str) -> T:
    """llama.cpp's Q5_K_M mix: Q5_K, Q6_K for v and down and the embeddings."""
    return T.Q6_K if any(part in name for part in ("v_proj", "down_proj", "embed", "lm_head")) else T.Q5_K


def _native_engine(path):
    """The float32 engine of ``path`` on the native kernels, whose decode step runs natively (skips without them)."""
    if not cpu_native.fast():
        pytest.skip(f"native CPU kernels without vector code here: {cpu_native.slow_reason()}")
    engine = _engine(path, "float32", "auto")
    assert llama_cpu.NativeDecoder.why_not(engine.model) is None
    return engine


def _logit_errors(path, engine) -> tuple[torch.Tensor, torch.Tensor]:
    """How far ``engine``'s and the bfloat16 model's decode-step logits are from the float32 model's (max abs)."""
    want = _decode_shaped_logits(_engine(path, "float32", "none"))
    bf16_err = (_decode_shaped_logits(_engine(path, "bfloat16", "none")) - want).abs().max()
    return (_decode_shaped_logits(engine) - want).abs().max(), bf16_err


def test_q5_k_m_mix_runs_natively_on_5_bit_blocks(tmp_path):
    path = write_gguf(tmp_path / "q5_k_m.gguf", hf_weights(arch="llama", tied=True), _q5_k_m, arch="llama")
    auto = _native_engine(path)
    m = auto.model
    kinds = {f: {(getattr(ly, f).blocks.bits, getattr(ly, f).blocks.lead, getattr(ly, f).blocks.lead_bits)
                 for ly in m.layers} for f in ("qkv", "o", "gate_up", "down")}
    # q and k (Q5_K) stay 5-bit over v's 8-bit rows (Q6_K)
    assert kinds == {"qkv": {(8, m.q_size + m.kv_size, 5)}, "o": {(5, 0, 4)}, "gate_up": {(5, 0, 4)},
                     "down": {(8, 0, 4)}}
    auto_err, bf16_err = _logit_errors(path, auto)
    # on this random model the int8 activations and the 8-bit Q6_K rows part the logits 2.1x as far as bf16 weights
    # do (with every Q5_K row requantized to 8 bits as well, before 5-bit blocks: 2.5x)
    assert auto_err <= 3 * bf16_err


def _iq4_xs(name: str) -> T:
    """llama.cpp's IQ4_XS mix on a model whose rows are multiples of 256, with IQ4_NL (its fallback) for o."""
    return T.IQ4_NL if "o_proj" in name else T.IQ4_XS


def test_iq4_models_run_natively_on_4_bit_levels(tmp_path):
    path = write_gguf(tmp_path / "iq4_xs.gguf", hf_weights(arch="llama", tied=False), _iq4_xs, arch="llama")
    auto = _native_engine(path)
    m = auto.model
    blocks = [getattr(ly, f).blocks for ly in m.layers for f in ("qkv", "o", "gate_up", "down")] + [m.lm_head.blocks]
    assert all(b.bits == 4 and b.levels is not None for b in blocks)
    auto_err, bf16_err = _logit_errors(path, auto)
    # the weights are IQ4's (float16-rounded IQ4_XS scales aside): only the int8 activations differ from the float model
    assert auto_err <= 2 * bf16_err


@pytest.mark.parametrize("qtype", [T.Q2_K, T.Q3_K, T.IQ3_S, T.IQ2_XXS], ids=lambda t: t.name)
def test_2_and_3_bit_models_run_natively_as_8_bit_blocks(tmp_path, qtype):
    path = write_gguf(tmp_path / f"{qtype.name}.gguf", hf_weights(arch="llama", tied=True), qtype, arch="llama")
    auto = _native_engine(path)
    m = auto.model
    assert {getattr(ly, f).blocks.bits for ly in m.layers for f in ("qkv", "o", "gate_up", "down")} == {8}
    auto_err, bf16_err = _logit_errors(path, auto)
    # the 8-bit requantization moves these weights by 0.5% (RMS, as for Q6_K), the bf16 model's by 0.4%; on this
    # random 2-bit model the logits then part 2.4x as far as the bf16 model's (Q3_K: within 2x)
    assert auto_err <= 3 * bf16_err


@pytest.mark.skipif(not cpu_native.fast(), reason="packed_linear builds BlockWeights only with the vector kernels")
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.IQ4_XS, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
def test_parts_of_one_type_are_packed_alone_and_joined_byte_for_byte(qtype):
    """q/k/v (or gate/up) of one type: each part packed alone and the records joined are the bytes of the stacked
    matrix packed whole; rows that do not fill 16-row groups are stacked first, as before."""
    parts = [_kept(qtype, _weights(seed)) for seed in range(3)]  # 48 rows each
    joined = gguf_packed.packed_linear(parts, torch.device("cpu"), torch.float32, keep_dense=False).blocks
    whole = gguf_packed._block_weight(native_matrix(parts), 2)
    assert joined.shape == whole.shape == (3 * N, K) and joined.bits == whole.bits
    assert torch.equal(joined.data, whole.data)
    assert (joined.levels is None) == (whole.levels is None)
    x = torch.randn(5, K)
    torch.testing.assert_close(ops.linear_blocks(x, joined), ops.linear_blocks(x, whole), rtol=0, atol=0)
    ragged = [_kept(qtype, _weights()[:40]), _kept(qtype, _weights(1))]  # 40 rows: not whole groups
    assert gguf_packed._blocks_by_part(ragged, 2) is None
    with pytest.raises(ValueError, match="BlockWeight.joined: expected plain weights"):
        ops.BlockWeight.joined([gguf_packed._block_weight(native_matrix([p]), 2) for p in ragged])
