"""``ninefold.bench.gguf_synthetic``: a random-weight GGUF of a given shape that ninefold loads as that shape,
with llama.cpp's rope factors for the shape's llama3 scaling."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from ninefold.bench import gguf_synthetic
from ninefold.llm.gguf import load_gguf

from .test_gguf import hf_weights, llama_cpp_rope_factors, write_gguf

SHAPE = dict(architectures=["LlamaForCausalLM"], hidden_size=128, intermediate_size=256, num_attention_heads=4,
             num_key_value_heads=2, num_hidden_layers=2, rms_norm_eps=1e-5, rope_theta=500000.0, head_dim=32,
             tie_word_embeddings=True, rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                                         high_freq_factor=4.0, original_max_position_embeddings=64))


def test_synthetic_file_loads_as_its_shape_with_llama3_rope_factors(tmp_path):
    source = write_gguf(tmp_path / "tok.gguf", hf_weights(), T.F32)  # only its tokenizer is used
    path = gguf_synthetic.write_synthetic(SHAPE, tmp_path / "syn.F16.gguf", source)
    ckpt = load_gguf(path)
    c = ckpt.config
    assert (c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"],
            c["num_hidden_layers"], c["head_dim"], c["tie_word_embeddings"]) == (128, 256, 4, 2, 2, 32, True)
    want = llama_cpp_rope_factors(500000.0, 32, 32.0, 1.0, 4.0, 64)
    np.testing.assert_allclose(c["rope_scaling"]["freq_factors"], want, rtol=1e-6)
    q = ckpt.tensors["model.layers.0.self_attn.q_proj.weight"]
    assert tuple(q.shape) == (128, 128) and 0.015 < q.float().std().item() < 0.025  # N(0, 0.02), stored in F16


def test_unknown_shape_is_named(tmp_path):
    with pytest.raises(ValueError, match="--shape: got 'llama-9t'; known: llama-3.1-8b"):
        gguf_synthetic.write_synthetic("llama-9t", tmp_path / "x.gguf", tmp_path / "none.gguf")
