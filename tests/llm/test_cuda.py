"""GPU checks: bfloat16 parity with transformers on CUDA, CUDA-graph decode against eager decode."""

import pytest
import torch
from tiny_models import VARIANTS
from transformers import AutoModelForCausalLM

from ninefold import LLM, SamplingParams
from ninefold.llm.engine import LLMEngine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [[5, 9, 33], list(range(40, 57)), [7, 200, 13, 99] * 11]


def _hf(path, dtype):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to("cuda").eval()
    model.generation_config.eos_token_id = None
    return model


def _hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt], device="cuda")
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_bf16_greedy_agrees_with_transformers_allowing_ties(model_dirs, variant, enforce_eager):
    """Every token we pick is (within bf16 rounding) a top token of transformers' logits for our own prefix."""
    path = model_dirs[variant]
    llm = LLM(str(path), dtype="bfloat16", device="cuda", block_size=16, num_kv_blocks=64,
              enforce_eager=enforce_eager, cuda_graph_max_batch=8)
    outs = llm.generate(prompt_token_ids=PROMPTS,
                        sampling_params=SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    model = _hf(path, torch.bfloat16)
    ref = _hf(path, torch.float32)
    for prompt, out in zip(PROMPTS, outs):
        ids = out.outputs[0].token_ids
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids], device="cuda")).logits[0].float()
            exact = ref(torch.tensor([prompt + ids], device="cuda")).logits[0]
        for t, token in enumerate(ids):
            row, row32 = logits[len(prompt) - 1 + t], exact[len(prompt) - 1 + t]
            gap = min(row.max() - row[token], row32.max() - row32[token])
            assert gap <= 0.05, f"{variant}: token {t} ({token}) is {gap:.3f} below the top logit"


@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_float32_greedy_is_token_identical_on_cuda(model_dirs, variant):
    path = model_dirs[variant]
    llm = LLM(str(path), dtype="float32", device="cuda", block_size=16, num_kv_blocks=64, cuda_graph_max_batch=4)
    outs = llm.generate(prompt_token_ids=PROMPTS,
                        sampling_params=SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    model = _hf(path, torch.float32)
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == _hf_greedy(model, prompt, 32)


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_mixed_decode_and_prefill_steps_are_token_identical_on_cuda(model_dirs, enforce_eager):
    """A small token budget makes steps where some sequences decode while others prefill (chunks
    with and without a cached prefix): the one-token rows go through attention_decode."""
    path = model_dirs["qwen2"]
    llm = LLM(str(path), dtype="float32", device="cuda", block_size=16, num_kv_blocks=64, cuda_graph_max_batch=4,
              max_num_batched_tokens=9, enforce_eager=enforce_eager)
    seen = []
    forward = llm.engine.model.forward

    def recording_forward(input_ids, positions, meta):
        seen.append(0 < meta.num_decodes < input_ids.shape[0])
        return forward(input_ids, positions, meta)

    llm.engine.model.forward = recording_forward
    prompts = [[5, 9], list(range(40, 57)), [7, 200, 13, 99] * 8, [3, 4, 5, 6]]
    outs = llm.generate(prompt_token_ids=prompts,
                        sampling_params=SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert any(seen)
    model = _hf(path, torch.float32)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == _hf_greedy(model, prompt, 24)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_decode_matches_eager_decode(model_dirs, dtype):
    path = model_dirs["llama"]
    engine = LLMEngine(str(path), dtype=dtype, device="cuda", block_size=16, num_kv_blocks=128,
                       cuda_graph_max_batch=16)
    assert engine.runner.graphs is not None
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS * 2):
        engine.add_request(engine.build_request(prompt, params, str(i)))
    engine.step()  # prefill everything
    engine.sync()  # (overlapped scheduling reads the prefill's tokens one call later)
    for _ in range(5):
        step = engine.scheduler.schedule()
        assert all(s.num_new_tokens == 1 for s in step) and len(step) == 6
        graph_logits = engine.runner.forward_logits(step).clone()
        graphs, engine.runner.graphs = engine.runner.graphs, None
        eager_logits = engine.runner.forward_logits(step)
        engine.runner.graphs = graphs
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(graph_logits, eager_logits, atol=tol, rtol=tol)
        tokens = eager_logits.argmax(-1).tolist()
        for s, token in zip(step, tokens):  # advance by hand, as engine.step would
            s.seq.num_computed_tokens += 1
            s.seq.append(token)


@pytest.mark.parametrize("filters", [dict(top_p=0.9, top_k=40), dict(top_p=0.9, min_p=0.01)], ids=["top_k", "no_top_k"])
def test_seeded_sampling_reproducible_on_cuda(model_dirs, filters):
    """(With top-k, ``ops.sample`` takes torch's sorting route; without, the Triton kernel.)"""
    llm = LLM(str(model_dirs["llama"]), device="cuda", block_size=16, num_kv_blocks=64, cuda_graph_max_batch=4)
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=24, ignore_eos=True, **filters)
    a = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    b = llm.generate(prompt_token_ids=PROMPTS[::-1], sampling_params=params)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b][::-1]


