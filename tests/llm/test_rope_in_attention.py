"""Decode steps call ``ops.rope_cache_attention_decode`` (rope and the cache write inside the attention
kernel) instead of ``rope_and_cache`` then ``attention_decode`` under ``NINEFOLD_ROPE_IN_ATTENTION=1``.

CPU: the ops-by-ops decode forward (``cpu_fast_decode`` off) gives the same logits either way for
every variant (the vendor implementation is the pair). CUDA: greedy generation token-identical to the
default path, eagerly and from CUDA graphs, and the fused operator is what runs.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from tiny_models import VARIANTS

import ninefold.ops as ops
from ninefold import LLM, SamplingParams
from ninefold.llm.engine import LLMEngine
from ninefold.llm.models.llama import rope_in_attention_wanted

from .test_parity import GREEDY, next_decode_step, prompts_for

PROMPTS = [[5, 9, 33], list(range(40, 57)), [7, 200, 13, 99] * 11]


def _decode_logits(engine, prompts, fold: bool) -> torch.Tensor:
    with next_decode_step(engine, prompts, GREEDY, f"fold{fold}") as step:
        engine.model.rope_in_attention = fold
        return engine.runner.forward_logits(step)


@pytest.mark.parametrize("variant", VARIANTS)
def test_decode_logits_are_the_same_with_the_fold_on_the_cpu(model_dirs, variant, monkeypatch):
    engine = LLMEngine(str(model_dirs[variant]), device="cpu", dtype="float32", block_size=4, num_kv_blocks=64,
                       enable_prefix_caching=False)
    engine.model.cpu_fast_decode = False  # the ops-by-ops forward, where the fold applies
    prompts = prompts_for(engine.model_config.vocab_size, lengths=(5, 23, 9))
    calls = []
    real = ops.rope_cache_attention_decode
    monkeypatch.setattr(ops, "rope_cache_attention_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    unfolded = _decode_logits(engine, prompts, fold=False)
    assert not calls
    folded = _decode_logits(engine, prompts, fold=True)
    assert len(calls) == engine.model_config.num_layers
    assert torch.equal(folded, unfolded)


def test_the_switch_is_read_from_the_environment(model_dirs, monkeypatch):
    monkeypatch.setenv("NINEFOLD_ROPE_IN_ATTENTION", "1")
    assert LLMEngine(str(model_dirs["llama"]), device="cpu", num_kv_blocks=16).model.rope_in_attention
    monkeypatch.setenv("NINEFOLD_ROPE_IN_ATTENTION", "0")
    assert not LLMEngine(str(model_dirs["llama"]), device="cpu", num_kv_blocks=16).model.rope_in_attention
    monkeypatch.delenv("NINEFOLD_ROPE_IN_ATTENTION")
    assert not LLMEngine(str(model_dirs["llama"]), device="cpu", num_kv_blocks=16).model.rope_in_attention
    assert not rope_in_attention_wanted("cpu") and rope_in_attention_wanted("cuda:1")  # unset: on CUDA only
    for setting, expected in (("1", True), ("0", False)):
        monkeypatch.setenv("NINEFOLD_ROPE_IN_ATTENTION", setting)
        assert rope_in_attention_wanted("cpu") is expected and rope_in_attention_wanted("cuda") is expected
    monkeypatch.setenv("NINEFOLD_ROPE_IN_ATTENTION", "yes")
    with pytest.raises(ValueError, match="NINEFOLD_ROPE_IN_ATTENTION: got 'yes'; expected 0 .off. or 1 .on., or unset"):
        LLMEngine(str(model_dirs["llama"]), device="cpu", num_kv_blocks=16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("enforce_eager", [True, False])
@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_greedy_tokens_are_identical_with_the_fold_on_cuda(model_dirs, variant, enforce_eager, dtype, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    tokens = {}
    for fold in ("0", "1"):
        monkeypatch.setenv("NINEFOLD_ROPE_IN_ATTENTION", fold)
        llm = LLM(str(model_dirs[variant]), dtype=dtype, device="cuda", block_size=16, num_kv_blocks=64,
                  enforce_eager=enforce_eager, cuda_graph_max_batch=8)
        assert llm.engine.model.rope_in_attention == (fold == "1")
        assert ops.choose("rope_cache_attention_decode", *_decode_args(llm)) == "triton"
        tokens[fold] = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)]
        del llm
        torch.cuda.empty_cache()
    assert tokens["1"] == tokens["0"]


MIXED_STEP_PROBE = """
import json, sys
import torch
from ninefold.bench.llm import triton_cache_entries
from ninefold.llm.engine import LLMEngine
from ninefold.llm.sampling import SamplingParams

