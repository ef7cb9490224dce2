"""LoRA adapters under tensor parallelism: each rank's slices of an adapter, and engines over real worker processes
against transformers + peft."""

import json

import pytest
import torch
from test_lora import GREEDY, ids_of, peft_greedy
from test_parity import prompts_for
from test_tensor_parallel import worker_only_site
from tiny_models import build_model_dir, write_lora_adapter

from ninefold import LLM, LoRARequest, SamplingParams
from ninefold.llm.config import ModelConfig
from ninefold.llm.lora.adapter import load_adapter
from ninefold.llm.parallel import shard_lora, shard_plan, shard_tensors

# (fused matrix, part) -> the HF projection it is a part of
PROJECTIONS = {("qkv", 0): "self_attn.q_proj", ("qkv", 1): "self_attn.k_proj", ("qkv", 2): "self_attn.v_proj",
               ("o", 0): "self_attn.o_proj", ("gate_up", 0): "mlp.gate_proj", ("gate_up", 1): "mlp.up_proj",
               ("down", 0): "mlp.down_proj"}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_parallel")
    out = {}
    # qwen2: q/k/v biases, one key/value head per rank of two; llama_tied: one key/value head, on both ranks
    for variant in ("qwen2", "llama_tied"):
        base = build_model_dir(root / variant, variant)
        out[variant] = base, {
            "all": write_lora_adapter(base, root / f"{variant}-all", r=8, seed=1),
            "qv": write_lora_adapter(base, root / f"{variant}-qv", r=4, seed=2, target_modules=("q_proj", "v_proj"),
                                     use_rslora=True),
        }
    return out


@pytest.mark.parametrize("variant, size", [("qwen2", 2), ("llama_tied", 2), ("llama_tied", 4)])
def test_each_ranks_adapter_slices_merge_into_its_slice_of_the_merged_weights(bases, variant, size):
    """A rank's ``B_r @ A_r`` is its slice of ``B @ A``, cut as the checkpoint's weights are cut: the rows of its
    heads and channels for q/k/v and gate/up, the columns for o and down (whose shares the all-reduce adds up)."""
    base, adapters = bases[variant]
    config = ModelConfig.from_dict(json.loads((base / "config.json").read_text()))
    adapter = load_adapter("all", adapters["all"], config, max_rank=8)
    assert {matrix for _, matrix, _ in adapter.weights} == {"qkv", "o", "gate_up", "down"}
    for rank in range(size):
        plan = shard_plan(config, rank, size)
        shards = shard_lora(adapter.weights, config, plan)
        assert shards.keys() == adapter.weights.keys()
        for (layer, matrix, part), (a, b) in adapter.weights.items():
            name = f"model.layers.{layer}.{PROJECTIONS[(matrix, part)]}.weight"
            expected = shard_tensors({name: b @ a}, config, plan, keep_lm_head=False)[name]
            a_r, b_r = shards[(layer, matrix, part)]
            assert torch.allclose(b_r @ a_r, expected, atol=1e-6), (rank, name)
            for t in (a_r, b_r):  # copies of the slices alone: what a worker is sent is its share, not a view
                assert t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()


@pytest.mark.parametrize("variant", ["qwen2", "llama_tied"])
def test_two_ranks_apply_adapters_mixed_in_one_batch_as_peft_does(bases, variant):
    base, adapters = bases[variant]
    with LLM(str(base), device="cpu", block_size=8, num_kv_blocks=96, tensor_parallel_size=2, enable_lora=True,
             max_loras=2, max_lora_rank=8) as llm:
        assert llm.engine.lora_slots.a["o"].shape[1] * 2 == llm.engine.model_config.hidden_size  # rank 0's half
        prompts = prompts_for(llm.engine.model_config.vocab_size, lengths=(5, 19))
        reqs = {"all": LoRARequest("all", 1, str(adapters["all"])), "qv": LoRARequest("qv", 2, str(adapters["qv"]))}
        mixed = [(name, p) for name in ("all", "qv", None) for p in prompts]
        outs = llm.generate(prompt_token_ids=[p for _, p in mixed], sampling_params=GREEDY,
                            lora_request=[reqs.get(name) for name, _ in mixed])
        expected = [peft_greedy(base, adapters[name] if name else None, p) for name, p in mixed]
        assert len({tuple(e) for e in expected[::2]}) == 3  # each adapter changes the output
        assert ids_of(outs) == expected


