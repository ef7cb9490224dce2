"""LoRA adapters (``LoRARequest``): greedy generation against transformers + peft, adapters mixed in one batch,
the prefix cache kept per adapter, slots shared by more adapters than fit, and every error case."""

import json
import re

import pytest
import torch
from test_parity import prompts_for
from tiny_models import build_model_dir, write_lora_adapter
from transformers import AutoModelForCausalLM

from ninefold import LLM, LoRARequest, SamplingParams

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = build_model_dir(root / "base", "qwen2")  # q/k/v biases and tied embeddings
    adapters = {
        "all": write_lora_adapter(base, root / "all", r=8, seed=1),
        # q and v only, rsLoRA scaling, a per-module alpha and rank as peft writes them
        "qv": write_lora_adapter(base, root / "qv", r=4, seed=2, target_modules=("q_proj", "v_proj"),
                                 use_rslora=True, alpha_pattern={"v_proj": 4}, rank_pattern={"q_proj": 2}),
        "mlp": write_lora_adapter(base, root / "mlp", r=16, seed=3, target_modules=("gate_proj", "down_proj")),
    }
    return base, adapters


_references: dict = {}


def peft_greedy(base, adapter, prompt, new_tokens=NEW_TOKENS) -> list[int]:
    """transformers + peft's greedy continuation of ``prompt`` under ``adapter`` (None: the base model)."""
    key = (str(base), str(adapter), tuple(prompt), new_tokens)
    if key not in _references:
        from peft import PeftModel

        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        if adapter is not None:
            model = PeftModel.from_pretrained(model, adapter)
        model.eval()
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        _references[key] = out[0, len(prompt):].tolist()
    return _references[key]


def ids_of(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def request(adapters, name: str, lora_id: int) -> LoRARequest:
    return LoRARequest(name, lora_id, str(adapters[name]))


def test_each_adapter_matches_peft_alone_and_mixed_in_one_batch(setup):
    base, adapters = setup
    llm = LLM(str(base), device="cpu", enable_lora=True, max_loras=3, max_lora_rank=16, block_size=8,
              num_kv_blocks=96)
    prompts = prompts_for(llm.engine.model_config.vocab_size, lengths=(5, 19))
    names = ["all", "qv", "mlp"]
    reqs = {name: request(adapters, name, i + 1) for i, name in enumerate(names)}
    expected = {name: [peft_greedy(base, adapters[name], p) for p in prompts] for name in names}
    expected[None] = [peft_greedy(base, None, p) for p in prompts]
    assert len({tuple(map(tuple, v)) for v in expected.values()}) == 4  # every adapter changes the output
    for name in names:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, lora_request=reqs[name])
        assert ids_of(outs) == expected[name], name
        assert all(o.lora_request == reqs[name] for o in outs)
    # every adapter and the base model in one call: the same tokens as each alone
    mixed = [(name, p, i) for name in [*names, None] for i, p in enumerate(prompts)]
    outs = llm.generate(prompt_token_ids=[p for _, p, _ in mixed], sampling_params=GREEDY,
                        lora_request=[reqs.get(name) for name, _, _ in mixed])
    assert ids_of(outs) == [expected[name][i] for name, _, i in mixed]


def test_chunked_prefill_preemption_and_logprobs_under_an_adapter(setup):
    base, adapters = setup
    lora = request(adapters, "all", 7)
    prompts = prompts_for(320, lengths=(29, 41, 13), seed=3)
    expected = [peft_greedy(base, adapters["all"], p) for p in prompts]
    # 16-token budget: prompts are prefilled in chunks; 20 blocks of 4 for three 45-73-token sequences: preemption
    llm = LLM(str(base), device="cpu", enable_lora=True, max_lora_rank=8, block_size=4, num_kv_blocks=20,
              max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, lora_request=lora)
    assert ids_of(outs) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    # each sampled token's logprob is the adapted model's (float32 tolerance)
    from peft import PeftModel

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                      adapters["all"]).eval()
    full = prompts[0] + expected[0]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([full])).logits[0].log_softmax(-1)
    want = [logits[len(prompts[0]) - 1 + j, t].item() for j, t in enumerate(expected[0])]
    got = [entry[t] for entry, t in zip(outs[0].outputs[0].logprobs, expected[0])]
    assert got == pytest.approx(want, abs=2e-4)


