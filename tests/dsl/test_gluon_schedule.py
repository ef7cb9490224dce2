"""The fa3 schedule: flash-attention-form applications lowered to Gluon (compiled here for sm_90, run on a GPU)."""

import ast

import pytest
import torch

import ninefold.dsl as nd
import ninefold.dsl.language as lang
import ninefold.dsl.language as nl
from ninefold.bench.dsl import _attention_one_loop
from ninefold.dsl import Tensor
from ninefold.dsl.backends import gluon
from ninefold.dsl.backends.gluon_values import Unsupported
from ninefold.dsl.compiler.online_softmax import NotInForm, match
from ninefold.dsl.examples import mm_kernel, softmax_rows_kernel
from ninefold.ops.kernels import attention

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")


def _tensor_names(kernel):
    return [p.name for p in kernel.params if not p.is_scalar]


def test_the_ops_attention_is_in_the_form():
    form = match(attention.kernel.app, _tensor_names(attention.kernel))
    assert (form.query, form.key, form.value, form.out) == ("q", "k", "v", "o")
    assert (form.operand, form.accumulator) == ("q_scaled", "acc")
    assert [ast.unparse(loop.stop) for loop in form.loops] == ["n_full", "n_tiles"]
    assert ast.unparse(form.loops[0].update.scale) == "alpha[:, None]"
    assert ast.unparse(form.result) == "acc / row_sum[:, None]"


def test_one_loop_attention_with_named_tiles_is_in_the_form():
    kernel = nd.make(attention.arrangement, _attention_one_loop, attention.tensors())
    form = match(kernel.app, _tensor_names(kernel))
    assert len(form.loops) == 1 and form.loops[0].scores == "scores"


@pytest.mark.parametrize("make", [mm_kernel, softmax_rows_kernel])
def test_other_kernels_are_not_in_the_form(make):
    kernel = make()
    with pytest.raises(NotInForm):
        match(kernel.app, _tensor_names(kernel))


def _reads_accumulator(q, k, v, scale, is_causal, o):
    acc = nl.zeros((q.shape[-2], q.shape[-1]), dtype=nl.float32)
    qs = q
    row_max = nl.full((q.shape[-2],), float("-inf"), dtype=nl.float32)
    for j in range(k.shape[0]):
        scores = nl.dot(qs, nl.trans(k[j]))
        row_max = nl.maximum(row_max, nl.max(scores, 1) + nl.max(acc, 1))  # reads the accumulator
        acc = acc + nl.dot(nl.exp2(scores - row_max[:, None]).to(qs.dtype), v[j])
    o = acc  # noqa: F841


def _cross_row(q, k, v, scale, is_causal, o):
    acc = nl.zeros((q.shape[-2], q.shape[-1]), dtype=nl.float32)
    qs = q
    total = nl.zeros((q.shape[-2],), dtype=nl.float32)
    for j in range(k.shape[0]):
        scores = nl.dot(qs, nl.trans(k[j]))
        total = total + nl.sum(scores, 1)
        acc = acc + nl.dot(nl.exp2(scores - nl.max(total)).to(qs.dtype), v[j])  # max over every query row
    o = acc  # noqa: F841


def test_a_loop_reading_the_accumulator_is_not_in_the_form():
    kernel = nd.make(attention.arrangement, _reads_accumulator, attention.tensors())
    with pytest.raises(NotInForm, match="accumulator"):
        match(kernel.app, _tensor_names(kernel))


def _inputs(shape, dtype=torch.bfloat16, device="cpu"):
    return tuple(torch.randn(shape, dtype=dtype, device=device) for _ in range(4))


def _generated_source(application, scale=0.125, causal=False, tensors=None):
    """The fa3 module's source for ``application`` on attention's arrangement, compiled for sm_90 at B1 H2 S256 D64."""
    kernel = nd.make(attention.arrangement, application, tensors or attention.tensors())
    q, k, v, o = _inputs((1, 2, 256, 64))
    return gluon.compile_for_target(kernel, (q, k, v, scale, causal, o))[1].source


