"""Phi-3 specifics beyond the parity tests' plain variant: longrope scaling (Phi-3.5, the 128k Phi-3 models)."""

import pytest
import torch
from test_parity import _hf_model, hf_greedy, prompts_for
from tiny_models import build_model_dir

from ninefold import LLM, SamplingParams
from ninefold.llm.engine import LLMEngine

LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
            "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 13.0, 18.0]}
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def longrope_dir(tmp_path_factory):
    """A tiny Phi-3 pretrained on 64 positions and stretched to 512 with longrope (attention factor sqrt(1.5))."""
    return build_model_dir(tmp_path_factory.mktemp("phi3") / "longrope", "phi3", rope_parameters=LONGROPE,
                           original_max_position_embeddings=64, max_position_embeddings=512)


@pytest.mark.parametrize("max_model_len, lengths", [(64, (3, 17)), (None, (70, 100))])
def test_longrope_matches_transformers_below_and_above_the_pretraining_context(longrope_dir, max_model_len, lengths):
    """With a context of at most the pretraining one the short factors run, as transformers runs sequences that
    short; beyond it the long factors, as transformers runs sequences longer than it."""
    llm = LLM(str(longrope_dir), device="cpu", max_model_len=max_model_len, num_kv_blocks=64)
    prompts = prompts_for(llm.engine.model_config.vocab_size, lengths=lengths)
    got = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]
    assert got == [hf_greedy(longrope_dir, p) for p in prompts]


def test_longrope_logits_carry_the_attention_factor(longrope_dir):
    engine = LLMEngine(str(longrope_dir), device="cpu", num_kv_blocks=64, enable_prefix_caching=False)
    scaling = engine.model_config.rope_scaling
    assert scaling["attention_factor"] == pytest.approx((1 + torch.log(torch.tensor(8.0)) /
                                                         torch.log(torch.tensor(64.0))).sqrt().item())
    prompt = prompts_for(engine.model_config.vocab_size, lengths=(90,))[0]
    engine.add_request(engine.build_request(prompt, GREEDY, "r"))
    logits = engine.runner.forward_logits(engine.scheduler.schedule())[0]
    with torch.no_grad():
        ref = _hf_model(longrope_dir)(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(logits, ref, atol=2e-5, rtol=1e-4)


def test_a_longrope_config_without_its_factors_is_refused(tmp_path):
    from ninefold.llm.config import ModelConfig

    config = dict(architectures=["Phi3ForCausalLM"], hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_hidden_layers=1, vocab_size=50, original_max_position_embeddings=64,
                  rope_scaling={**LONGROPE, "long_factor": [1.0] * 7})
    with pytest.raises(ValueError, match=r"rope_scaling: rope_type 'longrope' needs long_factor, 8 positive finite "
                                         r"numbers \(one per rotated pair of head dimensions\); got 7 values"):
        ModelConfig.from_dict(config)
    with pytest.raises(ValueError, match="original_max_position_embeddings: got 0; expected a positive integer"):
        ModelConfig.from_dict({**config, "rope_scaling": LONGROPE, "original_max_position_embeddings": 0})


def test_older_and_partial_longrope_configs_read_as_transformers_reads_them():
    """Phi-3's older rope type names ("su", "yarn"), a missing original_max_position_embeddings (Phi-3's default
    4096) and an explicit factor, each against transformers' own reading of the same config."""
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from ninefold.llm.config import ModelConfig

    factors = {"short_factor": LONGROPE["short_factor"], "long_factor": LONGROPE["long_factor"]}
    cases = [dict(rope_scaling={"type": "su", **factors}, original_max_position_embeddings=64),
             dict(rope_scaling={"type": "yarn", **factors}, original_max_position_embeddings=64),
             dict(rope_scaling={"rope_type": "longrope", **factors}),
             dict(rope_scaling={"rope_type": "longrope", "factor": 16.0, **factors}, original_max_position_embeddings=64)]
    for extra in cases:
        config = dict(architectures=["Phi3ForCausalLM"], model_type="phi3", hidden_size=64, intermediate_size=128,
                      num_attention_heads=4, num_hidden_layers=1, vocab_size=50, max_position_embeddings=131072,
                      **extra)
        ours = ModelConfig.from_dict(config).rope_scaling
        hf = Phi3Config(**{k: v for k, v in config.items() if k != "architectures"})
        inv_freq, attention = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=131072)
        assert ours["attention_factor"] == pytest.approx(attention, rel=1e-6), extra
        long = torch.tensor(ours["long_factor"])
        assert torch.allclose(1.0 / (long * 10000.0 ** (torch.arange(0, 16, 2).float() / 16)), inv_freq), extra