def test_speculative_drafts_under_adapters_keep_the_plain_tokens(setup):
    """ngram drafts verified in decode rows that carry their sequence's adapter: the tokens of plain decoding."""
    base, adapters = setup
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    llm = LLM(str(base), device="cpu", enable_lora=True, max_loras=2, max_lora_rank=8, block_size=8,
              num_kv_blocks=96, speculative_config=spec)
    motif = prompts_for(320, lengths=(6,), seed=11)[0]
    prompts = [motif * 4, motif * 3 + motif[:2]]
    names = ["all", "qv"]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY,
                        lora_request=[request(adapters, n, i + 1) for i, n in enumerate(names)])
    assert ids_of(outs) == [peft_greedy(base, adapters[n], p) for n, p in zip(names, prompts)]
    assert llm.engine.num_draft_tokens > 0


def test_prefix_cache_is_kept_per_adapter(setup):
    base, adapters = setup
    llm = LLM(str(base), device="cpu", enable_lora=True, max_loras=2, max_lora_rank=8, block_size=4,
              num_kv_blocks=64)
    prompt = prompts_for(320, lengths=(26,), seed=5)[0]
    one = request(adapters, "all", 1)
    plain = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY)[0]
    first = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY, lora_request=one)[0]
    again = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY, lora_request=one)[0]
    other = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY,
                         lora_request=request(adapters, "qv", 2))[0]
    assert plain.num_cached_tokens == 0 and first.num_cached_tokens == 0 and other.num_cached_tokens == 0
    assert again.num_cached_tokens == 24  # six full blocks, computed under the same adapter
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == peft_greedy(base, adapters["all"], prompt)
    assert other.outputs[0].token_ids == peft_greedy(base, adapters["qv"], prompt)
    assert plain.outputs[0].token_ids == peft_greedy(base, None, prompt)


def test_more_adapters_than_slots_take_turns(setup):
    base, adapters = setup
    llm = LLM(str(base), device="cpu", enable_lora=True, max_loras=1, max_lora_rank=16, block_size=8,
              num_kv_blocks=64)
    prompts = prompts_for(320, lengths=(7, 11, 9, 15), seed=7)
    names = ["mlp", "all", None, "mlp"]
    reqs = [request(adapters, n, {"all": 1, "mlp": 2}[n]) if n else None for n in names]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, lora_request=reqs)
    assert ids_of(outs) == [peft_greedy(base, adapters[n] if n else None, p) for n, p in zip(names, prompts)]
    slots = llm.engine.lora_slots
    assert slots.refs == [0]  # every sequence gave its slot back