def test_a_reduction_across_query_rows_is_not_lowered():
    with pytest.raises(Unsupported, match="across query rows"):
        _generated_source(_cross_row, scale=0.1)


@pytest.mark.parametrize("shape,causal", [((2, 4, 512, 128), True), ((1, 2, 256, 64), False)])
def test_attention_compiles_for_sm90(shape, causal):
    q, k, v, o = _inputs(shape)
    compiled, generated = gluon.compile_for_target(attention.kernel, (q, k, v, 0.125, causal, o))
    ptx = compiled.asm["ptx"]
    # per consumer: two products per iteration in the loop and once each outside it, on 64-row wgmma tiles
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx
    assert "setmaxnreg" in ptx  # producer and consumers get their own register budgets
    assert "gl.warp_specialize" in generated.source
    assert ("<= " in generated.source) is causal  # the causal mask is the application's own comparison
    assert generated.block_n == 128 and generated.head_dim == shape[-1]


def test_one_loop_attention_compiles_for_sm90():
    kernel = nd.make(attention.arrangement, _attention_one_loop, attention.tensors())
    q, k, v, o = _inputs((1, 2, 384, 128))
    compiled, generated = gluon.compile_for_target(kernel, (q, k, v, 0.125, True, o))
    assert "nf_end_1" not in generated.source  # one loop: no second range
    assert compiled.asm["ptx"].count("wgmma.mma_async") > 0


def _fixed_shift_attention(q, k, v, scale, is_causal, o):
    """Softmax with a fixed shift instead of the running maximum: the accumulator is never rescaled."""
    qs = (q * (scale * 1.4426950408889634)).to(q.dtype)
    row_sum = nl.zeros((q.shape[-2],), dtype=nl.float32)
    acc = nl.zeros((q.shape[-2], q.shape[-1]), dtype=nl.float32)
    for j in range(k.shape[0]):
        s = nl.dot(qs, nl.trans(k[j]))
        p = nl.exp2(s - 8.0)
        acc += nl.dot(p.to(qs.dtype), v[j])
        row_sum = row_sum + nl.sum(p, 1)
    o = acc / row_sum[:, None]  # noqa: F841


def _scale_on_scores(q, k, v, scale, is_causal, o):
    """Attention as first written: the queries read in the loop, the product scaled there."""
    row_max = nl.full((q.shape[-2],), float("-inf"), dtype=nl.float32)
    row_sum = nl.zeros((q.shape[-2],), dtype=nl.float32)
    acc = nl.zeros((q.shape[-2], q.shape[-1]), dtype=nl.float32)
    for j in range(k.shape[0]):
        scores = nl.dot(q, nl.trans(k[j])) * (scale * 1.4426950408889634)
        new_max = nl.maximum(row_max, nl.max(scores, 1))
        p = nl.exp2(scores - new_max[:, None])
        alpha = nl.exp2(row_max - new_max)
        acc = acc * alpha[:, None] + nl.dot(p.to(v.dtype), v[j])
        row_sum = row_sum * alpha + nl.sum(p, 1)
        row_max = new_max
    o = acc / row_sum[:, None]  # noqa: F841


def test_queries_read_in_the_loop_and_scaled_scores_compile():
    kernel = nd.make(attention.arrangement, _scale_on_scores, attention.tensors())
    form = match(kernel.app, _tensor_names(kernel))
    assert form.operand_is_query and form.query == "q"
    assert ast.unparse(form.loops[0].score_value) == "nf_s * (scale * 1.4426950408889634)"
    q, k, v, o = _inputs((1, 2, 256, 128))
    compiled, generated = gluon.compile_for_target(kernel, (q, k, v, 0.125, False, o))
    assert "q_smem.index(WG).store" not in generated.source.split("nf_a = ")[0]  # the query tile is used as loaded
    assert compiled.asm["ptx"].count("wgmma.mma_async") > 0


def _halving(q, k, v, scale, is_causal, o):
    acc = nl.zeros((q.shape[-2], q.shape[-1]), dtype=nl.float32)
    qs = q
    for j in range(k.shape[0]):
        s = nl.dot(qs, nl.trans(k[j]))
        acc = 0.5 * acc + nl.dot(s.to(qs.dtype), v[j])  # a scalar factor
    o = acc  # noqa: F841


