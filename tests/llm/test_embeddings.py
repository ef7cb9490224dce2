"""Embeddings (``LLM.embed``): tiny decoder-only checkpoints saved as embedding models are (transformers' base
classes, names without ``model.``, no output layer), checked against transformers' hidden states, pooled."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import write_embedding_model

from ninefold.llm.api import LLM
from ninefold.llm.pooling import PoolingParams

PROMPTS = ["Hello world!", "Paris is the capital of France, and Berlin is the capital of Germany.",
           "The quick brown fox", "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000; symbols: + - * / = < > ( ) [ ]"]


def reference(path, token_ids: list[list[int]], pooling: str, normalize: bool, dimensions=None) -> np.ndarray:
    """transformers' hidden states of each prompt alone, pooled in float64."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for ids in token_ids:
            hidden = model(input_ids=torch.tensor([ids])).last_hidden_state[0].double()
            row = {"last": hidden[-1], "cls": hidden[0], "mean": hidden.mean(0)}[pooling][:dimensions]
            rows.append(torch.nn.functional.normalize(row, dim=0) if normalize else row)
    return torch.stack(rows).numpy()


@pytest.fixture(scope="module")
def qwen3_embedding(tmp_path_factory):
    """Decoder alone, config.json naming Qwen3ForCausalLM, untied: loads without an output layer."""
    return write_embedding_model(tmp_path_factory.mktemp("emb") / "qwen3", architecture="Qwen3ForCausalLM",
                                 is_matryoshka=True)


def embed(llm, prompts, params=None):
    outputs = llm.embed(prompts, params)
    return np.array([o.outputs.embedding for o in outputs]), outputs


def test_last_token_pooling_matches_transformers_in_packed_batches(qwen3_embedding):
    """Four prompts of different lengths, packed into steps of at most 64 tokens (several steps)."""
    llm = LLM(str(qwen3_embedding), device="cpu", max_num_batched_tokens=64)
    got, outputs = embed(llm, PROMPTS)
    ids = [o.prompt_token_ids for o in outputs]
    assert [len(i) for i in ids] == [len(llm.tokenizer.encode(p)) for p in PROMPTS]
    assert len(list(llm.engine.embedder.batches([llm.engine.embedder.build_request(p) for p in PROMPTS]))) > 1
    np.testing.assert_allclose(got, reference(qwen3_embedding, ids, "last", True), atol=2e-5)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert outputs[0].outputs.hidden_size == 64 and all(o.finished for o in outputs)


def test_options_normalize_dimensions_truncation(qwen3_embedding):
    llm = LLM(str(qwen3_embedding), device="cpu")
    ids = [o.prompt_token_ids for o in llm.embed(PROMPTS)]
    raw, _ = embed(llm, PROMPTS, PoolingParams(normalize=False))
    np.testing.assert_allclose(raw, reference(qwen3_embedding, ids, "last", False), rtol=2e-5, atol=2e-5)
    short, _ = embed(llm, PROMPTS, PoolingParams(dimensions=16))  # Matryoshka: first 16 values, normalized
    np.testing.assert_allclose(short, reference(qwen3_embedding, ids, "last", True, dimensions=16), atol=2e-5)
    kept, outs = embed(llm, [PROMPTS[1]], PoolingParams(truncate_prompt_tokens=5))
    assert outs[0].prompt_token_ids == ids[1][-5:]
    np.testing.assert_allclose(kept, reference(qwen3_embedding, [ids[1][-5:]], "last", True), atol=2e-5)
    per_prompt = llm.embed(PROMPTS[:2], [PoolingParams(dimensions=8), PoolingParams()])
    assert [o.outputs.hidden_size for o in per_prompt] == [8, 64]


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_sentence_transformers_pooling_config_is_followed(tmp_path, pooling):
    """modules.json names the Pooling module: its mode is used; without a Normalize module vectors stay raw."""
    path = write_embedding_model(tmp_path / pooling, variant="llama", pooling=pooling, normalize=False)
    llm = LLM(str(path), device="cpu")
    assert llm.engine.embedder.pooler.pooling_type == pooling.upper()
    got, outputs = embed(llm, PROMPTS)
    want = reference(path, [o.prompt_token_ids for o in outputs], pooling, normalize=False)
    np.testing.assert_allclose(got, want, rtol=3e-5, atol=3e-5)
    # The engine argument wins over the files; normalize per request.
    last = LLM(str(path), device="cpu", pooling_type="last")
    got, _ = embed(last, PROMPTS, PoolingParams(normalize=True))
    np.testing.assert_allclose(got, reference(path, [o.prompt_token_ids for o in outputs], "last", True), atol=2e-5)


def test_base_architecture_checkpoint_embeds_but_does_not_generate(tmp_path):
    """config.json naming MistralModel (as e5-mistral's does), no output layer."""
    path = write_embedding_model(tmp_path / "mistral", variant="mistral")
    llm = LLM(str(path), device="cpu")
    assert not llm.engine.model_config.has_lm_head
    got, outputs = embed(llm, PROMPTS[:2])
    np.testing.assert_allclose(got, reference(path, [o.prompt_token_ids for o in outputs], "last", True), atol=2e-5)
    with pytest.raises(ValueError, match="output layer"):
        llm.generate(["Hello"])
    # no memory for a KV cache it never uses; its prompts may still fill the rotary table
    assert llm.engine.pool.num_blocks == 1 and llm.engine.max_model_len == 512
    assert llm.engine.embedder.max_prompt_tokens == 512


