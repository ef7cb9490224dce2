"""Programmatic dependent launch (PDL) of the attention-side decode kernels: ``rope_and_cache`` and
decode attention's split kernel (``USE_GDC``).

CPU: the sm_90 code waits (``gdc_wait``) before it reads an activation or writes anything and lets
dependents launch first; the switch and its errors. CUDA (sm_90+): a batch-1 chain
GEMV -> rope_and_cache -> attention -> GEMV, and larger ragged batches, give bit-identical results
with PDL and without, eagerly and replayed from a CUDA graph.
"""

import os
import re

import pytest
import torch

triton = pytest.importorskip("triton")

from ninefold.ops import workloads  # noqa: E402
from ninefold.ops.triton import aot, decode, gemv_pdl, rope_cache  # noqa: E402

from .test_attention import paged_cache  # noqa: E402
from .test_rope import cos_sin_cache  # noqa: E402

WAITS = ("grid_dependency_wait", "griddepcontrol.wait")  # Triton 3.9's op, Triton 3.6's inline PTX
TRIGGERS = ("grid_dependency_launch_dependents", "griddepcontrol.launch_dependents")


def _compile_pdl(variant: dict, dtype: torch.dtype):
    """``variant`` (an ``aot_variants`` entry) with ``USE_GDC`` on, compiled for sm_90 with ``launch_pdl``."""
    from triton.compiler import ASTSource

    kernel, consts = variant["kernel"], {**variant["constexprs"], "USE_GDC": True}
    sig = aot.signature(kernel, dtype, consts)
    constexprs = {(i,): consts[n] for i, n in enumerate(kernel.arg_names) if sig[n] == "constexpr"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if sig[n].startswith("*")}
    return triton.compile(ASTSource(kernel, sig, constexprs, attrs), target=aot.parse_target("cuda:90"),
                          options={"num_warps": variant["num_warps"], "num_stages": variant.get("num_stages", 2),
                                   "launch_pdl": True})


def _first(lines, names) -> int:
    return next(i for i, line in enumerate(lines) if any(n in line for n in names))


def _check_waits_first(compiled, early_types: set[str], activation: str):
    """Before the wait: only loads of ``early_types`` elements (host-copied metadata, constant tables),
    no stores or atomics; the trigger comes first; activations (``activation``) are read after it."""
    assert compiled.metadata.launch_pdl
    ttir = compiled.asm["ttir"].splitlines()
    wait = _first(ttir, WAITS)
    assert _first(ttir, TRIGGERS) < wait
    early = [line for line in ttir[:wait] if "tt.load" in line]
    types = {re.search(r"!tt\.ptr<(\w+)>", line).group(1) for line in early}
    assert early and types <= early_types, types
    assert not any(op in line for line in ttir[:wait] for op in ("tt.store", "tt.atomic"))
    assert any("tt.load" in line and f"!tt.ptr<{activation}>" in line for line in ttir[wait:])
    ptx = compiled.asm["ptx"].splitlines()
    wait = _first(ptx, ("griddepcontrol.wait",))
    assert _first(ptx, ("griddepcontrol.launch_dependents",)) < wait
    assert not any(op in line for line in ptx[:wait] for op in ("st.global", "atom.", "red."))


@pytest.mark.skipif(not gemv_pdl.pdl_api(), reason="this Triton has no gdc_wait/launch_pdl")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_sm90_rope_and_cache_reads_positions_and_cos_sin_before_waiting(dtype):
    shapes = workloads.shapes("llama-8b")
    variants = rope_cache.aot_variants("rope_and_cache", dtype, shapes)
    assert {v["constexprs"]["USE_GDC"] for v in variants} == {False}  # builds hold the plain kernels
    for variant in variants:
        _check_waits_first(_compile_pdl(variant, dtype), {"i64", "f32"}, "bf16" if dtype == torch.bfloat16 else "f16")


@pytest.mark.skipif(not gemv_pdl.pdl_api(), reason="this Triton has no gdc_wait/launch_pdl")
def test_sm90_decode_split_kernel_reads_lengths_and_tables_before_waiting():
    # Every specialisation the launcher runs (unsplit, split with and without the in-place merge).
    variants = [v for v in decode.aot_variants("attention_decode", torch.bfloat16, workloads.shapes("llama-8b"))
                if v["kernel"] is decode.decode_split_kernel]
    assert {v["constexprs"]["MERGE"] for v in variants} == {0, 1}
    for variant in variants:
        compiled = _compile_pdl(variant, torch.bfloat16)
        _check_waits_first(compiled, {"i32"}, "bf16")
        if variant["constexprs"]["MERGE"]:  # the arrival counters are touched after the wait only
            assert "atom" in compiled.asm["ptx"]


