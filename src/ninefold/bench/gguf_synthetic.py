"""A random-weight GGUF of a named model shape, for benchmarks of shapes no cached model has.

    python -m ninefold.bench.gguf_synthetic --shape llama-3.2-1b [--llama-cpp-quantize Q4_K_M] [--out FILE]

Writes an F16 GGUF with llama.cpp's tensor names: the shape's layers (``ninefold.llm.config.NAMED_SHAPES``)
with weights drawn from N(0, 0.02) and norms of 1, the shape's llama3 rope scaling as a ``rope_freqs.weight``
tensor (what llama.cpp's converter writes for Llama 3.1/3.2), and the tokenizer of the cached
SmolLM2-135M-Instruct GGUF (so its vocabulary, 49152 tokens, replaces the shape's). ``--llama-cpp-quantize``
then requantizes it with llama.cpp's quantizer (llama-cpp-python, a benchmark-only peer), which gives
the type mix of that llama.cpp file type (e.g. Q4_K_M: Q4_K with Q6_K for some ``attn_v``/``ffn_down``
and the embedding). The text such a model writes is noise; its speed, and how closely a quantized copy
follows the float weights (``ninefold.bench.gguf_fidelity``), are what it is for.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                  "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                  "tokenizer.ggml.padding_token_id", "tokenizer.chat_template")


def freq_factors(shape: dict, vocab: int) -> np.ndarray:
    """The per-frequency divisors (``rope_freqs.weight``, ``[head_dim / 2]`` float32) that give ``shape``'s scaled
    rotary frequencies (``config.rope_inv_freq``) from the plain ones."""
    from ninefold.llm.config import ModelConfig, rope_inv_freq

    scaled = ModelConfig.from_dict({**shape, "vocab_size": vocab})
    return (rope_inv_freq(replace(scaled, rope_scaling=None)) / rope_inv_freq(scaled)).numpy()


def write_synthetic(shape: str | dict, out: Path, tokenizer_source: Path, seed: int = 0) -> Path:
    """Write the random-weight F16 GGUF of ``shape`` (a name of ``NAMED_SHAPES`` or such a dict) to ``out``,
    with the tokenizer of the GGUF file ``tokenizer_source`` (see the module docstring)."""
    from gguf import GGUFWriter

    from ninefold.llm.config import NAMED_SHAPES
    from ninefold.llm.gguf_reader import read_gguf

    if isinstance(shape, str) and shape not in NAMED_SHAPES:
        raise ValueError(f"--shape: got {shape!r}; known: {', '.join(NAMED_SHAPES)}")
    shape_name = shape if isinstance(shape, str) else "custom shape"
    s = NAMED_SHAPES[shape] if isinstance(shape, str) else shape
    if s["architectures"] != ["LlamaForCausalLM"]:
        raise ValueError(f"--shape: {shape_name} is a {s['architectures'][0]}; only Llama shapes are written")
    meta = read_gguf(tokenizer_source).metadata
    vocab = len(meta["tokenizer.ggml.tokens"])
    hidden, ffn, heads, kv_heads = s["hidden_size"], s["intermediate_size"], s["num_attention_heads"], s["num_key_value_heads"]
    head_dim = s.get("head_dim", hidden // heads)
    writer = GGUFWriter(str(out), "llama")
    writer.add_name(f"{shape_name} (random weights)")
    for key, value in (("block_count", s["num_hidden_layers"]), ("context_length", 8192), ("embedding_length", hidden),
                       ("feed_forward_length", ffn), ("attention.head_count", heads),
                       ("attention.head_count_kv", kv_heads), ("rope.dimension_count", head_dim),
                       ("vocab_size", vocab)):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.rope.freq_base", float(s["rope_theta"]))
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", float(s["rms_norm_eps"]))
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    writer.add_token_list(list(meta["tokenizer.ggml.tokens"]))
    writer.add_token_types([int(t) for t in meta["tokenizer.ggml.token_type"]])
    writer.add_token_merges(list(meta["tokenizer.ggml.merges"]))
    writer.add_bos_token_id(int(meta["tokenizer.ggml.bos_token_id"]))
    writer.add_eos_token_id(int(meta["tokenizer.ggml.eos_token_id"]))
    writer.add_add_bos_token(False)
    if meta.get("tokenizer.chat_template"):
        writer.add_chat_template(meta["tokenizer.chat_template"])
    rng = np.random.default_rng(seed)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (0.02 * rng.standard_normal((rows, cols), dtype=np.float32)).astype(np.float16)

    writer.add_tensor("token_embd.weight", matrix(vocab, hidden))
    if not s.get("tie_word_embeddings", False):
        writer.add_tensor("output.weight", matrix(vocab, hidden))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    if s.get("rope_scaling"):
        writer.add_tensor("rope_freqs.weight", freq_factors(s, vocab))
    for i in range(s["num_hidden_layers"]):
        for name, rows, cols in (("attn_q", heads * head_dim, hidden), ("attn_k", kv_heads * head_dim, hidden),
                                 ("attn_v", kv_heads * head_dim, hidden), ("attn_output", hidden, heads * head_dim),
                                 ("ffn_gate", ffn, hidden), ("ffn_up", ffn, hidden), ("ffn_down", hidden, ffn)):
            writer.add_tensor(f"blk.{i}.{name}.weight", matrix(rows, cols))
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=True)
    writer.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ninefold.bench.gguf_synthetic", description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="llama-3.2-1b", help="a Llama shape of ninefold.llm.config.NAMED_SHAPES")
    parser.add_argument("--out", default=None, help="the F16 file (default: beside the cached models)")
    parser.add_argument("--llama-cpp-quantize", default=None, metavar="TYPE", help="also write a TYPE copy (e.g. Q4_K_M)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    from ninefold.bench.gguf_fidelity import llama_cpp_quantize
    from ninefold.llm import hub

    source = Path(hub.resolve_model(None))
    out = Path(args.out) if args.out else source.with_name(f"synthetic-{args.shape}.F16.gguf")
    print(f"writing {out}", flush=True)
    write_synthetic(args.shape, out, source)
    if args.llama_cpp_quantize:
        target = out.with_name(out.name.replace(".F16.", f".{args.llama_cpp_quantize.upper()}."))
        print(f"llama.cpp: quantizing to {args.llama_cpp_quantize} -> {target}", flush=True)
        llama_cpp_quantize(out, target, args.llama_cpp_quantize, args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