def test_generative_checkpoint_embeds_too(model_dirs):
    """A tied chat model (its ``model.``-prefixed checkpoint) keeps generating and embeds from the same weights."""
    llm = LLM(str(model_dirs["llama_tied"]), device="cpu")
    got, outputs = embed(llm, PROMPTS[:3])
    np.testing.assert_allclose(got, reference(model_dirs["llama_tied"], [o.prompt_token_ids for o in outputs],
                                              "last", True), atol=2e-5)
    assert llm.generate(["Hello"])[0].outputs[0].token_ids


def test_bad_embedding_requests_name_the_argument(tmp_path, qwen3_embedding):
    plain = write_embedding_model(tmp_path / "plain", variant="llama")
    llm = LLM(str(plain), device="cpu", max_num_batched_tokens=16)
    with pytest.raises(ValueError, match="dimensions: got 16; this model was not trained"):
        llm.embed("Hello", PoolingParams(dimensions=16))
    with pytest.raises(ValueError, match="prompt: .* tokens; an embedding is computed in one step of at most 16"):
        llm.embed(PROMPTS[1])
    assert len(llm.embed(PROMPTS[1], truncate_prompt_tokens=-1)[0].prompt_token_ids) == 16
    with pytest.raises(ValueError, match="prompt: empty"):
        llm.embed("")
    with pytest.raises(ValueError, match="pooling_params: 1 given for 2 prompts"):
        llm.embed(["a", "b"], [PoolingParams()])
    with pytest.raises(TypeError, match="pooling_params: expected PoolingParams"):
        llm.embed("a", [{"normalize": True}])
    for bad, match in (({"dimensions": 0}, "dimensions: got 0"), ({"normalize": "yes"}, "normalize: got 'yes'"),
                       ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens: got -2")):
        with pytest.raises(ValueError, match=match):
            PoolingParams(**bad)
    matryoshka = LLM(str(qwen3_embedding), device="cpu")
    with pytest.raises(ValueError, match="dimensions: got 65; this model's embeddings have 64 values"):
        matryoshka.embed("Hello", PoolingParams(dimensions=65))
    with pytest.raises(ValueError, match="pooling_type: got 'max'"):
        LLM(str(plain), device="cpu", pooling_type="max")
    maxed = write_embedding_model(tmp_path / "max", variant="llama", pooling="max")
    with pytest.raises(ValueError, match="1_Pooling/config.json: pooling modes \\['pooling_mode_max_tokens'\\]"):
        LLM(str(maxed), device="cpu")


def test_gguf_pooling_type_is_read(tmp_path):
    """llama.cpp's ``{arch}.pooling_type`` (1 = mean) picks the pooling of a GGUF embedding model."""
    from test_gguf import hf_weights, write_gguf

    path = write_gguf(tmp_path / "emb.gguf", hf_weights(tied=True), metadata_overrides={"pooling_type": 1})
    mean = LLM(str(path), device="cpu")
    assert mean.engine.embedder.pooler.pooling_type == "MEAN"
    last = LLM(str(path), device="cpu", pooling_type="LAST")
    ids, raw = [5, 9, 14, 3, 7], PoolingParams(normalize=False)
    # Causal attention: position i's state is the last state of the prompt's first i + 1 tokens.
    prefixes = embed(last, [ids[:i + 1] for i in range(len(ids))], raw)[0]
    np.testing.assert_allclose(embed(mean, [ids], raw)[0][0], prefixes.mean(0), rtol=1e-4, atol=1e-5)
    assert not np.allclose(embed(mean, [ids], raw)[0][0], prefixes[-1], atol=1e-3)


def test_two_tensor_parallel_ranks_embed_as_one(qwen3_embedding):
    """A decoder-only checkpoint split over two worker processes (Gloo): rank 0 pools what the ranks computed."""
    one = embed(LLM(str(qwen3_embedding), device="cpu"), PROMPTS)[0]
    with LLM(str(qwen3_embedding), device="cpu", tensor_parallel_size=2) as two:
        assert not two.engine.model_config.has_lm_head
        got = embed(two, PROMPTS)[0]
    np.testing.assert_allclose(got, one, atol=2e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_embeddings_on_cuda_in_bfloat16_follow_transformers(qwen3_embedding):
    """The same packed, cache-free steps on a GPU (bfloat16): directions within bfloat16's rounding of float32's."""
    llm = LLM(str(qwen3_embedding), device="cuda", dtype="bfloat16", max_num_batched_tokens=64)
    got, outputs = embed(llm, PROMPTS)
    want = reference(qwen3_embedding, [o.prompt_token_ids for o in outputs], "last", True)
    assert (np.sum(got * want, axis=1) > 0.999).all()
    mean = LLM(str(qwen3_embedding), device="cuda", dtype="float32", pooling_type="mean")
    got, outputs = embed(mean, PROMPTS, PoolingParams(normalize=False))
    np.testing.assert_allclose(got, reference(qwen3_embedding, [o.prompt_token_ids for o in outputs], "mean", False),
                               rtol=2e-3, atol=2e-3)