def test_errors_name_the_argument(setup, tmp_path):
    base, adapters = setup
    plain = LLM(str(base), device="cpu", block_size=8, num_kv_blocks=16)
    with pytest.raises(ValueError, match="enable_lora=True"):
        plain.generate([[5, 6, 7]], GREEDY, lora_request=request(adapters, "all", 1))
    llm = LLM(str(base), device="cpu", enable_lora=True, max_lora_rank=8, block_size=8, num_kv_blocks=16)
    with pytest.raises(ValueError, match="rank 16 .*max_lora_rank=8"):
        llm.generate([[5, 6, 7]], GREEDY, lora_request=request(adapters, "mlp", 3))
    with pytest.raises(ValueError, match="lora_path: .* is not a directory"):
        llm.generate([[5, 6, 7]], GREEDY, lora_request=LoRARequest("gone", 4, str(tmp_path / "missing")))
    with pytest.raises(ValueError, match="lora_request.lora_int_id"):
        LoRARequest("zero", 0, str(adapters["all"]))
    with pytest.raises(ValueError, match="lora_request.lora_name"):
        LoRARequest("", 1, str(adapters["all"]))
    with pytest.raises(TypeError, match="lora_request: expected a LoRARequest"):
        llm.generate([[5, 6, 7]], GREEDY, lora_request="all")
    with pytest.raises(ValueError, match="lora_request: 1 given for 2 prompts"):
        llm.generate([[5, 6, 7], [8, 9]], GREEDY, lora_request=[request(adapters, "all", 1)])
    llm.generate([[5, 6, 7]], GREEDY, lora_request=request(adapters, "all", 1))
    with pytest.raises(ValueError, match="lora_int_id: 1 already names adapter 'all'"):
        llm.generate([[5, 6, 7]], GREEDY, lora_request=LoRARequest("other", 1, str(adapters["qv"])))
    # an adapter of another model (hidden size 32), one that trains the embedding, one without tensors
    other_base = build_model_dir(tmp_path / "other", "llama", hidden_size=32, intermediate_size=64)
    with pytest.raises(ValueError, match=r"down_proj lora_A \(4, 64\) and lora_B \(32, 4\); this model needs \[r, 128\] and \[64, r\] \(another base model"):
        llm.generate([[5]], GREEDY, lora_request=LoRARequest("x", 5, str(write_lora_adapter(
            other_base, tmp_path / "small", r=4))))
    with pytest.raises(ValueError, match="embed_tokens.*only LoRA matrices of the decoder's projections"):
        llm.generate([[5]], GREEDY, lora_request=LoRARequest("e", 6, str(write_lora_adapter(
            base, tmp_path / "embed", r=4, target_modules=("q_proj", "embed_tokens")))))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora=True, which is not supported"):
        llm.generate([[5]], GREEDY, lora_request=LoRARequest("d", 7, str(broken)))
    (broken / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    with pytest.raises(ValueError, match="neither adapter_model.safetensors nor adapter_model.bin"):
        llm.generate([[5]], GREEDY, lora_request=LoRARequest("d", 7, str(broken)))
    for field, value, match in (("max_loras", 0, "max_loras: got 0"), ("max_lora_rank", -1, "max_lora_rank"),
                                ("enable_lora", "yes", "enable_lora: got 'yes'")):
        with pytest.raises(ValueError, match=match):
            LLM(str(base), device="cpu", **{field: value})
    # the engine is unharmed: the good adapter still generates
    out = llm.generate([[5, 6, 7]], GREEDY, lora_request=request(adapters, "all", 1))
    assert out[0].outputs[0].token_ids == peft_greedy(base, adapters["all"], [5, 6, 7])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_adapters_on_cuda_match_peft_beside_graph_steps(setup):
    """On a GPU, decode steps with adapter rows replay the adapters' CUDA graphs and base-only steps the base
    graphs; both agree with peft, also after an adapter is swapped into a slot the graphs were captured with."""
    base, adapters = setup
    llm = LLM(str(base), device="cuda", dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
              block_size=8, num_kv_blocks=128)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.lora_runner is not None
    replays = {"adapters": 0, "base": 0}
    run = graphs.run

    def counting_run(*args):
        replays["base" if args[5] is None else "adapters"] += 1
        return run(*args)

    graphs.run = counting_run
    prompts = prompts_for(llm.engine.model_config.vocab_size, lengths=(5, 19, 33))
    names = ["all", None, "mlp"]
    reqs = [request(adapters, n, i + 1) if n else None for i, n in enumerate(names)]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, lora_request=reqs)
    assert ids_of(outs) == [peft_greedy(base, adapters[n] if n else None, p) for n, p in zip(names, prompts)]
    assert replays["adapters"] > 0, replays
    before = dict(replays)
    alone = llm.generate(prompt_token_ids=prompts[1:2], sampling_params=GREEDY)  # base graphs only
    assert ids_of(alone) == [peft_greedy(base, None, prompts[1])]
    assert replays["adapters"] == before["adapters"] and replays["base"] > before["base"], replays
    # a third adapter takes a slot of the two above: the same graphs read the new weights
    before = dict(replays)
    third = llm.generate(prompt_token_ids=prompts[:1], sampling_params=GREEDY, lora_request=request(adapters, "qv", 7))
    assert ids_of(third) == [peft_greedy(base, adapters["qv"], prompts[0])]
    assert replays["adapters"] > before["adapters"], replays


