"""``ninefold generate``: stream one completion to the terminal."""

from __future__ import annotations

import argparse
import sys


def register(subparsers) -> None:
    """Add the ``generate`` subcommand."""
    p = subparsers.add_parser("generate", help="generate text from a prompt, streamed to the terminal",
                              description="Generate text with an LLM. The prompt is wrapped in the model's "
                                          "chat template when it has one, unless --raw is given.")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--model", default=None, help="HF directory, .gguf file or known name (default model if omitted)")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--system", default=None, help="system message (chat template only)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default=None)
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--quantization", default="auto", choices=["auto", "int4", "none"], help="GGUF 4-bit/Q8_0 weights: auto = kept packed on CPUs with bf16 (int4 kernel, bf16 activations), int4 = packed on any device, none = dequantized to --dtype (exact)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Load the model, then print the completion as it is generated."""
    from ninefold.llm.engine import LLMEngine
    from ninefold.llm.sampling import SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed)
        engine = LLMEngine(args.model, dtype=args.dtype, device=args.device, load_format=args.load_format,
                           quantization=args.quantization)
        tokenizer = engine.tokenizer
        if tokenizer is None:
            raise ValueError("model: has no tokenizer, so text prompts cannot be encoded")
        if not args.raw and tokenizer.chat_template:
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            messages.append({"role": "user", "content": args.prompt})
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        else:
            prompt = tokenizer.encode(args.prompt)
        engine.add_request(engine.build_request(prompt, params, "cli"))
    except (ValueError, TypeError) as error:
        print(f"ninefold generate: error: {error}", file=sys.stderr)
        return 2
    shown = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
            sys.stdout.write(text[shown:])
            sys.stdout.flush()
            shown = len(text)
    sys.stdout.write("\n")
    return 0
