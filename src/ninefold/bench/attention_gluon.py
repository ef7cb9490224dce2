"""Causal attention written in Gluon with FlashAttention-3's schedule on Hopper (GPU experiment).

    OUT=DIR python -m ninefold.bench.attention_gluon     # one sm_90 CUDA device, ~1 min
    python -m ninefold.bench.attention_gluon --compile-only   # no GPU: compiles every configuration for sm_90

Question (issue 3, causal attention against cuDNN): Triton's compiler does not express what FlashAttention-3
and cuDNN do on Hopper (sessions 4-24, docs/perf/dsl.md). Does Gluon, Triton's lower-level language with explicit
layouts, warp partitions and mbarriers, reach cuDNN when it does express it? Each program owns 128 query rows of
one head and runs three partitions:
- a one-warp producer that loads the two 64-row query tiles once and then every key and value tile of the
  program's causal range through TMA into a ring of ``STAGES`` shared-memory slots;
- two consumer warpgroups of 64 query rows each. A consumer issues S = Q K_j^T, then O += P_(j-1) V_(j-1) from
  registers, both asynchronously, and computes the softmax of S while the second product runs (intra-warpgroup
  overlap); with ``PINGPONG`` the two consumers take turns issuing their products (two mbarriers pass the turn), so
  one's softmax overlaps the other's tensor-core work.
The producer gets 24 registers per thread, the consumers 240. Programs take the longest query tiles first. Every
output is checked against float64 attention on one head and against torch's SDPA before it is timed
(``do_bench`` median). A diagnostic, not a benchmark with targets; results in docs/perf/dsl.md.
"""
import math
import sys
import time

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ninefold.bench.attention_exp2 import causal_head_float64
from ninefold.bench.results import write_json

WG_ROWS = 64  # query rows per consumer warpgroup (one wgmma M tile)
# Triton 3.9 renamed the TMA copies (3.6: async_copy_global_to_shared, async_copy_shared_to_global)
_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
_tma_store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global