@pytest.mark.parametrize("application,factor", [(_fixed_shift_attention, "none"), (_halving, "scalar")])
def test_accumulator_updates_without_a_row_factor_compile(application, factor):
    kernel = nd.make(attention.arrangement, application, attention.tensors())
    q, k, v, o = _inputs((1, 2, 256, 64))
    compiled, generated = gluon.compile_for_target(kernel, (q, k, v, 0.125, False, o))
    assert ("expand_dims(nf_f" in generated.source) is False
    assert ("nf_f = " in generated.source) is (factor == "scalar")
    assert compiled.asm["ptx"].count("wgmma.mma_async") > 0


def test_tiles_that_overhang_the_sequence_stay_on_triton():
    q, k, v, o = _inputs((1, 2, 200, 64))
    with pytest.raises(Unsupported, match="overhang"):
        gluon.compile_for_target(attention.kernel, (q, k, v, 0.125, True, o))


def test_float32_stays_on_triton():
    q, k, v, o = _inputs((1, 2, 256, 64), dtype=torch.float32)
    with pytest.raises(Unsupported, match="bfloat16, float16"):
        gluon.compile_for_target(attention.kernel, (q, k, v, 0.125, True, o))


def test_no_fa3_candidates_off_sm90():
    q, k, v, o = _inputs((1, 2, 256, 64))
    bound = attention.kernel.bind((q, k, v, 0.125, True, o), {}, backend="cpu")
    assert gluon.configs(attention.kernel, bound) == []
    assert "sm_90" in gluon.reason(attention.kernel, bound)


def test_the_switch_turns_the_schedule_off(monkeypatch):
    monkeypatch.setenv("NINEFOLD_DSL_GLUON", "0")
    q, k, v, o = _inputs((1, 2, 256, 64))
    bound = attention.kernel.bind((q, k, v, 0.125, True, o), {}, backend="cpu")
    assert gluon.reason(attention.kernel, bound) == "NINEFOLD_DSL_GLUON=0"


def _unused_tensor_param():
    def arrangement(x, y):
        return x.tile((16,)), y.tile((16,))

    def application(x, y):
        y = x  # noqa: F841

    return nd.make(arrangement, application, (Tensor(1), Tensor(1)))


def test_kernels_without_loops_are_not_in_the_form():
    kernel = _unused_tensor_param()
    with pytest.raises(NotInForm, match="no loop"):
        match(kernel.app, _tensor_names(kernel))


sm90 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs an sm_90 GPU"
)


def _reference(q, k, v, causal):
    """float64 attention, causal aligned to the bottom right as the kernel (torch's is_causal is top-left)."""
    sq, sk = q.shape[-2], k.shape[-2]
    mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq) if causal else None
    return torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)


@sm90
@pytest.mark.parametrize(
    "shape_q,shape_k,causal,dtype",
    [
        ((2, 4, 1024, 128), (2, 4, 1024, 128), True, torch.bfloat16),
        ((2, 4, 1024, 128), (2, 4, 1024, 128), False, torch.bfloat16),
        ((1, 3, 256, 64), (1, 3, 768, 64), True, torch.float16),  # Sq < Sk: bottom-right causal
        ((3, 2, 384, 64), (3, 2, 384, 64), False, torch.float16),
        ((1, 1, 128, 128), (1, 1, 128, 128), True, torch.bfloat16),
    ],
)
@pytest.mark.parametrize("pingpong,group", [(True, 8), (False, 8), (True, 4), (True, 0)])
def test_cuda_fa3_matches_float64(shape_q, shape_k, causal, dtype, pingpong, group):
    torch.manual_seed(0)
    q = torch.randn(shape_q, dtype=dtype, device="cuda")
    k, v = (torch.randn(shape_k, dtype=dtype, device="cuda") for _ in range(2))
    o = torch.full_like(q, float("nan"))
    bound = attention.kernel.bind((q, k, v, shape_q[-1] ** -0.5, causal, o), {}, backend="triton")
    assert gluon.reason(attention.kernel, bound) is None
    config = {"schedule": "fa3", "meta": {"BLOCK_M": 128, "BLOCK_N": 128}, "num_stages": 2, "pingpong": pingpong,
              "group": group}
    gluon.launch(attention.kernel, bound, config)
    torch.cuda.synchronize()
    want = _reference(q, k, v, causal)
    sq, sk = shape_q[-2], shape_k[-2]
    mask = torch.ones(sq, sk, dtype=torch.bool, device="cuda").tril(sk - sq) if causal else None
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    err, sdpa_err = (o.double() - want).abs().max().item(), (sdpa.double() - want).abs().max().item()
    assert err <= max(2 * sdpa_err, 1e-2), (err, sdpa_err)