engine = LLMEngine(sys.argv[1], dtype="bfloat16", device="cuda", block_size=16, num_kv_blocks=256,
                   cuda_graph_max_batch=8, enable_prefix_caching=False)
before = triton_cache_entries()
params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
mixed = 0
for i, length in enumerate((5, 40, 9, 17)):  # each new prompt's prefill shares a step with the others' decodes
    engine.add_request(engine.build_request([3 + i] * length, params, f"r{i}"))
    engine.step()
    mixed += sum(1 for s in engine.requests.values() for q in s.seqs if q.num_output_tokens > 1) > 0
while engine.has_unfinished_requests():
    engine.step()
torch.cuda.synchronize()
after = triton_cache_entries()
print(json.dumps({"folded": engine.model.rope_in_attention, "mixed_steps": mixed,
                  "compiled": sorted(n for e in set(after) - set(before) for n in after[e])}))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fold", ["1", "0"])
def test_steps_mixing_decodes_with_prefills_compile_nothing_after_start_up(model_dirs, tmp_path, fold):
    # With the fold, decode graphs no longer run the separate decode attention that mixed steps use; the
    # capture warms it up too. A fresh process with an empty Triton cache: nothing compiled before start-up.
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton"), "NINEFOLD_ROPE_IN_ATTENTION": fold}
    run = subprocess.run([sys.executable, "-c", MIXED_STEP_PROBE, str(model_dirs["llama"])], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["folded"] == (fold == "1") and result["mixed_steps"] >= 1, result
    assert "decode_split_kernel" not in result["compiled"], result


def _decode_args(llm):
    """Arguments of the shape a decode step of ``llm``'s model passes to the fused operator."""
    model = llm.engine.model
    c = model.config
    dt = model.cos_sin.device
    k_cache, v_cache = model.kv_caches[0]
    b = 2
    q = torch.zeros(b, c.num_heads, c.head_dim, dtype=k_cache.dtype, device=dt)
    kv = torch.zeros(b, c.num_kv_heads, c.head_dim, dtype=k_cache.dtype, device=dt)
    index = torch.zeros(b, dtype=torch.int64, device=dt)
    tables = torch.zeros(b, 4, dtype=torch.int32, device=dt)
    return (q, kv, kv, index, model.cos_sin, k_cache, v_cache, index - 1, tables, torch.ones(b, dtype=torch.int32,
                                                                                           device=dt))


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
REPEATS = [[5, 6, 7, 8, 9, 10, 5, 6, 7], [20, 21, 22, 23, 20, 21], [3] * 10]


def test_speculative_drafts_never_take_the_fold(model_dirs, monkeypatch):
    # A draft row reads the keys the rows before it (same sequence) write in the same layer, which the fused
    # kernel does not order: engines with drafts turn the fold off, and draft steps skip it in any case.
    monkeypatch.setenv("NINEFOLD_ROPE_IN_ATTENTION", "1")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = LLM(str(model_dirs["llama"]), device="cpu", dtype="float32", block_size=4, num_kv_blocks=256,
              enable_prefix_caching=False, speculative_config=NGRAM)
    model = llm.engine.model
    assert not model.rope_in_attention
    want = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=REPEATS, sampling_params=params)]
    model.rope_in_attention, model.cpu_fast_decode = True, False  # as if forced on: decode steps without drafts fold
    first_blocks = []
    real = ops.rope_cache_attention_decode
    monkeypatch.setattr(ops, "rope_cache_attention_decode",
                        lambda *a, **k: first_blocks.append(a[8][:, 0].tolist()) or real(*a, **k))
    drafted = llm.engine.num_draft_tokens
    got = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=REPEATS, sampling_params=params)]
    assert llm.engine.num_draft_tokens > drafted  # draft steps ran
    assert got == want
    assert first_blocks and all(len(set(rows)) == len(rows) for rows in first_blocks)  # one row per sequence