def test_cached_keys_rotated_with_the_other_longrope_factors_are_not_imported(longrope_dir):
    """Engines of one longrope model with contexts on either side of the pretraining one rotate keys differently:
    KV blocks exported by one are refused by the other (a ValueError, not silently mixed), taken by a twin."""
    from ninefold.llm.disagg.kv_transfer import export_prefix, import_prefix

    prompt = list(range(3, 40))
    short = LLM(str(longrope_dir), device="cpu", max_model_len=64, num_kv_blocks=32)
    short.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(temperature=0, max_tokens=1))
    prefix = export_prefix(short.engine, prompt)
    assert len(prefix.blocks) == 2 and prefix.rope == short.engine.rope_fingerprint
    long = LLM(str(longrope_dir), device="cpu", num_kv_blocks=32)
    assert long.engine.rope_fingerprint != short.engine.rope_fingerprint
    with pytest.raises(ValueError, match="prefix: its keys were rotated with another rotary table than the receiving "
                                         "engine's"):
        import_prefix(long.engine, prefix)
    twin = LLM(str(longrope_dir), device="cpu", max_model_len=64, num_kv_blocks=32)
    assert import_prefix(twin.engine, prefix) == 2


def test_a_pool_smaller_than_the_pretraining_context_runs_the_short_factors(longrope_dir):
    """No sequence can outgrow a 64-token pool, so the engine runs what transformers runs for sequences that short
    (the short factors), though the configured context (512) is longer; its fingerprint says so."""
    capped = LLM(str(longrope_dir), device="cpu", block_size=16, num_kv_blocks=4)
    assert capped.engine.max_model_len == 64
    short = LLM(str(longrope_dir), device="cpu", max_model_len=64, num_kv_blocks=4)
    assert capped.engine.rope_fingerprint == short.engine.rope_fingerprint
    assert torch.equal(capped.engine.model.cos_sin[:64], short.engine.model.cos_sin[:64])
    assert capped.engine.model.cos_sin.shape[0] == 512  # the table still covers embedding steps of any length
    prompts = prompts_for(capped.engine.model_config.vocab_size, lengths=(3, 17))
    got = [o.outputs[0].token_ids for o in capped.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]
    assert got == [hf_greedy(longrope_dir, p) for p in prompts]


@pytest.fixture(scope="module")
def partial_dir(tmp_path_factory):
    """A tiny Phi-4-mini-like model: longrope over the first three quarters of each head."""
    return build_model_dir(tmp_path_factory.mktemp("phi4") / "partial", "phi3", partial_rotary_factor=0.75,
                           rope_parameters={**LONGROPE, "short_factor": LONGROPE["short_factor"][:6],
                                            "long_factor": LONGROPE["long_factor"][:6], "partial_rotary_factor": 0.75},
                           original_max_position_embeddings=64, max_position_embeddings=512)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("enforce_eager", [True, False])
@pytest.mark.parametrize("model, max_model_len, lengths", [("longrope", 64, (3, 17)), ("longrope", None, (70, 100)),
                                                           ("partial", None, (70, 100))])
