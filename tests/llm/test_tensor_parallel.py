"""Tensor parallelism: the sharding plan, and engines over real worker processes against transformers."""

from __future__ import annotations

import os
import signal
import textwrap
import time

import pytest
import torch
from test_parity import GREEDY, generate_ids, hf_greedy, prompts_for
from tiny_models import VARIANTS

from ninefold import LLM, SamplingParams
from ninefold.llm.config import ModelConfig
from ninefold.llm.engine import LLMEngine
from ninefold.llm.parallel import check_parallel_size, shard_plan, shard_tensors


def _config(heads=8, kv_heads=4, inter=96, head_dim=16) -> ModelConfig:
    return ModelConfig.from_dict(dict(architectures=["LlamaForCausalLM"], hidden_size=heads * head_dim,
                                      intermediate_size=inter, num_attention_heads=heads,
                                      num_key_value_heads=kv_heads, num_hidden_layers=1, vocab_size=50,
                                      head_dim=head_dim))


@pytest.mark.parametrize("heads, kv_heads, size", [(8, 4, 2), (8, 4, 4), (8, 2, 4), (8, 1, 8), (8, 8, 1)])
def test_every_query_head_sits_with_the_key_value_head_it_reads(heads, kv_heads, size):
    config = _config(heads, kv_heads)
    group = heads // kv_heads
    covered = []
    for rank in range(size):
        plan = shard_plan(config, rank, size)
        local = plan.local_config(config)
        assert local.num_heads * size == heads and local.intermediate_size * size == config.intermediate_size
        first_q, end_q = plan.q_heads
        first_kv, end_kv = plan.kv_heads
        covered += range(first_q, end_q)
        # local query head j reads local kv head j // (local group size), as the model's GQA does
        local_group = local.num_heads // local.num_kv_heads
        for j in range(local.num_heads):
            assert (first_q + j) // group == first_kv + j // local_group
        assert end_kv - first_kv == max(1, kv_heads // size)
    assert covered == list(range(heads))


def test_shards_put_back_together_give_the_checkpoint():
    config = _config(heads=4, kv_heads=2, inter=12, head_dim=3)
    D, q, kv = config.hidden_size, 4 * 3, 2 * 3
    gen = torch.Generator().manual_seed(0)
    p = "model.layers.0."
    full = {name: torch.randn(shape, generator=gen) for name, shape in {
        p + "self_attn.q_proj.weight": (q, D), p + "self_attn.k_proj.weight": (kv, D),
        p + "self_attn.v_proj.weight": (kv, D), p + "self_attn.o_proj.weight": (D, q),
        p + "self_attn.q_proj.bias": (q,), p + "mlp.gate_proj.weight": (12, D), p + "mlp.up_proj.weight": (12, D),
        p + "mlp.down_proj.weight": (D, 12), p + "input_layernorm.weight": (D,), "model.embed_tokens.weight": (50, D),
        "lm_head.weight": (50, D)}.items()}
    shards = [shard_tensors(full, config, shard_plan(config, r, 2), keep_lm_head=r == 0) for r in range(2)]
    rows = ("q_proj.weight", "q_proj.bias", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")
    for name, tensor in full.items():
        if name == "lm_head.weight":
            assert torch.equal(shards[0][name], tensor) and name not in shards[1]
        elif name.endswith(rows):
            assert torch.equal(torch.cat([s[name] for s in shards]), tensor), name
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            assert torch.equal(torch.cat([s[name] for s in shards], dim=1), tensor), name
        else:
            assert all(torch.equal(s[name], tensor) for s in shards), name
    # one slice, o's columns match q's rows: head h of q_proj meets head h of o_proj on the same rank
    assert torch.equal(shards[1][p + "self_attn.o_proj.weight"], full[p + "self_attn.o_proj.weight"][:, 6:])


@pytest.mark.parametrize("kwargs, words", [
    (dict(heads=8, kv_heads=4, inter=96), "tensor_parallel_size: got 3, but this model cannot be split 3 ways: "
     "num_attention_heads=8 is not a multiple of it; num_key_value_heads=4 is neither a multiple nor a divisor of it"),
    (dict(heads=6, kv_heads=6, inter=100, head_dim=8), "intermediate_size=100 is not a multiple of it"),
])
def test_models_that_cannot_be_split_are_refused_naming_why(kwargs, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace("=", "=")):
        check_parallel_size(_config(**kwargs), 3)
    with pytest.raises(ValueError, match="tensor_parallel_size: expected a positive int, got 0"):
        check_parallel_size(_config(), 0)


def test_a_rank_reads_only_its_slices_of_a_checkpoint_and_the_full_shapes_are_checked(model_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    from ninefold.llm.loader import load_checkpoint

    path = model_dirs["qwen2"]  # q/k/v biases too
    full = load_checkpoint(str(path))
    part = load_checkpoint(str(path), tensor_parallel=(1, 2))
    assert part.tensor_parallel == (1, 2) and full.tensor_parallel is None
    config = ModelConfig.from_dict(full.config)
    want = shard_tensors(full.tensors, config, shard_plan(config, 1, 2), keep_lm_head=True)
    assert part.tensors.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(part.tensors[name], tensor), name
    assert part.tensors["model.layers.0.self_attn.q_proj.weight"].shape[0] * 2 == config.num_heads * config.head_dim

    broken = tmp_path / "broken"
    broken.mkdir()
    for file in path.iterdir():
        (broken / file.name).write_bytes(file.read_bytes())
    weights = load_file(str(broken / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    weights[name] = torch.cat([weights[name], weights[name][:, :8]], dim=1)  # a wider matrix still slices fine
    save_file(weights, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match=f"tensor '{name}' in model.safetensors has shape .64, 136., expected .64, 128."):
        load_checkpoint(str(broken), tensor_parallel=(0, 2))


def test_three_ranks_of_the_real_gguf_model_agree_with_one_dequantized(smollm2):
    """SmolLM2 (9 heads, 3 key/value heads) splits 3 ways; quantized GGUF matrices are dequantized to split."""
    prompt = [1, 9690, 198, 2683, 314, 260, 3575, 282, 4649, 47]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(str(smollm2), device="cpu", quantization="none", num_kv_blocks=32) as one:
        want = one.generate(prompt_token_ids=[prompt], sampling_params=params)[0].outputs[0].token_ids
    with LLM(str(smollm2), device="cpu", num_kv_blocks=32, tensor_parallel_size=3) as three:
        assert three.engine.model.config.num_heads == 3
        got = three.generate(prompt_token_ids=[prompt], sampling_params=params)[0].outputs[0].token_ids
    assert got == want


def _worker_processes(engine: LLMEngine) -> list:
    return list(engine.parallel_group.procs)


@pytest.mark.parametrize("variant", VARIANTS)
def test_two_ranks_generate_transformers_greedy_tokens(model_dirs, variant):
    path = model_dirs[variant]
    with LLM(str(path), device="cpu", block_size=8, num_kv_blocks=64, tensor_parallel_size=2) as llm:
        procs = _worker_processes(llm.engine)
        assert llm.engine.model.config.num_heads == 2  # rank 0 holds half of the 4 query heads
        prompts = prompts_for(llm.engine.model_config.vocab_size)
        assert generate_ids(llm, prompts) == [hf_greedy(path, p) for p in prompts]
    assert [p.returncode for p in procs] == [0]  # stopped cleanly by close()
    with pytest.raises(RuntimeError, match="closed"):
        generate_ids(llm, prompts)


def test_four_ranks_with_replicated_key_value_heads_chunking_prefix_cache_and_preemption(model_dirs):
    path = model_dirs["llama"]  # 4 query heads, 2 key/value heads: each kv head on two ranks
    with LLM(str(path), device="cpu", block_size=4, num_kv_blocks=26, max_num_batched_tokens=9,
             tensor_parallel_size=4) as llm:
        prompts = prompts_for(llm.engine.model_config.vocab_size, lengths=(45, 17, 45, 3), seed=3)
        prompts[2][:20] = prompts[0][:20]
        expected = [hf_greedy(path, p) for p in prompts]
        assert generate_ids(llm, prompts) == expected
        assert llm.engine.scheduler.num_preemptions > 0
        assert generate_ids(llm, prompts) == expected  # now from the prefix cache
        assert llm.engine.blocks.hit_tokens > 0


def test_last_position_logits_match_one_rank(model_dirs):
    path = model_dirs["qwen3"]
    logits = []
    for size in (1, 2):
        engine = LLMEngine(str(path), device="cpu", block_size=4, num_kv_blocks=64, tensor_parallel_size=size)
        try:
            prompts = prompts_for(engine.model_config.vocab_size, lengths=(5, 23))
            for i, prompt in enumerate(prompts):
                engine.add_request(engine.build_request(prompt, GREEDY, f"r{i}"))
            logits.append(engine.runner.forward_logits(engine.scheduler.schedule()))
        finally:
            engine.close()
    torch.testing.assert_close(logits[1], logits[0], atol=2e-5, rtol=1e-4)


def test_a_model_that_cannot_be_split_is_refused_before_any_worker_starts(model_dirs):
    with pytest.raises(ValueError, match="tensor_parallel_size: got 3, but this model cannot be split 3 ways"):
        LLMEngine(str(model_dirs["llama"]), device="cpu", num_kv_blocks=16, tensor_parallel_size=3)


def worker_only_site(tmp_path, body: str) -> str:
    """A directory whose sitecustomize.py runs ``body`` in tensor-parallel worker processes only."""
    site = tmp_path / "site"
    site.mkdir()
    indented = textwrap.indent(textwrap.dedent(body).strip(), "    ")
    (site / "sitecustomize.py").write_text(f"import sys\nif '--init-method' in sys.argv:\n{indented}\n")
    return os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)


def test_a_worker_that_dies_before_joining_is_reported_at_once(model_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", worker_only_site(tmp_path, "import os; os._exit(7)"))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="worker rank 1 exited with code 7 before joining"):
        LLMEngine(str(model_dirs["llama"]), device="cpu", num_kv_blocks=16, tensor_parallel_size=2)
    assert time.monotonic() - start < 60  # not the 600 s rendezvous timeout


def test_a_worker_that_cannot_load_makes_rank_0_raise_naming_it(model_dirs, tmp_path, monkeypatch):
    body = """
    import ninefold.llm.loader as loader
    def refuse(*args, **kwargs):
        raise OSError("disk on fire")
    loader.load_checkpoint = refuse
    """
    monkeypatch.setenv("PYTHONPATH", worker_only_site(tmp_path, body))
    with pytest.raises(RuntimeError, match="rank 1: OSError: disk on fire"):
        LLMEngine(str(model_dirs["llama"]), device="cpu", num_kv_blocks=16, tensor_parallel_size=2)


def test_a_worker_that_cannot_allocate_its_kv_cache_makes_rank_0_raise_naming_it(model_dirs, tmp_path, monkeypatch):
    body = """
    import ninefold.runtime as runtime
    class Refused:
        def __init__(self, *args, **kwargs):
            raise RuntimeError("out of memory (pretend)")
    runtime.KVCachePool = Refused
    """
    monkeypatch.setenv("PYTHONPATH", worker_only_site(tmp_path, body))
    with pytest.raises(RuntimeError, match=r"failed to allocate their KV cache: rank 1: RuntimeError: out of memory"):
        LLMEngine(str(model_dirs["llama"]), device="cpu", num_kv_blocks=16, tensor_parallel_size=2)


def test_a_worker_killed_mid_service_fails_the_next_call_instead_of_hanging(model_dirs):
    path = model_dirs["llama"]
    llm = LLM(str(path), device="cpu", block_size=8, num_kv_blocks=64, tensor_parallel_size=2)
    try:
        prompts = prompts_for(llm.engine.model_config.vocab_size, lengths=(5,))
        assert generate_ids(llm, prompts) == [hf_greedy(path, prompts[0])]
        (worker,) = _worker_processes(llm.engine)
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait()
        with pytest.raises(RuntimeError, match="tensor-parallel"):
            generate_ids(llm, prompts)
        with pytest.raises(RuntimeError, match="stopped after an error"):
            generate_ids(llm, prompts)
    finally:
        llm.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_two_gpus_give_transformers_float32_greedy_tokens(model_dirs, variant):
    """NCCL between two GPUs: the all-reduces inside the layers and the step payload."""
    path = model_dirs[variant]
    with LLM(str(path), dtype="float32", device="cuda:0", block_size=16, num_kv_blocks=64,
             tensor_parallel_size=2) as llm:
        assert llm.engine.parallel_group.comm.backend_for(torch.ones(1, device="cuda:0")) == "nccl"
        prompts = prompts_for(llm.engine.model_config.vocab_size)
        assert generate_ids(llm, prompts) == [hf_greedy(path, p) for p in prompts]


@pytest.mark.skipif(not 0 < torch.cuda.device_count() < 4, reason="needs CUDA with fewer than 4 GPUs")
def test_more_ranks_than_gpus_is_refused_naming_the_count(model_dirs):
    with pytest.raises(ValueError, match="tensor_parallel_size: 4 ranks need GPUs cuda:0..cuda:3"):
        LLMEngine(str(model_dirs["llama"]), device="cuda", num_kv_blocks=16, tensor_parallel_size=4)


def test_a_process_already_in_a_distributed_job_is_refused_instead_of_computing_half_a_model(model_dirs):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="tensor_parallel_size: this process already runs a torch.distributed"):
            LLMEngine(str(model_dirs["llama"]), device="cpu", num_kv_blocks=16, tensor_parallel_size=2)
    finally:
        dist.destroy_process_group()


def test_a_worker_dying_inside_a_forward_pass_fails_the_call_within_seconds(model_dirs, tmp_path, monkeypatch):
    body = """
    import os
    from ninefold.llm.models import llama
    calls = [0]
    forward = llama.LlamaForCausalLM.forward
    def dying(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 4:
            os._exit(9)
        return forward(self, *args, **kwargs)
    llama.LlamaForCausalLM.forward = dying
    """
    monkeypatch.setenv("PYTHONPATH", worker_only_site(tmp_path, body))
    with LLM(str(model_dirs["llama"]), device="cpu", block_size=8, num_kv_blocks=64, tensor_parallel_size=2) as llm:
        start = time.monotonic()
        with pytest.raises(Exception, match=r"rank 1 \(exit code 9\)|workers are gone"):
            generate_ids(llm, prompts_for(llm.engine.model_config.vocab_size, lengths=(5,)))
        assert time.monotonic() - start < 60


def test_a_failed_start_stops_the_workers_and_gives_back_the_threads(model_dirs, monkeypatch):
    threads = torch.get_num_threads()
    started = []
    real_group = __import__("ninefold.llm.parallel.driver", fromlist=["WorkerGroup"]).WorkerGroup

    class Recording(real_group):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)

    monkeypatch.setattr("ninefold.llm.parallel.WorkerGroup", Recording)

    def no_pool(self, max_len):
        raise ValueError("num_kv_blocks: pretend the KV cache does not fit")

    monkeypatch.setattr(LLMEngine, "_make_pool", no_pool)
    with pytest.raises(ValueError, match="pretend"):
        LLMEngine(str(model_dirs["llama"]), device="cpu", num_kv_blocks=16, tensor_parallel_size=2)
    assert [p.returncode for p in started[0].procs] == [0]
    assert torch.get_num_threads() == threads
    monkeypatch.undo()
    with LLM(str(model_dirs["llama"]), device="cpu", num_kv_blocks=16, tensor_parallel_size=2) as llm:  # and again
        assert generate_ids(llm, [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert torch.get_num_threads() == threads


def test_an_engine_built_in_a_thread_that_ends_keeps_its_workers(model_dirs):
    import threading

    built = {}
    thread = threading.Thread(target=lambda: built.update(llm=LLM(str(model_dirs["llama"]), device="cpu",
                                                                  num_kv_blocks=16, tensor_parallel_size=2)))
    thread.start()
    thread.join()
    llm = built["llm"]
    try:
        time.sleep(1)  # a parent-death signal tied to the finished thread would have killed the worker by now
        assert [p.poll() for p in _worker_processes(llm.engine)] == [None]
        path = model_dirs["llama"]
        prompts = prompts_for(llm.engine.model_config.vocab_size, lengths=(5,))
        assert generate_ids(llm, prompts) == [hf_greedy(path, prompts[0])]
    finally:
        llm.close()


def test_stacked_projections_split_into_each_ranks_own_stacked_matrices():
    """Phi-3's qkv_proj and gate_up_proj: a rank's matrix stacks its rows of q, k and v (of gate and up), as the
    unstacked checkpoint's q_proj, k_proj, v_proj (gate_proj, up_proj) would be sliced for it."""
    config = ModelConfig.from_dict(dict(architectures=["Phi3ForCausalLM"], hidden_size=8 * 4, intermediate_size=12,
                                        num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=1,
                                        vocab_size=50))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(rows, 32, generator=gen) for rows in (32, 8, 8))
    gate, up = torch.randn(12, 32, generator=gen), torch.randn(12, 32, generator=gen)
    p = "model.layers.0."
    full = {p + "self_attn.qkv_proj.weight": torch.cat([q, k, v]), p + "mlp.gate_up_proj.weight": torch.cat([gate, up])}
    for size in (2, 4):
        for rank in range(size):
            plan = shard_plan(config, rank, size)
            got = shard_tensors(full, config, plan, keep_lm_head=False)
            qs, kvs = slice(plan.q_heads[0] * 4, plan.q_heads[1] * 4), slice(plan.kv_heads[0] * 4, plan.kv_heads[1] * 4)
            cs = slice(*plan.channels)
            assert torch.equal(got[p + "self_attn.qkv_proj.weight"], torch.cat([q[qs], k[kvs], v[kvs]])), (size, rank)
            assert torch.equal(got[p + "mlp.gate_up_proj.weight"], torch.cat([gate[cs], up[cs]])), (size, rank)


def test_two_ranks_of_phi3_generate_transformers_greedy_tokens_reading_only_their_slices(model_dirs):
    from ninefold.llm.loader import load_checkpoint

    path = model_dirs["phi3"]
    full, part = load_checkpoint(str(path)), load_checkpoint(str(path), tensor_parallel=(1, 2))
    config = ModelConfig.from_dict(full.config)
    want = shard_tensors(full.tensors, config, shard_plan(config, 1, 2), keep_lm_head=True)
    assert all(torch.equal(part.tensors[name], tensor) for name, tensor in want.items())
    with LLM(str(path), device="cpu", block_size=8, num_kv_blocks=64, tensor_parallel_size=2) as llm:
        prompts = prompts_for(llm.engine.model_config.vocab_size)
        assert generate_ids(llm, prompts) == [hf_greedy(path, p) for p in prompts]


def test_two_ranks_of_a_partial_rotary_phi3_generate_transformers_greedy_tokens(tmp_path):
    """Each rank orders its own heads' q/k rows for the partial rotary embedding (Phi-4-mini)."""
    from tiny_models import build_model_dir

    path = build_model_dir(tmp_path / "partial", "phi3", partial_rotary_factor=0.75)
    with LLM(str(path), device="cpu", block_size=8, num_kv_blocks=64, tensor_parallel_size=2) as llm:
        prompts = prompts_for(llm.engine.model_config.vocab_size)
        assert generate_ids(llm, prompts) == [hf_greedy(path, p) for p in prompts]


def test_longrope_factors_follow_the_pool_on_every_rank(tmp_path):
    """A pool capping the context below the pretraining one picks the short factors on rank 0 and the workers alike
    (a worker on the long ones would rotate its heads' keys differently: tokens would part from transformers')."""
    from test_phi3 import LONGROPE
    from tiny_models import build_model_dir

    path = build_model_dir(tmp_path / "longrope", "phi3", rope_parameters=LONGROPE,
                           original_max_position_embeddings=64, max_position_embeddings=512)
    with LLM(str(path), device="cpu", block_size=16, num_kv_blocks=4, tensor_parallel_size=2) as llm:
        assert llm.engine.max_model_len == 64
        prompts = prompts_for(llm.engine.model_config.vocab_size, lengths=(3, 17))
        assert generate_ids(llm, prompts) == [hf_greedy(path, p) for p in prompts]
    with LLM(str(path), device="cpu", block_size=16, num_kv_blocks=16, tensor_parallel_size=2) as llm:
        prompts = prompts_for(llm.engine.model_config.vocab_size, lengths=(70, 100))
        assert generate_ids(llm, prompts) == [hf_greedy(path, p) for p in prompts]