@sm90
@pytest.mark.parametrize("variant", ["one_loop", "fixed_shift", "scale_on_scores", "named_factor"])
def test_cuda_fa3_other_applications_match_float64(variant):
    application = {"one_loop": _attention_one_loop, "fixed_shift": _fixed_shift_attention,
                   "scale_on_scores": _scale_on_scores, "named_factor": _named_factor}[variant]
    causal = variant == "one_loop"
    kernel = nd.make(attention.arrangement, application, attention.tensors())
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 512, 128, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    o = torch.full_like(q, float("nan"))
    bound = kernel.bind((q, k, v, 128**-0.5, causal, o), {}, backend="triton")
    assert gluon.reason(kernel, bound) is None
    gluon.launch(kernel, bound, gluon.configs(kernel, bound)[0])
    want = _reference(q, k, v, causal)
    sdpa_err = (torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal).double() - want).abs().max()
    assert (o.double() - want).abs().max().item() <= max(2 * sdpa_err.item(), 1e-2)


@sm90
def test_cuda_the_tuner_offers_and_runs_fa3():
    q, k, v = (torch.randn(2, 8, 2048, 128, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    o = torch.empty_like(q)
    bound = attention.kernel.bind((q, k, v, 128**-0.5, True, o), {}, backend="triton")
    assert len(gluon.configs(attention.kernel, bound)) == 3
    got = attention.scaled_dot_product_attention(q, k, v, is_causal=True)
    got_again = attention.scaled_dot_product_attention(q, k, v, is_causal=True)  # the warm launcher
    want = _reference(q, k, v, True)
    assert (got.double() - want).abs().max().item() < 2e-2
    assert torch.equal(got, got_again)


def _named_factor(q, k, v, scale, is_causal, o):
    """The rescale factor named (as an expansion) before the running maximum moves on."""
    q_scaled = (q * (scale * 1.4426950408889634)).to(q.dtype)
    row_max = nl.full((q.shape[-2],), float("-inf"), dtype=nl.float32)
    row_sum = nl.zeros((q.shape[-2],), dtype=nl.float32)
    acc = nl.zeros((q.shape[-2], q.shape[-1]), dtype=nl.float32)
    for j in range(k.shape[0]):
        scores = nl.dot(q_scaled, nl.trans(k[j]))
        new_max = nl.maximum(row_max, nl.max(scores, 1))
        p = nl.exp2(scores - new_max[:, None])
        correction = nl.exp2(row_max - new_max)[:, None]
        row_sum = row_sum * nl.exp2(row_max - new_max) + nl.sum(p, 1)
        row_max = new_max
        acc = acc * correction + nl.dot(p.to(q_scaled.dtype), v[j])
    o = acc / row_sum[:, None]  # noqa: F841


def test_a_named_expansion_is_read_not_recomputed():
    source = _generated_source(_named_factor)
    assert "nf_f_next = gl.convert_layout(nf_vector_correction" in source
    assert "convert_layout(gl.exp2(row_max - new_max)" not in source


def _name_reuse(q, k, v, scale, is_causal, o):
    t = scale * 1.4426950408889634
    q_scaled = (q * t).to(q.dtype)
    t = k.shape[0]  # the same name, now the tile count
    acc = nl.zeros((q.shape[-2], q.shape[-1]), dtype=nl.float32)
    for j in range(t):
        scores = nl.dot(q_scaled, nl.trans(k[j]))
        acc = acc + nl.dot(nl.exp2(scores - 8.0).to(q_scaled.dtype), v[j])
    o = acc  # noqa: F841


def test_a_prologue_name_reassigned_after_a_tile_statement_reads_it_is_not_reordered():
    with pytest.raises(Unsupported, match="'t'"):  # the loop bound would be the consumer's t: Triton keeps it
        _generated_source(_name_reuse)


def _local_named_wg(q, k, v, scale, is_causal, o):
    WG = q  # noqa: N806
    acc = nl.zeros((q.shape[-2], q.shape[-1]), dtype=nl.float32)
    for j in range(k.shape[0]):
        scores = nl.dot(WG, nl.trans(k[j]))
        acc = acc + nl.dot(nl.exp2(scores - 8.0).to(v.dtype), v[j])
    o = acc  # noqa: F841


def test_names_the_generated_module_binds_are_refused():
    with pytest.raises(Unsupported, match="'WG'"):
        _generated_source(_local_named_wg)


def _swapped(q, v, k, scale, is_causal, o):
    """Keys in the parameter named v, values in the one named k."""
    acc = nl.zeros((q.shape[-2], q.shape[-1]), dtype=nl.float32)
    for j in range(v.shape[0]):
        scores = nl.dot(q, nl.trans(v[j]))
        acc = acc + nl.dot(nl.exp2(scores - 8.0).to(k.dtype), k[j])
    o = acc  # noqa: F841


def _renamed(query, key, value, scale, is_causal, out):
    acc = nl.zeros((query.shape[-2], query.shape[-1]), dtype=nl.float32)
    for j in range(key.shape[0]):
        scores = nl.dot(query, nl.trans(key[j]))
        acc = acc + nl.dot(nl.exp2(scores - 8.0).to(value.dtype), value[j])
    out = acc  # noqa: F841


@pytest.mark.parametrize("application,key", [(_swapped, "v"), (_renamed, "key")])
def test_descriptors_follow_the_roles_not_the_names(application, key):
    def arrangement(a, b, c, scale, is_causal, d, BLOCK_M=attention.BLOCK_M, BLOCK_N=attention.BLOCK_N):
        return attention.arrangement(a, b, c, scale, is_causal, d, BLOCK_M, BLOCK_N)

    kernel = nd.make(arrangement, application, attention.tensors())
    q, k, v, o = _inputs((1, 2, 256, 64))
    compiled, generated = gluon.compile_for_target(kernel, (q, k, v, 0.125, False, o))
    descriptors = {name: payload[0] for name, kind, payload in generated.arguments if kind == "descriptor"}
    assert descriptors["nf_k_desc"] == key
    assert compiled.asm["ptx"].count("wgmma.mma_async") > 0


def _reads_acc_in_product(q, k, v, scale, is_causal, o):
    acc = nl.zeros((q.shape[-2], q.shape[-1]), dtype=nl.float32)
    for j in range(k.shape[0]):
        s = nl.dot(q, nl.trans(k[j]))
        acc += nl.dot((nl.exp2(s * 0.01) * (1.0 + nl.sum(acc, 1))[:, None]).to(q.dtype), v[j])
    o = acc  # noqa: F841


def test_an_update_whose_product_reads_the_accumulator_is_not_in_the_form():
    kernel = nd.make(attention.arrangement, _reads_acc_in_product, attention.tensors())
    with pytest.raises(NotInForm, match="accumulator"):
        match(kernel.app, _tensor_names(kernel))


def test_a_caller_fixed_block_n_of_64_is_lowered():
    q, k, v, o = _inputs((1, 2, 256, 64))
    _, generated = gluon.compile_for_target(attention.kernel, (q, k, v, 0.125, True, o), {"BLOCK_N": 64})
    assert generated.block_n == 64


def _if_in_consumer_prologue(q, k, v, scale, is_causal, o):
    q_scaled = (q * scale).to(q.dtype)
    if is_causal:  # a run-time condition here: both partitions of the prologue keep it
        q_scaled = (q * (scale * 2.0)).to(q.dtype)
    acc = nl.zeros((q.shape[-2], q.shape[-1]), dtype=nl.float32)
    for j in range(k.shape[0]):
        scores = nl.dot(q_scaled, nl.trans(k[j]))
        acc = acc + nl.dot(nl.exp2(scores - 8.0).to(v.dtype), v[j])
    o = acc  # noqa: F841


def test_a_run_time_if_in_the_prologue_is_lowered():
    head = {"constexpr": True, "upper_bound": 256}
    tensors = (*(Tensor(4, shape_options=(None, None, None, head)) for _ in range(3)), Tensor(0), Tensor(0),
               Tensor(4, shape_options=(None, None, None, head)))
    source = _generated_source(_if_in_consumer_prologue, causal=True, tensors=tensors)
    assert "if is_causal:" in source


@sm90
def test_cuda_a_size_fa3_cannot_run_after_one_it_ran_falls_back_to_triton():
    for s in (1024, 1000):  # one tuning bucket; 1000 overhangs the 128-row tiles
        q, k, v = (torch.randn(1, 4, s, 128, dtype=torch.bfloat16, device="cuda") for _ in range(3))
        got = attention.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert (got.double() - _reference(q, k, v, True)).abs().max().item() < 2e-2


def _test_name_reassigned(q, k, v, scale, is_causal, o):
    c = scale
    acc = nl.zeros((q.shape[-2], q.shape[-1]), dtype=nl.float32)
    if c > 0.5:  # run time: the consumers evaluate it with the value c has here
        acc = acc + 1.0
    c = 0.0
    for j in range(k.shape[0]):
        scores = nl.dot(q, nl.trans(k[j]))
        acc = acc + nl.dot(nl.exp2(scores - 8.0 + c).to(v.dtype), v[j])
    o = acc  # noqa: F841


def test_a_name_an_if_test_reads_is_not_reassigned_ahead_of_the_consumers():
    source = _generated_source(_test_name_reassigned, scale=0.75)
    top = source.split("@gluon.jit")[-1]  # the kernel: the program-wide statements
    assert "c = 0.0" not in top  # the reassignment stays in the consumers, after their `if c > 0.5`


def _parameter_reassigned(q, k, v, scale, is_causal, o):
    q_scaled = (q * scale).to(q.dtype)
    scale = scale * 4.0  # a per-warpgroup statement reassigns the parameter
    t = scale + 0.0  # so this may not read the argument where the loop bounds are computed
    acc = nl.zeros((q.shape[-2], q.shape[-1]), dtype=nl.float32)
    for j in range(k.shape[0]):
        scores = nl.dot(q_scaled, nl.trans(k[j]))
        acc = acc + nl.dot(nl.exp2(scores * t - 8.0).to(v.dtype), v[j])
    o = acc  # noqa: F841


def test_a_parameter_reassigned_per_warpgroup_is_not_read_as_the_argument():
    source = _generated_source(_parameter_reassigned)
    top = source.split("@gluon.jit")[-1]
    assert "t = scale + 0.0" not in top  # computed in the consumers, after their `scale = scale * 4.0`


def _local_named_like_a_size(q, k, v, scale, is_causal, o):
    k_size_2 = 1  # noqa: F841  (the generated name of k's sequence length)
    acc = nl.zeros((q.shape[-2], q.shape[-1]), dtype=nl.float32)
    for j in range(k.shape[0]):
        scores = nl.dot(q, nl.trans(k[j]))
        acc = acc + nl.dot(nl.exp2(scores - 8.0).to(v.dtype), v[j])
    o = acc  # noqa: F841


def test_a_local_named_like_a_generated_size_is_refused():
    with pytest.raises(Unsupported, match="k_size_2"):
        _generated_source(_local_named_like_a_size)


def _local_named_nl(q, k, v, scale, is_causal, o):
    nl = q  # a local named like the language module, which the calls reach as ``lang``
    acc = lang.zeros((q.shape[-2], q.shape[-1]), dtype=lang.float32)
    for j in range(k.shape[0]):
        scores = lang.dot(nl, lang.trans(k[j]))
        acc = acc + lang.dot(lang.exp2(scores - 8.0).to(nl.dtype), v[j])
    o = acc  # noqa: F841


def test_an_attribute_of_a_local_named_like_the_language_module_reads_the_local():
    source = _generated_source(_local_named_nl)  # (was refused as language.dtype)
    assert "gl.exp2(scores - 8.0).to(nl.dtype)" in source


def _float32_probabilities(q, k, v, scale, is_causal, o):
    qs = (q * scale).to(q.dtype)
    acc = nl.zeros((q.shape[-2], q.shape[-1]), dtype=nl.float32)
    for j in range(k.shape[0]):
        scores = nl.dot(qs, nl.trans(k[j]))
        acc = acc + nl.dot(nl.exp2(scores - 8.0), v[j])  # a float32 product in the DSL
    o = acc  # noqa: F841


def _float32_operand(q, k, v, scale, is_causal, o):
    qs = q * scale  # the run-time float32 scale promotes the tile
    acc = nl.zeros((q.shape[-2], q.shape[-1]), dtype=nl.float32)
    for j in range(k.shape[0]):
        scores = nl.dot(qs, nl.trans(k[j]))
        acc = acc + nl.dot(nl.exp2(scores - 8.0).to(v.dtype), v[j])
    o = acc  # noqa: F841


def _bfloat16_accumulator(q, k, v, scale, is_causal, o):
    qs = (q * scale).to(q.dtype)
    acc = nl.zeros((q.shape[-2], q.shape[-1]), dtype=nl.bfloat16)
    for j in range(k.shape[0]):
        scores = nl.dot(qs, nl.trans(k[j]))
        acc = acc + nl.dot(nl.exp2(scores - 8.0).to(v.dtype), v[j])
    o = acc  # noqa: F841


@pytest.mark.parametrize("application,message", [(_float32_probabilities, "probabilities of dtype float32"),
                                                 (_bfloat16_accumulator, "accumulator 'acc' of dtype bfloat16")])
def test_dtype_mixes_the_products_cannot_take_stay_on_triton(application, message):
    with pytest.raises(Unsupported, match=message):
        _generated_source(application)


def test_a_dtype_the_translator_cannot_tell_is_checked_by_the_compiler():
    from triton.compiler.errors import CompilationError

    kernel = nd.make(attention.arrangement, _float32_operand, attention.tensors())
    q, k, v, o = _inputs((1, 2, 256, 64))
    with pytest.raises(CompilationError) as raised:  # q * (run-time scale) promotes: the static check fails
        gluon.compile_for_target(kernel, (q, k, v, 0.125, False, o))
    chain, error = [], raised.value
    while error is not None:
        chain.append(error)
        error = error.__cause__ or error.__context__
    assert any(type(e).__name__ == "CompileTimeAssertionFailure" and "the operand qs must be bfloat16" in str(e)
               for e in chain), [str(e)[-200:] for e in chain]


def _masked_probabilities(q, k, v, scale, is_causal, o):
    """The converted probabilities masked with where (valid: where's condition does not promote)."""
    qs = (q * scale).to(q.dtype)
    acc = nl.zeros((q.shape[-2], q.shape[-1]), dtype=nl.float32)
    for j in range(k.shape[0]):
        scores = nl.dot(qs, nl.trans(k[j]))
        keep = k[j].offsets(-2)[None, :] < k.source.shape[-2]
        acc = acc + nl.dot(nl.where(keep, nl.exp2(scores * -1.0 - 8.0).to(qs.dtype), 0.0), v[j])
    o = acc  # noqa: F841


def test_where_masked_probabilities_and_negative_constants_are_lowered():
    kernel = nd.make(attention.arrangement, _masked_probabilities, attention.tensors())
    q, k, v, o = _inputs((1, 2, 256, 64))
    compiled, _ = gluon.compile_for_target(kernel, (q, k, v, 0.125, False, o))
    assert compiled.asm["ptx"].count("wgmma.mma_async") > 0