def test_longrope_on_cuda_matches_transformers_on_cuda(longrope_dir, partial_dir, enforce_eager, model, max_model_len,
                                                       lengths):
    """The scaled cos/sin table of either regime (and over part of the head), eagerly and replayed from CUDA graphs,
    in float32 against transformers on the same card."""
    from transformers import AutoModelForCausalLM

    path = longrope_dir if model == "longrope" else partial_dir
    llm = LLM(str(path), dtype="float32", device="cuda", max_model_len=max_model_len, num_kv_blocks=64,
              enforce_eager=enforce_eager, cuda_graph_max_batch=4)
    prompts = prompts_for(llm.engine.model_config.vocab_size, lengths=lengths)
    got = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to("cuda").eval()
    model.generation_config.eos_token_id = None
    for prompt, tokens in zip(prompts, got):
        ids = torch.tensor([prompt], device="cuda")
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(tokens), do_sample=False,
                             pad_token_id=0)
        assert tokens == ref[0, len(prompt):].tolist()


@pytest.mark.parametrize("partial, rope", [(0.75, None), (0.5, None), (0.75, "longrope")])
def test_a_partial_rotary_embedding_matches_transformers(tmp_path, partial, rope):
    """Phi-4-mini rotates the first three quarters of each head: the engine stores q's and k's rows so that the
    rotated pairs are its kernels' pairs and the others pass (cos 1, sin 0), which changes no attention score."""
    extra = {}
    if rope == "longrope":
        pairs = int(16 * partial) // 2
        extra = dict(rope_parameters={**LONGROPE, "short_factor": LONGROPE["short_factor"][:pairs],
                                      "long_factor": LONGROPE["long_factor"][:pairs], "partial_rotary_factor": partial},
                     original_max_position_embeddings=64, max_position_embeddings=512)
    path = build_model_dir(tmp_path / "partial", "phi3", partial_rotary_factor=partial, **extra)
    llm = LLM(str(path), device="cpu", num_kv_blocks=64)
    config = llm.engine.model_config
    assert config.rotated_dim == int(16 * partial) and llm.engine.model.cos_sin.shape[1] == 16
    lengths = (70, 100) if rope else (3, 17, 40)
    prompts = prompts_for(config.vocab_size, lengths=lengths)
    got = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]
    assert got == [hf_greedy(path, p) for p in prompts]
    engine = LLMEngine(str(path), device="cpu", num_kv_blocks=64, enable_prefix_caching=False)
    engine.add_request(engine.build_request(prompts[0], GREEDY, "r"))
    logits = engine.runner.forward_logits(engine.scheduler.schedule())[0]
    with torch.no_grad():
        ref = _hf_model(path)(torch.tensor([prompts[0]])).logits[0, -1]
    torch.testing.assert_close(logits, ref, atol=2e-5, rtol=1e-4)


def test_keys_rotated_over_part_of_the_head_carry_another_fingerprint(tmp_path):
    from ninefold.llm.config import ModelConfig, rope_fingerprint

    config = dict(architectures=["Phi3ForCausalLM"], hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_hidden_layers=1, vocab_size=50)
    full = ModelConfig.from_dict(config)
    partial = ModelConfig.from_dict({**config, "partial_rotary_factor": 0.75})
    assert rope_fingerprint(full, 512) != rope_fingerprint(partial, 512)
    assert rope_fingerprint(full, 512) == rope_fingerprint(ModelConfig.from_dict({**config, "partial_rotary_factor": 1.0}),
                                                           512)


def test_a_rotary_count_given_exactly_is_taken_as_it_is():
    """A GGUF's rope.dimension_count (carried as ninefold_rotary_dim): 60 of 88, which the factor 60 / 88 would give
    as int(59.99...) = 59; an odd or oversized count is refused naming the key."""
    from ninefold.llm.config import ModelConfig

    config = dict(architectures=["Phi3ForCausalLM"], hidden_size=88 * 2, intermediate_size=64, num_attention_heads=2,
                  num_hidden_layers=1, vocab_size=50, partial_rotary_factor=60 / 88)
    assert ModelConfig.from_dict({**config, "ninefold_rotary_dim": 60}).rotated_dim == 60
    for bad, message in ((59, "rope.dimension_count: got 59, which rotates 59 of the head's 88 dimensions"),
                         (90, r"rope.dimension_count: got 90; expected 1..88 \(the head size\)")):
        with pytest.raises(ValueError, match=message):
            ModelConfig.from_dict({**config, "ninefold_rotary_dim": bad})