@pytest.mark.skipif(not gemv_pdl.pdl_api(), reason="this Triton has no gdc_wait/launch_pdl")
def test_sm90_decode_split_kernel_with_early_kv_loads_keys_before_waiting():
    # NINEFOLD_DECODE_EARLY_KV: the first tile's older keys/values are requested before the wait, still no writes.
    variants = [v for v in decode.aot_variants("attention_decode", torch.bfloat16, workloads.shapes("llama-8b"))
                if v["kernel"] is decode.decode_split_kernel]
    for variant in variants:
        compiled = _compile_pdl({**variant, "constexprs": {**variant["constexprs"], "EARLY_KV": True}}, torch.bfloat16)
        ttir = compiled.asm["ttir"].splitlines()
        wait = _first(ttir, WAITS)
        early = [line for line in ttir[:wait] if "tt.load" in line]
        assert sum("!tt.ptr<bf16>" in line for line in early) == 2  # keys and values; q after the wait
        assert not any(op in line for line in ttir[:wait] for op in ("tt.store", "tt.atomic"))


def test_switch_and_errors_on_the_cpu(monkeypatch):
    cpu = torch.device("cpu")
    assert not decode.pdl_wanted(cpu)
    assert decode.check_pdl(False, cpu, "attention_decode") is False
    with pytest.raises(ValueError, match=r"rope_and_cache: pdl=True needs a CUDA device .* got device cpu"):
        decode.check_pdl(True, cpu, "rope_and_cache")
    with pytest.raises(TypeError, match="attention_decode: pdl must be a bool or None, got int"):
        decode.check_pdl(1, cpu, "attention_decode")
    q, k_cache, v_cache, tables = torch.randn(1, 4, 16), *paged_cache([5], 2, 16, 4, torch.float32, "cpu", seed=1)
    with pytest.raises(ValueError, match="attention_decode: pdl=True needs"):
        decode.launch(q, k_cache, v_cache, tables, torch.tensor([5], dtype=torch.int32), None, decode.CONFIG, pdl=True)
    if torch.cuda.is_available():
        dev = torch.device("cuda")
        monkeypatch.setenv("NINEFOLD_GEMV_PDL", "0")
        assert not decode.pdl_wanted(dev)
        monkeypatch.setenv("NINEFOLD_GEMV_PDL", "1")
        monkeypatch.setenv("NINEFOLD_DECODE_PDL", "0")
        assert not decode.pdl_wanted(dev)
        monkeypatch.delenv("NINEFOLD_DECODE_PDL")
        assert decode.pdl_wanted(dev) == gemv_pdl.pdl_available(dev)


pdl_cuda = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
                              or not gemv_pdl.pdl_available(), reason="needs a CUDA GPU with PDL (sm_90+)")