def test_adapters_taking_turns_in_one_slot_are_rewritten_on_every_rank(bases):
    """One slot, two adapters: the slot is cleared and written again between their requests on rank 0 and the
    worker alike (a worker that kept the first adapter would give its tokens to the second's requests)."""
    base, adapters = bases["qwen2"]
    with LLM(str(base), device="cpu", block_size=8, num_kv_blocks=96, tensor_parallel_size=2, enable_lora=True,
             max_loras=1, max_lora_rank=8) as llm:
        prompt = prompts_for(llm.engine.model_config.vocab_size, lengths=(7,))[0]
        order = ["qv", "all", "qv", None, "all"]
        reqs = {"all": LoRARequest("all", 1, str(adapters["all"])), "qv": LoRARequest("qv", 2, str(adapters["qv"]))}
        for name in order:  # one call each: every switch rewrites the slot
            out = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY, lora_request=reqs.get(name))
            assert ids_of(out) == [peft_greedy(base, adapters[name] if name else None, prompt)], name
        both = llm.generate(prompt_token_ids=[prompt, prompt], sampling_params=GREEDY,
                            lora_request=[reqs["all"], reqs["qv"]])  # in one call: they wait for the slot in turn
        assert ids_of(both) == [peft_greedy(base, adapters[n], prompt) for n in ("all", "qv")]


def test_two_ranks_of_a_partial_rotary_phi3_apply_an_adapter_on_its_stacked_projections(tmp_path):
    """Phi-3's stacked qkv_proj / gate_up_proj: the adapter's B rows split into parts, then into each rank's heads and
    channels; with a partial rotary embedding q's and k's rows are in the model's order on every rank."""
    base = build_model_dir(tmp_path / "phi3", "phi3", partial_rotary_factor=0.75)
    adapter = write_lora_adapter(base, tmp_path / "stacked", r=8, seed=4,
                                 target_modules=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    with LLM(str(base), device="cpu", enable_lora=True, max_lora_rank=8, block_size=8, num_kv_blocks=64,
             tensor_parallel_size=2) as llm:
        prompts = prompts_for(llm.engine.model_config.vocab_size, lengths=(5, 19))
        expected = [peft_greedy(base, adapter, p) for p in prompts]
        assert expected != [peft_greedy(base, None, p) for p in prompts]
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY,
                            lora_request=LoRARequest("stacked", 1, str(adapter)))
        assert ids_of(outs) == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_apply_adapters_as_peft_does(bases):
    """NCCL between two GPUs for the step (each row's slot in its payload), the adapters' slices sent to the worker
    beside it; float32 so that the tokens are peft's exactly."""
    base, adapters = bases["qwen2"]
    with LLM(str(base), dtype="float32", device="cuda:0", block_size=16, num_kv_blocks=64, tensor_parallel_size=2,
             enable_lora=True, max_loras=1, max_lora_rank=8) as llm:
        prompts = prompts_for(llm.engine.model_config.vocab_size, lengths=(5, 19))
        reqs = {"all": LoRARequest("all", 1, str(adapters["all"])), "qv": LoRARequest("qv", 2, str(adapters["qv"]))}
        mixed = [(name, p) for name in ("all", "qv", None) for p in prompts]
        outs = llm.generate(prompt_token_ids=[p for _, p in mixed], sampling_params=GREEDY,
                            lora_request=[reqs.get(name) for name, _ in mixed])  # one slot: the adapters take turns
        assert ids_of(outs) == [peft_greedy(base, adapters[name] if name else None, p) for name, p in mixed]


