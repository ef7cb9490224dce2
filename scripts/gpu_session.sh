#!/usr/bin/env bash
# Runs ninefold's GPU checks and benchmarks on a lent GPU machine, one step per argument.
# Usage: scripts/gpu_session.sh STEP[:SECONDS] ...   (steps: env dsl-selfcheck cuda-tests dsl-test
# dsl-bench ops-test ops-bench runtime llm-test llm-bench llm-bench-vendor-linear llm-bench-gpt-fast llm-profile llm-profile-host llm-profile-gaps ops-memory ops-attention ops-gemv dsl-sweep dsl-sweep-mm dsl-sweep-sdpa dsl-sweep-memory decode-chain decode-attention decode-attention-ragged prefill-configs decode-gemm decode-gemm-blas gemm-cuda decode-gemm-split cublaslt cublaslt-search cublaslt-tests llm-bench-cublaslt-ab llm-bench-x3 pdl-tests llm-ab-pdl decode-pdl-tests decode-layer-pdl dsl-cuda dsl-sweep-sdpa-ws gemm-ws attention-exp2 attention-gluon dsl-fa3 dsl-bench-attention dsl-edges-cuda llm-edges-cuda llm-cuda ops-cuda ops-build cuda-quick ops-tune-rest ship-table serve-bench comm-tests comm-bench comm-nccl nccl-tests llm-host-offline llm-offline engine-features-cuda lora-cuda lora-bench-cuda lora-kernels-ab host-ab sampling-bench sampling-tests sampling-ab host-sampling cutlass-tests cutlass-bench llm-ab-cutlass llm-ab-cutlass-pdl rope-fold-tests llm-ab-rope-fold fold-cold rows-tests gemv-rows rows-ab layer-overlap pytest (PYTEST_ARGS) fp8-gemv llm-fp8-b1-ab kv-fp8-bench decode-attention-fp8 decode-attention-fp8-ab fp8-dot-ab fp8-dot-sweep tp-cuda tp-bench (on a multi-GPU kind)); logs and each step's files are packed into $OUT/results.tgz.
set -u
FINAL_OUT=${OUT:-/tmp/ninefold-out}
RESULTS=/tmp/nf-results
mkdir -p "$FINAL_OUT" "$RESULTS"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
if ls .whl/mpich-*.whl >/dev/null 2>&1; then  # MPI's libraries install beside a prefix, not into --target
  python3 -m pip install -q --no-index --no-deps --no-compile --ignore-installed --prefix /tmp/mpi .whl/mpich-*.whl \
    && export PATH="/tmp/mpi/bin:$PATH" LD_LIBRARY_PATH="/tmp/mpi/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# A CUTLASS GEMM library built here (python -m ninefold.ops.cutlass.build --out .build/cutlass) travels in .build.