@gluon.constexpr_function
def _mma_layout(n):
    """The accumulator layout of one warpgroup's wgmma with N = ``n``."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, int(n), 16])


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, start, n_blocks, base,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    q_ready, k_ready, v_ready, k_empty, v_empty, turn = bars
    for w in gl.static_range(2):
        mbarrier.expect(q_ready.index(w), q_desc.block_type.nbytes)
        _tma_load(q_desc, [base + start + w * q_desc.block_type.shape[0], 0],
                                        q_ready.index(w), q_smem.index(w))
    for j in range(n_blocks):
        s = j % STAGES
        phase = (j // STAGES) & 1
        mbarrier.wait(k_empty.index(s), phase ^ 1)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        _tma_load(k_desc, [base + j * BLOCK_N, 0], k_ready.index(s), k_smem.index(s))
        mbarrier.wait(v_empty.index(s), phase ^ 1)
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        _tma_load(v_desc, [base + j * BLOCK_N, 0], v_ready.index(s), v_smem.index(s))


@gluon.jit
def _scores(s, m_i, scale_log2, row, j, MASKED: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """(p, new row maxima, rescale factor) of one score tile in the exp2 domain (maxima already scaled)."""
    if MASKED:
        col = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s = gl.where(gl.expand_dims(col, 0) <= gl.expand_dims(row, 1), s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * scale_log2)
    p = gl.exp2(s * scale_log2 - gl.expand_dims(m_new, 1))
    alpha = gl.exp2(m_i - m_new)
    return p, m_new, alpha


@gluon.jit
def _consumer(o_desc, q_smem, k_smem, v_smem, bars, start, n_blocks, base, scale_log2,
              WG: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
              PINGPONG: gl.constexpr):
    q_ready, k_ready, v_ready, k_empty, v_empty, turn = bars
    ROWS: gl.constexpr = q_smem.type.shape[1]
    s_layout: gl.constexpr = _mma_layout(BLOCK_N)
    o_layout: gl.constexpr = _mma_layout(HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    row = start + WG * ROWS + gl.arange(0, ROWS, layout=row_layout)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.zeros([ROWS], gl.float32, layout=row_layout)
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
    q = q_smem.index(WG)
    mbarrier.wait(q_ready.index(WG), 0)

    # first key tile: its scores only
    mbarrier.wait(k_ready.index(0), 0)
    if PINGPONG:
        mbarrier.wait(turn.index(WG), WG ^ 1)
    s = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout),
                      use_acc=False, is_async=True)
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - WG), count=1)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    mbarrier.arrive(k_empty.index(0), count=1)
    first_masked = start // BLOCK_N  # key tiles from here on reach past the program's first query row
    if first_masked == 0:
        p, m_i, alpha = _scores(s, m_i, scale_log2, row, 0, True, BLOCK_N, s_layout)
    else:
        p, m_i, alpha = _scores(s, m_i, scale_log2, row, 0, False, BLOCK_N, s_layout)
    l_i = gl.sum(p, 1)
    p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)

    for j in range(1, n_blocks):
        s_idx = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(k_ready.index(s_idx), (j // STAGES) & 1)
        if PINGPONG:
            mbarrier.wait(turn.index(WG), (j & 1) ^ WG ^ 1)
        s = warpgroup_mma(q, k_smem.index(s_idx).permute((1, 0)),
                          gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout), use_acc=False, is_async=True)
        # the output moves to the previous tile's maximum while the scores are computed (FA3's order)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
        acc = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn.index(1 - WG), count=1)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
        mbarrier.arrive(k_empty.index(s_idx), count=1)
        if j >= first_masked:
            p, m_new, alpha = _scores(s, m_i, scale_log2, row, j, True, BLOCK_N, s_layout)
        else:
            p, m_new, alpha = _scores(s, m_i, scale_log2, row, j, False, BLOCK_N, s_layout)
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        p_next = gl.convert_layout(p.to(gl.bfloat16), p_layout)  # while the product runs
        # (the probabilities' registers, read by the product in flight, stay live until it completes)
        acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))
        mbarrier.arrive(v_empty.index(prev), count=1)
        p_op = p_next

    last = (n_blocks - 1) % STAGES
    mbarrier.wait(v_ready.index(last), ((n_blocks - 1) // STAGES) & 1)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    acc = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    mbarrier.arrive(v_empty.index(last), count=1)
    out = acc * gl.expand_dims(gl.convert_layout(1.0 / l_i, gl.SliceLayout(1, o_layout)), 1)
    q.store(out.to(gl.bfloat16))  # the query tile's slot is free once its last product has completed
    fence_async_shared()
    _tma_store(o_desc, [base + start + WG * ROWS, 0], q)
    tma.store_wait(0)


# Worker partitions receive their arguments as run-time values, so the tile sizes come from the buffers' types and
# PINGPONG picks the functions.
@gluon.jit
def _consumer_of(o_desc, q_smem, k_smem, v_smem, bars, start, n_blocks, base, scale_log2, WG: gl.constexpr,
                 PINGPONG: gl.constexpr):
    _consumer(o_desc, q_smem, k_smem, v_smem, bars, start, n_blocks, base, scale_log2, WG, k_smem.type.shape[1],
              k_smem.type.shape[2], k_smem.type.shape[0], PINGPONG)


@gluon.jit
def _producer_role(q_desc, k_desc, v_desc, o_desc, q_smem, k_smem, v_smem, bars, start, n_blocks, base, scale_log2):
    _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, start, n_blocks, base, k_smem.type.shape[1],
              k_smem.type.shape[0])


@gluon.jit
def _consumer1_pingpong(q_desc, k_desc, v_desc, o_desc, q_smem, k_smem, v_smem, bars, start, n_blocks, base,
                        scale_log2):
    _consumer_of(o_desc, q_smem, k_smem, v_smem, bars, start, n_blocks, base, scale_log2, 1, True)


@gluon.jit
def _consumer1_free(q_desc, k_desc, v_desc, o_desc, q_smem, k_smem, v_smem, bars, start, n_blocks, base, scale_log2):
    _consumer_of(o_desc, q_smem, k_smem, v_smem, bars, start, n_blocks, base, scale_log2, 1, False)


@gluon.jit
def fa3_causal(q_desc, k_desc, v_desc, o_desc, seq_len, scale_log2,
               BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr,
               PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr, GROUP: gl.constexpr):
    ROWS: gl.constexpr = q_desc.block_type.shape[0]
    # Programs run GROUP heads at a time (their keys and values stay in L2), longest query tiles first among them.
    tiles = seq_len // (2 * ROWS)
    pid = gl.program_id(0)
    idx = pid % (GROUP * tiles)
    base = (pid // (GROUP * tiles) * GROUP + idx % GROUP) * seq_len
    start = (tiles - 1 - idx // GROUP) * (2 * ROWS)
    n_blocks = gl.cdiv(start + 2 * ROWS, BLOCK_N)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(turn.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # both consumers release each slot
        mbarrier.init(v_empty.index(i), count=2)
    bars = (q_ready, k_ready, v_ready, k_empty, v_empty, turn)
    args = (q_desc, k_desc, v_desc, o_desc, q_smem, k_smem, v_smem, bars, start, n_blocks, base, scale_log2)
    consumer0_args = (o_desc, q_smem, k_smem, v_smem, bars, start, n_blocks, base, scale_log2, 0, PINGPONG)
    if PINGPONG:
        gl.warp_specialize([(_consumer_of, consumer0_args), (_producer_role, args), (_consumer1_pingpong, args)],
                           [1, 4], [PRODUCER_REGS, CONSUMER_REGS])
    else:
        gl.warp_specialize([(_consumer_of, consumer0_args), (_producer_role, args), (_consumer1_free, args)],
                           [1, 4], [PRODUCER_REGS, CONSUMER_REGS])


def _descriptors(q, k, v, o, block_n):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    B, H, S, D = q.shape

    def desc(t, rows):
        layout = gl.NVMMASharedLayout.get_default_for([rows, D], gl.bfloat16)
        return TensorDescriptor(t.view(B * H * S, D), [B * H * S, D], [D, 1], [rows, D], layout)
    return desc(q, WG_ROWS), desc(k, block_n), desc(v, block_n), desc(o, WG_ROWS)


# BLOCK_N, STAGES, PINGPONG, producer registers, consumer registers, maxnreg, GROUP (heads sharing the tile order)
CONFIGS = ((128, 2, True, 24, 240, 168, 1), (128, 2, False, 24, 240, 168, 1), (64, 3, True, 24, 240, 168, 1),
           (128, 3, True, 24, 240, 168, 1), (64, 4, False, 24, 240, 168, 1), (128, 2, True, 24, 240, 168, 4),
           (128, 2, True, 24, 240, 168, 8), (128, 2, True, 24, 240, 168, 16))


def launcher(q, k, v, block_n, stages, pingpong, producer_regs, consumer_regs, maxnreg, group):
    """``(launch, o)``: ``launch()`` runs the kernel on ``[B, H, S, D]`` bfloat16 tensors into ``o`` (S a multiple
    of 128 and of ``block_n``, D 64 or 128), with the descriptors made once."""
    B, H, S, D = q.shape
    o = torch.empty_like(q)
    if (B * H) % group:
        raise ValueError(f"group: must divide B * H = {B * H}, got {group}")
    grid = (S // (2 * WG_ROWS) * B * H, )
    descriptors = _descriptors(q, k, v, o, block_n)
    scale_log2 = D ** -0.5 * math.log2(math.e)

    def launch():
        fa3_causal[grid](*descriptors, S, scale_log2, BLOCK_N=block_n, HEAD_DIM=D, STAGES=stages, PINGPONG=pingpong,
                         PRODUCER_REGS=producer_regs, CONSUMER_REGS=consumer_regs, GROUP=group, num_warps=4,
                         maxnreg=maxnreg)
    return launch, o


def compiled(block_n, stages, pingpong, producer_regs, consumer_regs, maxnreg, group, head_dim=128):
    """The kernel of one configuration compiled for sm_90 with ``triton.compile`` (no GPU needed)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type
    t = torch.empty(2 * 256 * head_dim, dtype=torch.bfloat16).view(1, 2, 256, head_dim)
    params = [p.name for p in fa3_causal.params]
    signature = {name: mangle_type(d) for name, d in zip(params, _descriptors(t, t, t, t, block_n))}
    signature.update(seq_len="i32", scale_log2="fp32")
    constexprs = dict(BLOCK_N=block_n, HEAD_DIM=head_dim, STAGES=stages, PINGPONG=pingpong,
                      PRODUCER_REGS=producer_regs, CONSUMER_REGS=consumer_regs, GROUP=group)
    signature.update({name: "constexpr" for name in constexprs})
    source = GluonASTSource(fa3_causal, signature, {(params.index(n),): v for n, v in constexprs.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": maxnreg})


def compile_only(configs) -> int:
    """Compile every configuration for sm_90 without a GPU and print what it uses."""
    import traceback
    failures = 0
    for config in configs:
        label = "BLOCK_N {} stages {} pingpong {} regs {}/{}/{} group {}".format(*config)
        t0 = time.time()
        try:
            kernel = compiled(*config)
        except Exception as e:  # noqa: BLE001  (reported per configuration)
            failures += 1
            print(f"{label}: " + "".join(traceback.format_exception(e)))
            continue
        print(f"{label}: compiled in {time.time() - t0:.1f} s, {kernel.metadata.shared} bytes of shared memory, "
              f"{kernel.asm['ptx'].count('wgmma.mma_async')} wgmma")
    return 1 if failures else 0


TOLERANCE = 0.02  # max abs error against float64 attention on one head (bfloat16 outputs of unit-scale inputs)


def main(argv=None) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog="python -m ninefold.bench.attention_gluon",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=None, help="indices into CONFIGS to run (default: all)")
    parser.add_argument("--compile-only", action="store_true", help="compile for sm_90 on this machine and stop")
    parser.add_argument("--shape", default="4,32,4096,128", help="B,H,S,D")
    parser.add_argument("--timeout", type=float, default=90.0,
                        help="seconds per configuration, each run in its own process (a deadlocked pipeline is killed)")
    parser.add_argument("--in-process", action="store_true", help="run the configurations in this process")
    parser.add_argument("--dsl", action="store_true",
                        help="also time the DSL's attention under each fa3 configuration (ninefold.dsl.backends.gluon) "
                             "and as the tuner picks it")
    args = parser.parse_args(argv)
    indices = range(len(CONFIGS)) if args.configs is None else [int(i) for i in args.configs.split(",")]
    configs = [CONFIGS[i] for i in indices]
    if args.compile_only:
        return compile_only(configs)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("ninefold.bench.attention_gluon needs an sm_90 CUDA device; nothing measured.", file=sys.stderr)
        return 2
    if not args.in_process:
        import subprocess
        failed = False
        for i in indices:
            command = [sys.executable, "-m", "ninefold.bench.attention_gluon", "--in-process", "--configs", str(i),
                       "--shape", args.shape] + (["--dsl"] if args.dsl and i == indices[0] else [])
            try:
                failed |= subprocess.run(command, timeout=args.timeout, check=False).returncode != 0
            except subprocess.TimeoutExpired:
                failed = True
                print(f"configuration {i} {CONFIGS[i]}: no result within {args.timeout:.0f} s (killed)", flush=True)
        return 1 if failed else 0
    torch.manual_seed(0)
    B, H, S, D = (int(x) for x in args.shape.split(","))
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    h = (0, min(5, H - 1))  # one head in float64
    ref64 = causal_head_float64(q, k, v, h)
    flops = 4 * B * H * S * S * D / 2
    t_torch = triton.testing.do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    print(f"torch SDPA: {t_torch * 1e3:.1f} us, {flops / t_torch / 1e9:.0f} TFLOP/s; "
          f"its error on head {h}: {(ref[h].double() - ref64).abs().max().item():.4f}", flush=True)
    rows, failed = [], False
    for config in configs:
        label = "BLOCK_N {} stages {} pingpong {} regs {}/{}/{} group {}".format(*config)
        t0 = time.time()
        try:
            launch, out = launcher(q, k, v, *config)
            launch()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001  (a configuration that does not compile is reported, not fatal)
            failed = True
            print(f"{label}: {type(e).__name__}: {str(e)[:1500]}", flush=True)
            continue
        err64 = (out[h].double() - ref64).abs().max().item()
        err = (out.float() - ref.float()).abs().max().item()
        if not (err64 <= TOLERANCE and err <= 2 * TOLERANCE):
            bad = (out.float() - ref.float()).abs().amax(dim=(0, 1, 3))
            first = int((bad > 2 * TOLERANCE).nonzero()[0]) if bool((bad > 2 * TOLERANCE).any()) else -1
            print(f"{label}: WRONG (max error {err64:.4f} against float64, {err:.4f} against torch; first bad row "
                  f"{first}); not timed", flush=True)
            failed = True
            continue
        t = triton.testing.do_bench(launch)
        rows.append({"config": list(config), "us": t * 1e3, "tflops": flops / t / 1e9, "of_torch": t_torch / t,
                     "err_vs_fp64": err64})
        print(f"{label}: {t * 1e3:7.1f} us {flops / t / 1e9:4.0f} TFLOP/s ({t_torch / t:.1%} of torch); "
              f"max err vs fp64 head {err64:.4f}, vs torch {err:.4f}; first call {time.time() - t0:.1f} s", flush=True)
    if args.dsl:
        failed |= _dsl_rows(q, k, v, ref, ref64, h, flops, t_torch, rows, launch if rows else None)
    write_json(f"attention_gluon_{'_'.join(map(str, indices))}_{B}x{H}x{S}x{D}.json",
               {"device": torch.cuda.get_device_name(), "shape": [B, H, S, D], "torch_us": t_torch * 1e3, "rows": rows})
    return 1 if failed else 0


def _dsl_rows(q, k, v, ref, ref64, h, flops, t_torch, rows, hand) -> bool:
    """The DSL's attention (``ninefold.ops.kernels.attention``) under each fa3 configuration, then tuned; then
    two interleaved rounds of the tuned call, its configuration launched directly, the hand-written kernel and
    SDPA (drift of the card's clocks shows as drift of SDPA), each with the host time of one call."""
    from ninefold.dsl.backends import gluon
    from ninefold.ops.kernels import attention

    o = torch.empty_like(q)
    bound = attention.kernel.bind((q, k, v, q.shape[-1] ** -0.5, True, o), {}, backend="triton")
    why = gluon.reason(attention.kernel, bound)
    if why is not None:
        print(f"DSL fa3: not applicable ({why})", flush=True)
        return True
    failed = False
    runs = [(f"DSL fa3 {c}", lambda c=c: gluon.launch(attention.kernel, bound, c)) for c in gluon.configs(attention.kernel, bound)]
    runs.append(("DSL tuned", lambda: attention.kernel(q, k, v, q.shape[-1] ** -0.5, True, o)))
    for label, run in runs:
        t0 = time.time()
        o.fill_(float("nan"))
        run()
        torch.cuda.synchronize()
        first = time.time() - t0
        err64 = (o[h].double() - ref64).abs().max().item()
        err = (o.float() - ref.float()).abs().max().item()
        if not (err64 <= TOLERANCE and err <= 2 * TOLERANCE):
            print(f"{label}: WRONG (max error {err64:.4f} against float64, {err:.4f} against torch)", flush=True)
            failed = True
            continue
        t = triton.testing.do_bench(run)
        rows.append({"config": label, "us": t * 1e3, "tflops": flops / t / 1e9, "of_torch": t_torch / t, "err_vs_fp64": err64})
        print(f"{label}: {t * 1e3:7.1f} us {flops / t / 1e9:4.0f} TFLOP/s ({t_torch / t:.1%} of torch); max err vs fp64 "
              f"{err64:.4f}; first call {first:.1f} s", flush=True)
    from ninefold.dsl.tuning import _MEMO
    picked = list(_MEMO.values())[-1] if _MEMO else None
    print(f"DSL tuner picked: {picked}", flush=True)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    again = [("DSL tuned (kernel call)", runs[-1][1]), ("SDPA", lambda: sdpa(q, k, v, is_causal=True))]
    if picked and picked.get("schedule") == "fa3":
        again.append(("DSL picked config, direct", lambda: gluon.launch(attention.kernel, bound, picked)))
    if hand is not None:
        again.append(("hand-written (last configuration)", hand))
    for round_ in (1, 2):
        for label, run in again:
            t = triton.testing.do_bench(run)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                run()
            host = (time.perf_counter() - t0) / 20
            torch.cuda.synchronize()
            rows.append({"config": f"round {round_}: {label}", "us": t * 1e3, "of_torch": t_torch / t, "host_us": host * 1e6})
            print(f"round {round_} {label}: {t * 1e3:7.1f} us ({t_torch / t:.1%} of the first SDPA timing); "
                  f"host {host * 1e6:.0f} us per call", flush=True)
    return failed


if __name__ == "__main__":
    sys.exit(main())