def test_a_worker_that_cannot_load_an_adapter_makes_rank_0_raise_naming_it(bases, tmp_path, monkeypatch):
    """The workers acknowledge every slot write: one that fails stops the group (its slots would differ from rank
    0's) and the request's caller gets the worker's error, not a later call's "workers gone"."""
    body = """
    from ninefold.llm.lora.slots import LoRASlots
    def refuse(self, slot, adapter):
        raise RuntimeError("slot memory on fire")
    LoRASlots.place = refuse
    """
    monkeypatch.setenv("PYTHONPATH", worker_only_site(tmp_path, body))
    base, adapters = bases["qwen2"]
    with LLM(str(base), device="cpu", block_size=8, num_kv_blocks=96, tensor_parallel_size=2, enable_lora=True,
             max_lora_rank=8) as llm:
        prompt = prompts_for(llm.engine.model_config.vocab_size, lengths=(7,))[0]
        assert ids_of(llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY)) == [peft_greedy(base, None,
                                                                                                       prompt)]
        with pytest.raises(RuntimeError, match=r"load a LoRA adapter into slot 0: rank 1: RuntimeError: slot memory "
                                               "on fire"):
            llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY,
                         lora_request=LoRARequest("all", 1, str(adapters["all"])))
        with pytest.raises(RuntimeError, match="group stopped after an error: tensor-parallel workers failed to load"):
            llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY)


def test_two_ranks_under_adapters_give_one_devices_logprobs_beams_and_embeddings(bases):
    """Prompt logprobs, beam search and embeddings under adapters: the same on two ranks as on one device."""
    from ninefold import BeamSearchParams

    base, adapters = bases["qwen2"]
    reqs = [LoRARequest("all", 1, str(adapters["all"])), LoRARequest("qv", 2, str(adapters["qv"])), None]
    logprobs = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=2, logprobs=2)
    got = []
    for size in (1, 2):
        with LLM(str(base), device="cpu", block_size=8, num_kv_blocks=96, tensor_parallel_size=size, enable_lora=True,
                 max_loras=2, max_lora_rank=8) as llm:
            prompts = prompts_for(llm.engine.model_config.vocab_size, lengths=(5, 19, 12))
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=logprobs, lora_request=reqs)
            beams = llm.beam_search([{"prompt_token_ids": prompts[1]}], BeamSearchParams(beam_width=3, max_tokens=6,
                                                                                          ignore_eos=True),
                                    lora_request=reqs[0])
            embeddings = llm.embed(prompt_token_ids=prompts, lora_request=reqs)
            got.append(([o.outputs[0].token_ids for o in outs], [o.prompt_logprobs for o in outs],
                        [s.tokens for s in beams[0].sequences],
                        torch.tensor([e.outputs.embedding for e in embeddings])))
    (ids1, plp1, beams1, emb1), (ids2, plp2, beams2, emb2) = got
    assert ids2 == ids1 and beams2 == beams1
    for one, two in zip(plp1, plp2):
        assert len(one) == len(two)
        for a, b in zip(one, two):
            assert (a is None) == (b is None)
            if a is not None:
                assert a.keys() == b.keys()
                assert all(abs(a[t] - b[t]) < 1e-4 for t in a)
    assert torch.allclose(emb2, emb1, atol=1e-5)


def test_two_ranks_speculate_chunk_and_preempt_under_adapters_as_peft_decodes(bases):
    """n-gram drafts, a prefill chunked into 8-token steps and preemptions from a 16-block pool, with adapters and
    without in one batch: every request's tokens are still peft's greedy ones."""
    base, adapters = bases["qwen2"]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    with LLM(str(base), device="cpu", block_size=4, num_kv_blocks=16, max_num_batched_tokens=8, max_num_seqs=4,
             tensor_parallel_size=2, enable_lora=True, max_loras=1, max_lora_rank=8, speculative_config=spec) as llm:
        motif = prompts_for(llm.engine.model_config.vocab_size, lengths=(6,), seed=11)[0]
        prompts = [motif * 3, *prompts_for(llm.engine.model_config.vocab_size, lengths=(5, 19))]
        names = ["all", "all", None]
        reqs = {"all": LoRARequest("all", 1, str(adapters["all"]))}
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, lora_request=[reqs.get(n) for n in names])
        assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.num_draft_tokens > 0
        assert ids_of(outs) == [peft_greedy(base, adapters[n] if n else None, p) for n, p in zip(names, prompts)]