if [ -f .build/cutlass/libnf_cutlass_sm90.so ]; then export NINEFOLD_CUTLASS_LIB="$PWD/.build/cutlass"; fi
# The engine launches its one-row GEMVs with PDL only where the decode-chain step measured it faster.
PDL_ENV='f=$(find /tmp/nf-results -name gemv_pdl.env 2>/dev/null | head -1); if [ -n "$f" ]; then set -a; . "$f"; set +a; echo "PDL env: $(cat $f)"; fi;'
# Two interleaved rounds of command $1 on the tree before (.ab_old/src, carried with the call) and on this one;
# each run's log lines matching the extended regex $2 are shown.
old_new_ab() {
  echo "for i in 1 2; do for arm in old new; do P=\$PYTHONPATH; [ \$arm = old ] && P=\$PWD/.ab_old/src:\$PYTHONPATH; PYTHONPATH=\$P OUT=\$OUT/\$arm-\$i $1 > \$OUT/\$arm-\$i.log 2>&1; echo \"run \$i \$arm (\$(PYTHONPATH=\$P python3 -c 'import ninefold, os; print(os.path.dirname(ninefold.__file__))')):\"; grep -aE '$2' \$OUT/\$arm-\$i.log; done; done"
}
step_command() {
  case "$1" in
    env) echo 'nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.total --format=csv; python3 -c "import torch,triton;print(torch.__version__,triton.__version__,torch.cuda.get_device_name())"' ;;
    dsl-selfcheck) echo 'python3 -m ninefold.dsl.selfcheck && if [ -d aot_mm_triton39 ]; then python3 -m ninefold.dsl.selfcheck --aot-dir aot_mm_triton39; fi' ;;
    cuda-tests) echo 'python3 -m pytest tests/dsl tests/ops tests/runtime tests/llm tests/server/test_cuda.py -q -n 8 -k "cuda or interpret" -p no:cacheprovider' ;;
    comm-tests) echo 'python3 -m pytest tests/comm tests/llm/test_kv_transfer.py tests/llm/test_disagg_cluster.py tests/runtime/test_kv_pool_blocks.py tests/server/test_cuda.py -q -n 4 -rs -p no:cacheprovider' ;;
    comm-bench) echo 'python3 -m ninefold.bench.comm --device cpu --nproc 4 --max-mib 16 && OUT=$OUT/mpi mpiexec -n 4 python3 -m ninefold.bench.comm --device cpu --max-mib 16' ;;
    comm-nccl) echo 'python3 -m pytest tests/comm/test_collectives.py tests/llm/test_kv_transfer.py tests/llm/test_disagg_cluster.py -q -n 2 -rs -k cuda -p no:cacheprovider; OUT=$OUT/nccl python3 -m ninefold.bench.comm --device cuda --max-mib 1024' ;;
    tp-cuda) echo 'python3 -m pytest tests/llm/test_tensor_parallel.py tests/server/test_tensor_parallel_server.py -q -rs -p no:cacheprovider' ;;
    tp-bench) echo 'for eager in "" --enforce-eager; do OUT=$OUT/tp$eager python3 -m ninefold.bench.llm_tp --model llama-3.1-8b --dtype bfloat16 --device cuda --sizes 1,2 --batch 1,64 --prompt-len 1024 --new-tokens 128 $eager; done' ;;
    serve-bench) echo 'python3 -m ninefold.bench.serve_local --device cuda' ;;
    dsl-test) echo 'python3 -m pytest tests/dsl -q -n 8 -p no:cacheprovider' ;;
    dsl-bench) echo "python3 -m ninefold.bench.dsl ${DSL_BENCH_ARGS:-}" ;;
    ops-test) echo 'python3 -m pytest tests/ops -q -n 8 -p no:cacheprovider' ;;
    ops-bench) echo "python3 -m ninefold.bench.ops ${OPS_BENCH_ARGS:-}" ;;
    runtime) echo 'python3 -m ninefold.bench.runtime' ;;
    llm-test) echo 'python3 -m pytest tests/llm -q -n 8 -p no:cacheprovider -k "not gguf"' ;;
    llm-bench) echo "$PDL_ENV python3 -m ninefold.bench.llm" ;;
    llm-bench-vendor-linear) echo "$PDL_ENV NINEFOLD_OPS=linear=vendor python3 -m ninefold.bench.llm" ;;
    llm-bench-gpt-fast) echo 'python3 -m ninefold.bench.llm --gpt-fast .peers/gpt-fast' ;;
    llm-profile) echo 'python3 -m ninefold.bench.llm_profile' ;;
    llm-profile-host) echo 'python3 -m ninefold.bench.llm_profile --host' ;;
    llm-profile-offline) echo 'python3 -m ninefold.bench.llm_profile --whole-offline' ;;
    llm-profile-gaps) echo 'python3 -m ninefold.bench.llm_profile --gaps' ;;
    gpu-state) echo 'nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit,temperature.gpu,clocks_throttle_reasons.active --format=csv' ;;
    ops-memory) echo 'python3 -m ninefold.bench.ops_memory' ;;
    ops-attention) echo 'python3 -m pytest tests/ops/test_attention.py -q -n 4 -k cuda -p no:cacheprovider; python3 -m ninefold.bench.ops_attention' ;;
    dsl-sweep) echo 'python3 -m ninefold.bench.dsl --sweep all' ;;
    cuda-quick) echo 'python3 -m pytest tests/ops tests/llm tests/dsl tests/runtime -q -n 8 -k cuda --timeout 90 -p no:cacheprovider' ;;
    ops-tune-rest) echo 'python3 -m ninefold.cli.main ops tune --ops linear embedding argmax sample --shapes llama-8b --out src/ninefold/ops/tables/nvidia-h200.json && cp src/ninefold/ops/tables/nvidia-h200.json "$OUT/" && echo merged into the shipped table for the steps after this one' ;;
    ship-table) echo 'cp /tmp/nf-results/ops-bench/tuning-nvidia-h200.json src/ninefold/ops/tables/nvidia-h200.json && echo shipped the new table for the steps after this one' ;;
    ops-gemv) echo 'python3 -m ninefold.bench.ops_gemv' ;;
    ops-build) echo 'python3 -m ninefold.bench.ops_build --build aot_ops_build_triton39' ;;
    dsl-sweep-mm) echo 'python3 -m ninefold.bench.dsl --sweep mm' ;;
    dsl-sweep-sdpa) echo 'python3 -m ninefold.bench.dsl --sweep sdpa' ;;
    dsl-sweep-memory) echo 'python3 -m ninefold.bench.dsl --sweep memory' ;;
    decode-chain) echo 'python3 -m pytest tests/ops/test_gemv_pdl.py tests/ops/test_gemv_pdl_ops.py tests/ops/test_fused_linear.py tests/bench/test_decode_chain.py tests/llm/test_fused_decode.py -q -p no:cacheprovider -k "cuda or sm90 or graph"; python3 -m ninefold.bench.decode_chain' ;;
    decode-pdl-tests) echo 'python3 -m pytest tests/ops/test_decode_pdl.py tests/ops/test_attention_decode_merge.py tests/ops/test_rope_cache.py -q -p no:cacheprovider; python3 -m pytest tests/ops/test_build_prebuilt.py -q -k cuda -p no:cacheprovider' ;;
    decode-layer-pdl) echo 'python3 -m ninefold.bench.decode_layer_pdl --rounds 3 --iters 50 --variants no_pdl pdl_gemv pdl_all pdl_all_early' ;;
    dsl-cuda) echo 'python3 -m pytest tests/dsl -q -n 8 -k cuda -p no:cacheprovider' ;;
    dsl-sweep-sdpa-ws) echo 'python3 -m ninefold.bench.dsl --sweep sdpa-ws' ;;
    gemm-ws) echo "python3 -m ninefold.bench.gemm_ws ${GEMM_WS_ARGS:-}" ;;
    attention-exp2) echo "python3 -m ninefold.bench.attention_exp2 ${EXP2_ARGS:-}" ;;
    attention-gluon) echo "python3 -m ninefold.bench.attention_gluon ${GLUON_ARGS:-}" ;;
    dsl-fa3) echo 'python3 -m pytest tests/dsl/test_gluon_schedule.py -q -n 4 -p no:cacheprovider -rs; for s in 4,32,4096,128 1,32,8192,128 8,32,2048,128; do python3 -m ninefold.bench.attention_gluon --dsl --configs 5 --timeout 240 --shape $s; done' ;;
    decode-gemm) echo 'python3 -m ninefold.bench.decode_gemm' ;;
    cublaslt) echo 'python3 -m pytest tests/ops/test_cublaslt.py -q -p no:cacheprovider; python3 -m ninefold.bench.decode_gemm --impls vendor,cublaslt --batches 16,64,128,160,176,192,208,224,240,256' ;;
    llm-bench-cublaslt-ab) echo "for i in 1 2; do $PDL_ENV NINEFOLD_OPS=linear=cublaslt python3 -m ninefold.bench.llm | grep -a \"offline 256\|batch-1 decode:\"; $PDL_ENV NINEFOLD_OPS=linear=vendor python3 -m ninefold.bench.llm | grep -a \"offline 256\|batch-1 decode:\"; done" ;;
    cublaslt-search) echo 'NINEFOLD_CUBLASLT_SEARCH=exhaustive python3 -m ninefold.bench.decode_gemm --impls vendor,cublaslt --layers o,qkv,down,gate_up --batches 208,96,256,160' ;;
    cublaslt-tests) echo 'python3 -m pytest tests/ops/test_cublaslt.py tests/ops/test_triton_gemm.py::test_tuning_persists_and_dispatch_uses_it tests/llm/test_capture_sizes.py -q -p no:cacheprovider' ;;
    llm-bench-x3) echo "for i in 1 2 3; do $PDL_ENV python3 -m ninefold.bench.llm > \$OUT/run\$i.log 2>&1; cp \$OUT/bench_llm.json \$OUT/bench_llm_\$i.json; grep -a 'offline 256\|batch-1 decode:\|TTFT  4096\|batch  64' \$OUT/run\$i.log; done" ;;
    pdl-tests) echo 'python3 -m pytest tests/ops/test_rows_pdl.py tests/ops/test_triton_gemm.py tests/llm/test_cuda.py -q -p no:cacheprovider -n 4 -k "rows_pdl or pdl_launch or persists or graph or mixed"' ;;
    llm-ab-pdl) echo 'i=0; for arm in A1:vendor:1 A0:vendor:0 B:triton_gemm:1 A1:vendor:1 A0:vendor:0 B:triton_gemm:1; do i=$((i+1)); name=${arm%%:*}; rest=${arm#*:}; impl=${rest%%:*}; rows=${rest#*:}; NINEFOLD_OPS=linear=$impl NINEFOLD_ROWS_PDL=$rows python3 -m ninefold.bench.llm > $OUT/run$i-$name.log 2>&1; cp $OUT/bench_llm.json $OUT/bench_llm_$i-$name.json; echo "run $i arm $name (linear=$impl rows_pdl=$rows): $(grep -a "offline 256\|batch-1 decode:" $OUT/run$i-$name.log | tr "\n" " ")"; done; cp $NINEFOLD_CACHE_DIR/ops/gemm-*.json $OUT/ 2>/dev/null; true' ;;
    gemm-cuda) echo 'python3 -m pytest tests/ops/test_triton_gemm.py -q -p no:cacheprovider -x' ;;
    decode-gemm-split) echo 'python3 -m ninefold.bench.decode_gemm --impls vendor,triton_gemm --batches 32,64,96,128,160,192,224,256' ;;
    decode-gemm-blas) echo 'for b in cublas cublaslt; do python3 -m ninefold.bench.decode_gemm --impls vendor --blas $b --layers qkv,o,down --batches 128,160,192,224,256; done; CUBLASLT_WORKSPACE_SIZE=262144 python3 -m ninefold.bench.decode_gemm --impls vendor --blas cublaslt --layers qkv,o,down --batches 160,192,224,256' ;;
    decode-attention-ragged) echo 'python3 -m ninefold.bench.decode_attention --ragged-only' ;;
    prefill-configs) echo 'python3 -m ninefold.bench.prefill_configs' ;;
    decode-attention) echo 'python3 -m pytest tests/ops/test_attention_decode_merge.py tests/ops/test_rope_cache.py tests/ops/test_attention.py tests/ops/test_argmax_triton.py -q -n 4 -p no:cacheprovider; python3 -m ninefold.bench.decode_attention' ;;
    dsl-bench-attention) echo 'python3 -m ninefold.bench.dsl --deadline 0 --only sdpa_causal,sdpa' ;;
    dsl-edges-cuda) echo 'python3 -m pytest tests/dsl/test_cpu_backend_edges.py -q -n 4 -p no:cacheprovider' ;;
    llm-edges-cuda) echo 'python3 -m pytest tests/llm/test_async_scheduling_edges.py tests/llm/test_async_scheduling.py -q -k cuda --timeout 150 -p no:cacheprovider' ;;
    rows-tests) echo 'python3 -m pytest tests/ops/test_gemv_rows.py tests/ops/test_gemv_pdl_ops.py tests/ops/test_gemv_pdl.py tests/ops/test_fused_linear.py tests/llm/test_fused_decode.py -q -n 4 -rs -p no:cacheprovider' ;;
    gemv-rows) echo "python3 -m ninefold.bench.gemv_rows ${GEMV_ROWS_ARGS:-}" ;;
    rows-ab) echo 'T=$(find /tmp/nf-results/gemv-rows -name gemv_rows_table.json | head -1); echo "table: $T"; for arm in off table; do case $arm in off) E="NINEFOLD_GEMV_ROWS=0";; *) E="NINEFOLD_GEMV_ROWS_TABLE=$T";; esac; env $E python3 -m ninefold.bench.llm --parts host_overhead --host-batches 1,2,4,8,16,32 > $OUT/$arm.log 2>&1; echo "arm $arm ($E):"; grep -a "host ms per decode step" $OUT/$arm.log; done' ;;
    llm-host-offline) echo "$PDL_ENV python3 -m ninefold.bench.llm --parts host_overhead,offline --host-batches 1,2,4,8,16,32,64,128,256" ;;
    nccl-tests) echo 'python3 -m pytest tests/comm/test_collectives.py tests/llm/test_kv_transfer.py tests/llm/test_disagg_cluster.py tests/server/test_cuda.py -q -n 2 -rs -k cuda --timeout 150 -p no:cacheprovider' ;;
    llm-cuda) echo "$PDL_ENV python3 -m pytest tests/llm -q -n 4 -k cuda --timeout 120 -p no:cacheprovider" ;;
    engine-features-cuda) echo 'python3 -m pytest tests/llm/test_cuda.py tests/server/test_cuda.py tests/llm/test_speculative.py tests/llm/test_token_restrictions.py -q -n 2 -k "prompt_logprobs or json or tool or cuda_speculation or cuda_restrictions" --timeout 200 -p no:cacheprovider' ;;
    llm-offline) echo "$PDL_ENV python3 -m ninefold.bench.llm --parts offline" ;;
    cutlass-tests) echo 'python3 -m pytest tests/ops/test_cutlass.py -q -rs -p no:cacheprovider' ;;
    rope-fold-tests) echo 'python3 -m pytest tests/ops/test_rope_cache_attention.py tests/llm/test_rope_in_attention.py tests/ops/test_decode_pdl.py -q -p no:cacheprovider -n 4' ;;
    fold-cold) echo 'python3 -m pytest tests/llm/test_rope_in_attention.py -q -p no:cacheprovider -rs -k mixing; TRITON_CACHE_DIR=/tmp/nf-cold-triton NINEFOLD_ROPE_IN_ATTENTION=1 python3 -m ninefold.bench.llm --parts offline' ;;
    llm-ab-rope-fold) echo "ROPE_FOLD_ARMS='${ROPE_FOLD_ARMS:-0:0 1:0 1:1}'; "'for i in $(seq ${ROPE_FOLD_ROUNDS:-2}); do for arm in $ROPE_FOLD_ARMS; do fold=${arm%:*}; early=${arm#*:}; NINEFOLD_ROPE_IN_ATTENTION=$fold NINEFOLD_DECODE_EARLY_KV=$early python3 -m ninefold.bench.llm --parts decode_batch1,offline > $OUT/fold$fold-early$early-$i.log 2>&1; cp $OUT/bench_llm.json $OUT/bench_llm_fold$fold-early$early-$i.json; echo "run $i rope_in_attention=$fold early_kv=$early: $(grep -a "offline 256\|batch-1 decode:\|compiled during the timed run" $OUT/fold$fold-early$early-$i.log | tr "\n" " ")"; done; done; true' ;;
    llm-ab-cutlass-pdl) echo 'for arm in vendor:linear=vendor:1:0.02 cutlass-pdl:linear=cutlass:1:0.02 cutlass-pdl-prefer:linear=cutlass:1:-0.1 cutlass-plain:linear=cutlass:0:0.02; do name=${arm%%:*}; rest=${arm#*:}; ops=${rest%%:*}; rest=${rest#*:}; pdl=${rest%%:*}; gain=${rest#*:}; NINEFOLD_OPS=$ops NINEFOLD_CUTLASS_PDL=$pdl NINEFOLD_CUTLASS_MIN_GAIN=$gain python3 -m ninefold.bench.llm --parts offline > $OUT/offline-$name.log 2>&1; cp $OUT/bench_llm.json $OUT/bench_llm_$name.json; echo "$name ($ops pdl=$pdl min_gain=$gain): $(grep -a "offline 256" $OUT/offline-$name.log | tr "\n" " ")"; done; cp $NINEFOLD_CACHE_DIR/ops/cutlass-*.json $OUT/ 2>/dev/null; true' ;;
    cutlass-bench) echo 'python3 -m ninefold.bench.cutlass_gemm --layers qkv,o,gate_up,down --batches 64,128,160,192,224,256' ;;
    llm-ab-cutlass) echo 'for i in 1 2; do for impl in vendor cutlass; do NINEFOLD_OPS=linear=$impl python3 -m ninefold.bench.llm --parts offline > $OUT/offline-$i-$impl.log 2>&1; cp $OUT/bench_llm.json $OUT/bench_llm_$i-$impl.json; echo "run $i linear=$impl: $(grep -a "offline 256" $OUT/offline-$i-$impl.log | tr "\n" " ")"; done; done; cp $NINEFOLD_CACHE_DIR/ops/cutlass-*.json $OUT/ 2>/dev/null; true' ;;
    lora-bench-cuda) echo "python3 -m ninefold.bench.lora_cuda ${LORA_CUDA_ARGS:-}" ;;
    lora-kernels-ab) echo 'for i in 1 2; do for k in 1 0; do NINEFOLD_LORA_KERNELS=$k OUT=$OUT/k$k-$i python3 -m ninefold.bench.lora_cuda > $OUT/kernels$k-$i.log 2>&1; echo "run $i NINEFOLD_LORA_KERNELS=$k:"; grep -a "graphs" $OUT/kernels$k-$i.log; done; done' ;;
    sampling-bench) echo "python3 -m ninefold.bench.sampling ${SAMPLING_ARGS:-}" ;;
    host-sampling) echo 'for arm in greedy temperature=0.8,top_p=0.95 temperature=0.8,top_k=50,top_p=0.95; do S=; [ $arm = greedy ] || S="--host-sampling $arm"; OUT=$OUT/${arm//[=,]/_} python3 -m ninefold.bench.llm --parts host_overhead $S > $OUT/${arm//[=,]/_}.log 2>&1; echo "$arm:"; grep -a "^batch" $OUT/${arm//[=,]/_}.log; done' ;;
    sampling-tests) echo 'python3 -m pytest tests/ops/test_sample_triton.py tests/ops/test_sampling.py tests/llm/test_cuda.py tests/llm/test_sampling.py::test_top_k_among_tied_logits_keeps_every_tied_token_and_seeded_rows_ignore_their_neighbours -q -rs -p no:cacheprovider -k "not interpreter and not transformers and not json and not token_identical"' ;;
    sampling-ab) old_new_ab 'python3 -m ninefold.bench.sampling --batches 1,64,256' '^B=.* : sample' ;;  # (unseeded rows)
    host-ab) old_new_ab 'python3 -m ninefold.bench.llm --parts host_overhead' '^batch|check|cosine' ;;
    lora-cuda) echo 'python3 -m pytest tests/llm/test_lora.py tests/llm/test_embeddings.py tests/ops/test_lora_kernels.py -q -k cuda -rs -p no:cacheprovider' ;;
    ops-cuda) echo 'python3 -m pytest tests/ops -q -n 8 -k cuda --timeout 90 -p no:cacheprovider' ;;
    layer-overlap) echo "python3 -m ninefold.bench.layer_overlap ${LAYER_OVERLAP_ARGS:-}" ;;
    pytest) echo "python3 -m pytest ${PYTEST_ARGS:?set PYTEST_ARGS to the tests to run} -q -rs -p no:cacheprovider" ;;
    fp8-tests) echo 'python3 -m pytest tests/ops/test_fp8.py tests/ops/test_triton_gemv.py tests/llm/test_fp8.py tests/llm/test_cuda.py -q -p no:cacheprovider -rs -k "fp8 or gemv"' ;;
    fp8-gemv) echo "python3 -m ninefold.bench.fp8_gemv ${FP8_GEMV_ARGS:-}" ;;
    llm-fp8-b1-ab) echo 'T=$(find /tmp/nf-results -name fp8_gemv_table.json | head -1); R=$(find /tmp/nf-results -name fp8_gemv_rows_table.json | head -1); echo "tables: $T $R"; for i in $(seq ${FP8_AB_ROUNDS:-1}); do for arm in before gemv; do case $arm in before) E="NINEFOLD_OPS=add_rms_norm_linear=vendor,silu_and_mul_linear=vendor,linear_fp8=triton_gemv";; *) E="NINEFOLD_GEMV_TABLE=$T NINEFOLD_GEMV_ROWS_TABLE=$R";; esac; mkdir -p $OUT/$arm-$i; env $E OUT=$OUT/$arm-$i python3 -m ninefold.bench.llm --parts decode_batch1 --quantization fp8 > $OUT/$arm-$i.log 2>&1; echo "run $i $arm ($E): $(grep -a "correctness\|batch-1 decode:\|FAILED" $OUT/$arm-$i.log | cut -c1-300 | tr "\n" " ")"; done; done; true' ;;
    decode-attention-fp8) echo 'python3 -m pytest tests/ops/test_attention_fp8_cache.py tests/llm/test_kv_cache_fp8.py -q -n 4 -p no:cacheprovider; python3 -m ninefold.bench.decode_attention --kv-cache-dtype fp8' ;;
    decode-attention-fp8-ab) old_new_ab 'python3 -m ninefold.bench.decode_attention --kv-cache-dtype fp8 --no-sweep' '^\| decode|FAILED|failed checks' ;;
    fp8-dot-ab) echo 'for arm in old new; do P=$PYTHONPATH; [ $arm = old ] && P=$PWD/.ab_old/src:$PYTHONPATH; mkdir -p $OUT/$arm; PYTHONPATH=$P OUT=$OUT/$arm python3 -m ninefold.bench.fp8_gemv --rows 1 > $OUT/gemv-$arm.log 2>&1; echo "fp8_gemv $arm:"; grep -a "rows  1" $OUT/gemv-$arm.log | cut -c1-200; done; for arm in old new; do P=$PYTHONPATH; E=""; [ $arm = old ] && P=$PWD/.ab_old/src:$PYTHONPATH; [ $arm = new ] && E="NINEFOLD_GEMV_TABLE=$OUT/new/fp8_gemv_table.json"; PYTHONPATH=$P env $E OUT=$OUT/llm-$arm python3 -m ninefold.bench.llm --parts decode_batch1 --quantization fp8 > $OUT/llm-$arm.log 2>&1; echo "llm fp8 batch-1 $arm ($E): $(grep -a "correctness\|batch-1 decode:\|FAILED" $OUT/llm-$arm.log | cut -c1-300 | tr "\n" " ")"; done; true' ;;
    fp8-dot-sweep) echo 'mkdir -p $OUT/sweep; OUT=$OUT/sweep python3 -m ninefold.bench.fp8_gemv --rows 1 > $OUT/sweep.log 2>&1; grep -a "rows  1" $OUT/sweep.log | cut -c1-200; for i in 1 2; do for arm in shipped sweep; do E=""; [ $arm = sweep ] && E="NINEFOLD_GEMV_TABLE=$OUT/sweep/fp8_gemv_table.json"; env $E OUT=$OUT/llm-$arm-$i python3 -m ninefold.bench.llm --parts decode_batch1 --quantization fp8 > $OUT/llm-$arm-$i.log 2>&1; echo "run $i $arm ($E): $(grep -a "batch-1 decode:\|FAILED" $OUT/llm-$arm-$i.log | cut -c1-120 | tr "\n" " ")"; done; done; true' ;;
    kv-fp8-bench) echo 'for kv in auto fp8; do mkdir -p $OUT/$kv; OUT=$OUT/$kv python3 -m ninefold.bench.llm --parts decode_batch1,offline --kv-cache-dtype $kv > $OUT/$kv.log 2>&1; echo "kv_cache_dtype=$kv: $(grep -a "correctness\|batch-1 decode:\|offline 256\|FAILED\|Error" $OUT/$kv.log | cut -c1-300 | tr "\n" " ")"; done; true' ;;
    llm-fp8) echo 'for q in fp8 none; do mkdir -p $OUT/$q; OUT=$OUT/$q python3 -m ninefold.bench.llm --parts decode_batch1,offline --quantization $q > $OUT/$q.log 2>&1; echo "quantization=$q: $(grep -a "correctness\|batch-1 decode:\|offline 256\|FAILED" $OUT/$q.log | cut -c1-300 | tr "\n" " ")"; done; true' ;;
    *) echo "echo unknown step $1; false" ;;
  esac
}
for arg in "$@"; do
  name=${arg%%:*}; limit=${arg#*:}; [ "$limit" = "$arg" ] && limit=300
  run=$name; i=2
  while [ -e "$RESULTS/$run.log" ]; do run=$name-$i; i=$((i + 1)); done  # a repeated step keeps both logs
  echo "=== $run (limit ${limit}s) ==="
  start=$(date +%s)
  mkdir -p "$RESULTS/$run"
  # a fresh ninefold cache per step: DSL choices tuned under one step (e.g. parallel tests) stay there
  OUT="$RESULTS/$run" NINEFOLD_CACHE_DIR="/tmp/nf-cache/$run" timeout "$limit" bash -c "$(step_command "$name")" > "$RESULTS/$run.log" 2>&1
  rc=$?
  tail -n 25 "$RESULTS/$run.log"
  echo "=== $run rc=$rc in $(( $(date +%s) - start ))s ==="
  tar -czf "$FINAL_OUT/results.tgz" -C "$RESULTS" .  # after every step: a run cut short still returns what it did
done