class _Layer:
    """Batch ``B`` decode inputs of one attention layer at Llama-3-8B heads (bf16): ragged contexts,
    this step's token at position ``length - 1`` cached at its slot."""

    def __init__(self, lengths, seed, hq=32, hk=8, d=128, page=16, extra_columns=40):
        dev, dt = "cuda", torch.bfloat16
        g = torch.Generator().manual_seed(seed)
        self.hq, self.hk, self.d = hq, hk, d
        self.k_cache, self.v_cache, tables = paged_cache(lengths, hk, d, page, dt, dev, seed=seed)
        self.tables = torch.cat([tables, tables[:, -1:].expand(-1, extra_columns)], 1).contiguous()
        self.lens = torch.tensor(lengths, dtype=torch.int32, device=dev)
        pos = self.lens.long() - 1
        self.positions = pos
        self.slots = self.tables.gather(1, (pos // page)[:, None])[:, 0].long() * page + pos % page
        self.cos_sin = cos_sin_cache(max(lengths) + 1, d).to(dev)
        width = (hq + 2 * hk) * d
        self.x = torch.randn(len(lengths), 1024, generator=g).to(dev, dt)
        self.w_qkv = (torch.randn(width, 1024, generator=g) / 32).to(dev, dt)
        self.w_o = (torch.randn(1024, hq * d, generator=g) / 64).to(dev, dt)

    def caches(self):
        return self.k_cache.clone(), self.v_cache.clone()

    def step(self, k_cache, v_cache, pdl: bool, config=None, early_kv=False):
        """qkv projection -> rope_and_cache -> decode attention -> o projection (GEMVs at batch 1)."""
        b, hq, hk, d = self.x.shape[0], self.hq, self.hk, self.d
        if b == 1:
            qkv = gemv_pdl.gemv_pdl(self.x[0], self.w_qkv, pdl=pdl, split_k=2)[None]
        else:
            qkv = self.x @ self.w_qkv.T
        q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
        q, k = rope_cache.rope_and_cache(q.view(b, hq, d), k.view(b, hk, d), v.view(b, hk, d), self.positions,
                                         self.cos_sin, k_cache, v_cache, self.slots, True, pdl=pdl)
        o = decode.launch(q, k_cache, v_cache, self.tables, self.lens, None, config or decode.CONFIG, pdl=pdl,
                          early_kv=early_kv)
        if b == 1:
            return q, k, o, gemv_pdl.gemv_pdl(o.reshape(-1), self.w_o, pdl=pdl, split_k=4)[None]
        return q, k, o, o.reshape(b, -1) @ self.w_o.T


REGIMES = {"batch1-long": [4097], "batch1-short": [37], "batch3-ragged-split": [1, 300, 2000],
           "batch200-ragged-unsplit": [int(n) for n in torch.randint(1, 900, (200,),
                                                                     generator=torch.Generator().manual_seed(5))]}


@pdl_cuda
@pytest.mark.parametrize("early_kv", [False, True], ids=["", "early-kv"])
@pytest.mark.parametrize("one_kernel", [1, 0], ids=["one-kernel", "two-kernels"])
@pytest.mark.parametrize("regime", list(REGIMES))
def test_pdl_chain_is_bit_identical_eager_and_in_a_graph_cuda(regime, one_kernel, early_kv):
    layer = _Layer(REGIMES[regime], seed=len(regime))
    config = {**decode.CONFIG, "one_kernel": one_kernel}
    plain_caches, pdl_caches = layer.caches(), layer.caches()
    plain = layer.step(*plain_caches, pdl=False, config=config)
    for _ in range(2):  # a second launch finds the merge counters reset
        eager = layer.step(*pdl_caches, pdl=True, config=config, early_kv=early_kv)
        for a, b in zip(plain, eager):
            assert torch.equal(a, b)
        assert torch.equal(plain_caches[0], pdl_caches[0]) and torch.equal(plain_caches[1], pdl_caches[1])
    graph_caches = layer.caches()
    layer.step(*graph_caches, pdl=True, config=config, early_kv=early_kv)  # compiled before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = layer.step(*graph_caches, pdl=True, config=config, early_kv=early_kv)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(plain, captured):
            assert torch.equal(a, b)
        assert torch.equal(plain_caches[0], graph_caches[0]) and torch.equal(plain_caches[1], graph_caches[1])
    assert int(decode.counters(torch.device("cuda"), 1).abs().sum()) == 0


@pdl_cuda
def test_default_launch_uses_pdl_and_matches_the_reference_cuda():
    # The operator entry points (as the engine calls them) with PDL on by default, against float64.
    from ninefold.ops import references as ref

    from .helpers import assert_close
    from .test_attention import ATTENTION_SCALE

    layer = _Layer([1, 700, 33, 4097], seed=3)
    k_cache, v_cache = layer.caches()
    b = layer.x.shape[0]
    qkv = layer.x @ layer.w_qkv.T
    q, k, v = qkv.split([32 * 128, 8 * 128, 8 * 128], dim=-1)
    q, k, v = q.reshape(b, 32, 128), k.reshape(b, 8, 128), v.reshape(b, 8, 128)
    q_out, k_out = rope_cache.rope_and_cache(q, k, v, layer.positions, layer.cos_sin, k_cache, v_cache, layer.slots,
                                             True)
    q_want, k_want = ref.rope(q, k, layer.positions, layer.cos_sin, True)
    assert_close(q_out, q_want, torch.bfloat16)
    out = decode.attention_decode(q_out, k_cache, v_cache, layer.tables, layer.lens, None)
    assert_close(out, ref.attention_decode(q_out, k_cache, v_cache, layer.tables, layer.lens), torch.bfloat16,
                 scale=ATTENTION_SCALE)