@pytest.mark.parametrize("filters", [dict(min_p=0.01), dict(top_p=0.9), dict(top_k=20, top_p=0.8)],
                         ids=["min_p", "top_p", "top_k"])
def test_a_seeded_request_samples_alike_beside_requests_of_every_other_route_on_cuda(model_dirs, filters):
    """(Rows drawn among the top-k candidates, by the Triton kernel over whole rows, and by torch's sorting route.)
    In float32: in bfloat16 the logits themselves change with the batch (one row takes the GEMV kernels, five the
    GEMMs of an 8-row graph; they differed by one bfloat16 step at the second token on an H100), and a draw near an
    edge follows them. Ties, which bfloat16 makes common, are
    ``test_top_k_among_tied_logits_keeps_every_tied_token_and_seeded_rows_ignore_their_neighbours``'s."""
    llm = LLM(str(model_dirs["llama"]), device="cuda", dtype="float32", block_size=16, num_kv_blocks=64,
              cuda_graph_max_batch=8)
    params = SamplingParams(temperature=1.0, seed=77, max_tokens=12, ignore_eos=True, **filters)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=params)]
    others = [SamplingParams(temperature=0.8, top_p=0.5, seed=1, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.2, top_k=5, seed=2, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=llm.engine.vocab_size - 1, seed=3, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
    batched = llm.generate(prompt_token_ids=[[3, 4, 5], [8, 9], PROMPTS[0], [6], [7, 7]],
                           sampling_params=[others[0], others[1], params, others[2], others[3]])
    assert alone == [batched[2].outputs[0].token_ids]


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_bf16_prompt_logprobs_agree_with_transformers_in_float32(model_dirs, enforce_eager):
    """Prompt logprobs on CUDA (chunked, beside CUDA-graph decodes) within bfloat16 rounding of float32 transformers."""
    path = model_dirs["llama"]
    llm = LLM(str(path), dtype="bfloat16", device="cuda", block_size=16, num_kv_blocks=64,
              enforce_eager=enforce_eager, cuda_graph_max_batch=8, max_num_batched_tokens=16)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=2))
    ref = _hf(path, torch.float32)
    for prompt, out in zip(PROMPTS, outs):
        entries = out.prompt_logprobs
        assert len(entries) == len(prompt) and entries[0] is None
        with torch.no_grad():
            logp = torch.log_softmax(ref(torch.tensor([prompt], device="cuda")).logits[0], dim=-1)
        for p in range(1, len(prompt)):
            assert prompt[p] in entries[p] and len(entries[p]) in (2, 3)
            for token, value in entries[p].items():
                assert abs(value - logp[p - 1, token].item()) < 0.05, f"position {p}, token {token}"


