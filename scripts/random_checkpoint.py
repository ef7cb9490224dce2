"""Write a Hugging Face model directory with a GGUF file's config and tokenizer, and optionally random weights.

    python scripts/random_checkpoint.py SMOLLM2.gguf .build/smollm2-random            # config + tokenizer files
    python scripts/random_checkpoint.py .build/smollm2-random .build/smollm2-random --weights   # + random weights

The first form needs the GGUF file and writes a few MB (small enough to travel to the GPU machine); the
second, run there, fills the directory with seeded random float32 weights through transformers, so ninefold
and transformers load the same checkpoint. Benchmarks that fix the number of tokens (``ignore_eos``) time the
same work with random weights as with the real ones.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def write_skeleton(gguf_path: Path, out: Path) -> None:
    """config.json, generation_config.json, tokenizer.json and tokenizer_config.json of ``gguf_path``."""
    from ninefold.llm import gguf
    from ninefold.llm.gguf_reader import read_gguf

    file = read_gguf(gguf_path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer, tokenizer_config = gguf.load_gguf_tokenizer(gguf_path)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1))
    (out / "config.json").write_text(json.dumps(gguf.gguf_config(file), indent=1))
    (out / "generation_config.json").write_text(json.dumps(gguf._generation_config(file.metadata), indent=1))


def write_random_weights(directory: Path, seed: int) -> None:
    """model.safetensors of random float32 weights for ``directory``'s config.json (transformers' init)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory), dtype=torch.float32)
    model.save_pretrained(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="a .gguf file, or a directory this script wrote (--weights)")
    parser.add_argument("out", type=Path)
    parser.add_argument("--weights", action="store_true", help="also write seeded random weights")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.source.suffix == ".gguf":
        write_skeleton(args.source, args.out)
    elif args.source.resolve() != args.out.resolve():
        parser.error(f"source: got {args.source}; expected a .gguf file, or the out directory itself with --weights")
    if args.weights:
        write_random_weights(args.out, args.seed)
    print(f"wrote {args.out}: {', '.join(sorted(p.name for p in args.out.iterdir()))}")


if __name__ == "__main__":
    main()