def test_embeddings_under_adapters_match_peft_hidden_states(setup):
    """LLM.embed with an adapter per prompt (one slot: the step splits where a second adapter would need one):
    each vector is peft's final hidden state at the last token under that adapter, normalized."""
    from peft import PeftModel

    base, adapters = setup
    llm = LLM(str(base), device="cpu", enable_lora=True, max_loras=1, max_lora_rank=16, block_size=8,
              num_kv_blocks=32)
    prompts = prompts_for(320, lengths=(7, 12, 5, 9), seed=13)
    names = ["all", None, "mlp", "all"]
    loras = [request(adapters, n, {"all": 1, "mlp": 3}[n]) if n else None for n in names]
    got = [o.outputs.embedding for o in llm.embed(prompt_token_ids=prompts, lora_request=loras)]
    for name, prompt, vector in zip(names, prompts, got):
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        if name is not None:
            model = PeftModel.from_pretrained(model, adapters[name])
        with torch.no_grad():
            hidden = model(input_ids=torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0, -1]
        want = torch.nn.functional.normalize(hidden, dim=0)
        torch.testing.assert_close(torch.tensor(vector), want, atol=2e-5, rtol=0)
    assert llm.engine.lora_slots.refs == [0]
    with pytest.raises(ValueError, match="lora_request: 1 given for 4 prompts"):
        llm.embed(prompt_token_ids=prompts, lora_request=loras[:1])


@pytest.mark.parametrize("partial", [None, 0.75])
def test_a_phi3_adapter_on_its_stacked_projections_matches_peft(tmp_path, partial):
    """Phi-3 stores q/k/v and gate/up stacked (qkv_proj, gate_up_proj): an adapter on those splits its B rows over
    the parts; with a partial rotary embedding (Phi-4-mini) q's and k's B rows follow the model's row order."""
    base = build_model_dir(tmp_path / "phi3", "phi3", **({"partial_rotary_factor": partial} if partial else {}))
    adapter = write_lora_adapter(base, tmp_path / "stacked", r=8, seed=4,
                                 target_modules=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    llm = LLM(str(base), device="cpu", enable_lora=True, max_lora_rank=8, block_size=8, num_kv_blocks=64)
    prompts = prompts_for(llm.engine.model_config.vocab_size, lengths=(5, 19))
    expected = [peft_greedy(base, adapter, p) for p in prompts]
    assert expected != [peft_greedy(base, None, p) for p in prompts]  # the adapter changes the output
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY,
                        lora_request=LoRARequest("stacked", 1, str(adapter)))
    assert ids_of(outs) == expected


def test_an_adapter_for_the_other_layout_is_refused(setup, tmp_path):
    """A Phi-3 adapter (stacked qkv_proj) on a Qwen2 base, and a Qwen2 adapter (q_proj, ...) on a Phi-3 base."""
    base, adapters = setup
    phi3 = build_model_dir(tmp_path / "phi3", "phi3")
    stacked = write_lora_adapter(phi3, tmp_path / "stacked", r=4, target_modules=("qkv_proj",))
    for model, adapter, words in ((base, stacked, "a Qwen2ForCausalLM does not have (it stores q/k/v and gate/up "
                                                   "separately)"),
                                  (phi3, adapters["all"], "a Phi3ForCausalLM does not have (it stores q/k/v and "
                                                          "gate/up stacked)")):
        llm = LLM(str(model), device="cpu", enable_lora=True, max_lora_rank=16, num_kv_blocks=32)
        with pytest.raises(ValueError, match=re.escape(words) + "; an adapter for another base model"):
            llm.generate(["hi"], GREEDY, lora_request=LoRARequest("x", 1, str(adapter)))