def test_json_guided_decoding_on_cuda_matches_the_cpu_in_float32(model_dirs):
    """Guided decoding on CUDA (masks on the device, CUDA-graph decode, overlapped scheduling on) gives the
    CPU's greedy tokens in float32, and sampled bfloat16 outputs stay JSON objects or prefixes of one."""
    from ninefold.llm.guided import GuidedDecodingParams
    from ninefold.llm.guided import json_machine as jm

    path = model_dirs["llama"]
    guided = GuidedDecodingParams(json_object=True)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, guided_decoding=guided)
    prompts = ["Reply in JSON:", "x", "a b c d e f"]
    cuda = LLM(str(path), dtype="float32", device="cuda", block_size=16, num_kv_blocks=64, cuda_graph_max_batch=8)
    cpu = LLM(str(path), dtype="float32", device="cpu", block_size=16, num_kv_blocks=64)
    assert cuda.engine.async_scheduling
    assert ([o.outputs[0].token_ids for o in cuda.generate(prompts, greedy)]
            == [o.outputs[0].token_ids for o in cpu.generate(prompts, greedy)])
    bf16 = LLM(str(path), dtype="bfloat16", device="cuda", block_size=16, num_kv_blocks=64, cuda_graph_max_batch=8)
    sampled = SamplingParams(temperature=1.0, seed=3, n=4, max_tokens=32, guided_decoding=guided)
    for out in bf16.generate(prompts, sampled):
        for c in out.outputs:
            state = jm.advance(jm.START, c.text.encode())
            assert state is not None and jm.complete(state) == (c.finish_reason == "stop"), c.text
    choices = ["red", "green", "blue", "东京"]
    picked = SamplingParams(temperature=1.0, seed=4, n=6, max_tokens=8, guided_decoding=GuidedDecodingParams(choice=choices))
    for out in bf16.generate(prompts, picked):
        assert all(c.text in choices and c.finish_reason == "stop" for c in out.outputs)


def test_float32_beam_search_on_cuda_matches_transformers_beam_search(model_dirs):
    """``LLM.beam_search`` on CUDA (rounds through the prefix cache, overlapped scheduling on) returns
    transformers' beams in float32 (EOS off, so both keep the best beams by summed log-probability)."""
    from ninefold import BeamSearchParams

    path = model_dirs["llama"]
    llm = LLM(str(path), dtype="float32", device="cuda", block_size=16, num_kv_blocks=128, cuda_graph_max_batch=8)
    got = llm.beam_search(PROMPTS[:2], BeamSearchParams(beam_width=3, max_tokens=10, ignore_eos=True,
                                                        length_penalty=0.0))
    model = _hf(path, torch.float32)
    for prompt, result in zip(PROMPTS[:2], got):
        ids = torch.tensor([prompt], device="cuda")
        out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=3, num_return_sequences=3,
                             max_new_tokens=10, do_sample=False, length_penalty=0.0, pad_token_id=0,
                             output_scores=True, return_dict_in_generate=True)
        assert [s.tokens for s in result.sequences] == out.sequences.tolist()
        assert [s.cum_logprob for s in result.sequences] == pytest.approx(out.sequences_scores.tolist(), abs=1e-3)


def test_gpu_memory_utilization_is_each_engines_own_share(model_dirs):
    """vLLM's gpu_memory_utilization bounds one engine, whatever else holds the GPU: engines of 0.3 each fit in one
    process beside each other, with pools of about the same size; the device-wide kv_cache_memory_fraction of 0.3
    leaves an engine nothing once others hold more than 0.3 of the device."""
    from ninefold.runtime import KVCacheExhausted

    path = str(model_dirs["llama"])
    _, total = torch.cuda.mem_get_info()
    first = LLM(path, dtype="bfloat16", device="cuda", gpu_memory_utilization=0.3, cuda_graph_max_batch=4)
    second = LLM(path, dtype="bfloat16", device="cuda", gpu_memory_utilization=0.3, cuda_graph_max_batch=4)
    with pytest.raises(KVCacheExhausted, match="memory_fraction=0.3"):
        LLM(path, dtype="bfloat16", device="cuda", kv_cache_memory_fraction=0.3, cuda_graph_max_batch=4)
    third = LLM(path, dtype="bfloat16", device="cuda", gpu_memory_utilization=0.25, cuda_graph_max_batch=4)
    blocks = [llm.engine.pool.num_blocks * llm.engine.pool.bytes_per_block for llm in (first, second, third)]
    assert abs(blocks[0] - blocks[1]) <= 0.05 * blocks[0], blocks
    assert 0.2 * total < blocks[0] < 0.3 * total and 0.15 * total < blocks[2] < 0.25 * total, (blocks, total)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = [llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)[2].outputs[0].token_ids
               for llm in (first, second, third)]
    assert outputs[0] == outputs[1] == outputs[2]


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_fp8_greedy_picks_top_tokens_of_its_rounded_weights(model_dirs, tmp_path, enforce_eager):
    """quantization="fp8" in bfloat16 (prefill rows W8A8 through ``scaled_mm``, decode rows weight-only through the
    Triton GEMV): every token it picks is, within the activations' rounding, a top token of transformers' float32
    logits on the checkpoint that holds the FP8 weight values."""
    from test_fp8 import _rounded_copy

    from ninefold import ops

    path = model_dirs["llama"]
    llm = LLM(str(path), dtype="bfloat16", device="cuda", quantization="fp8", num_kv_blocks=64,
              enforce_eager=enforce_eager, cuda_graph_max_batch=8)
    qkv = llm.engine.model.layers[0].qkv
    for rows, impl in ((3, "triton_gemv"), (40, "scaled_mm")):
        assert ops.choose("linear_fp8", torch.zeros(rows, qkv.shape[1], device="cuda", dtype=torch.bfloat16), qkv) == impl
    outs = llm.generate(prompt_token_ids=PROMPTS,
                        sampling_params=SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    ref = _hf(_rounded_copy(path, tmp_path / "rounded"), torch.float32)
    gaps = []
    for prompt, out in zip(PROMPTS, outs):
        ids = out.outputs[0].token_ids
        with torch.no_grad():
            logits = ref(torch.tensor([prompt + ids], device="cuda")).logits[0]
        for t, token in enumerate(ids):
            row = logits[len(prompt) - 1 + t]
            gaps.append(float(row.max() - row[token]))
    assert max(gaps) <= 0.15, f"largest gap below the top logit {max(gaps):.3f} (of {len(gaps)} tokens)"


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_fp8_decode_through_the_fused_gemvs_picks_top_tokens_of_its_rounded_weights(tmp_path, enforce_eager,
                                                                                    monkeypatch):
    """A model wide enough for the FP8 GEMVs (hidden 512), with launch entries for its shapes as a measured table
    would give: decode steps of one and three rows run the norm and the gate inside the FP8 GEMVs (PDL on
    Hopper), and every token is, within rounding, a top token of transformers on the FP8-rounded weights."""
    from test_fp8 import _rounded_copy
    from tiny_models import build_model_dir

    from ninefold import ops
    from ninefold.ops.triton import gemv_pdl_ops as go

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the FP8 GEMVs run on Hopper")
    path = build_model_dir(tmp_path / "wide", "llama", hidden_size=512, intermediate_size=1024, num_attention_heads=4,
                           num_key_value_heads=2)
    shapes = {(1024, 512, "add_rms_norm"), (1024, 512, "none"), (512, 512, "none"), (2048, 512, "add_rms_norm"),
              (512, 1024, "silu_and_mul")}
    for n, k, prologue in shapes:
        monkeypatch.setitem(go.OVERRIDE, (n, k, prologue, "fp8"), (16, 256, 1, 4, 2, 0))
        for bucket in (2, 4):
            monkeypatch.setitem(go.ROWS_OVERRIDE, (n, k, prologue, bucket, "fp8"), (32, 256, 1, 4, 3))
    llm = LLM(str(path), dtype="bfloat16", device="cuda", quantization="fp8", num_kv_blocks=64,
              enforce_eager=enforce_eager, cuda_graph_max_batch=8)
    layer = llm.engine.model.layers[1]
    for rows in (1, 3):
        x = torch.zeros(rows, 512, device="cuda", dtype=torch.bfloat16)
        assert ops.choose("add_rms_norm_linear", x, x, layer.input_norm, layer.qkv, 1e-6, None) == "triton"
        assert ops.choose("silu_and_mul_linear", torch.zeros(rows, 2048, device="cuda", dtype=torch.bfloat16),
                          layer.down, None) == "triton"
        assert ops.choose("linear_fp8", x, layer.o, None) == "triton_pdl"
    ref = _hf(_rounded_copy(path, tmp_path / "rounded"), torch.float32)
    gaps = []
    for batch in (PROMPTS[:1], PROMPTS):
        outs = llm.generate(prompt_token_ids=batch,
                            sampling_params=SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        for prompt, out in zip(batch, outs):
            ids = out.outputs[0].token_ids
            with torch.no_grad():
                logits = ref(torch.tensor([prompt + ids], device="cuda")).logits[0]
            gaps += [float(logits[len(prompt) - 1 + t].max() - logits[len(prompt) - 1 + t][token])
                     for t, token in enumerate(ids)]
    assert max(gaps) <= 0.15, f"largest gap below the top logit {max(gaps):.3f} (of {len(gaps)} tokens)"
