"""``ninefold generate``: stream one completion to the terminal."""

from __future__ import annotations

import argparse
import sys

from ninefold.cli._common import (
    add_cache_arguments,
    add_parallel_argument,
    add_speculative_argument,
    add_tokenizer_argument,
    cache_engine_args,
    clean_text,
    device_error,
    fail,
    sampling_error,
    tolerant_stdio,
)
from ninefold.cli.lora_options import adapter_engine_args, adapter_request, add_adapter_argument


def register(subparsers) -> None:
    """Add the ``generate`` subcommand."""
    p = subparsers.add_parser("generate", help="generate text from a prompt, streamed to the terminal",
                              description="Generate text with an LLM. The prompt is wrapped in the model's "
                                          "chat template when it has one, unless --raw is given.")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("-m", "--model", default=None,
                   help="HF directory, .gguf file or known name (default model if omitted)")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--system", default=None, help="system message (chat template only; not with --raw)")
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default: 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: 0 = greedy)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: keep the most likely tokens up to this probability, in (0, 1] "
                        "(default: 1 = off)")
    p.add_argument("--top-k", type=int, default=0,
                   help="keep only the k most likely tokens (default: 0 = off)")
    p.add_argument("--seed", type=int, default=None,
                   help="random seed of the sampling, for repeatable output (default: none)")
    p.add_argument("--dtype", default="auto",
                   help="float32, bfloat16, float16 or auto (default: auto, float32 on CPUs)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: the best available)")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="auto reads the weights; dummy makes random ones of the same shapes (benchmarks)")
    p.add_argument("--quantization", default="auto", choices=["auto", "int4", "none", "fp8"],
                   help="GGUF 4-bit/Q8_0 weights: auto = kept packed on CPUs with bf16 (int4 kernel, bf16 "
                        "activations), int4 = packed on any device, none = dequantized to --dtype (exact); fp8 = "
                        "any checkpoint's layer matrices in FP8 (for GPUs with FP8 tensor cores; elsewhere dequantized "
                        "on every call)")
    add_tokenizer_argument(p)
    add_parallel_argument(p)
    add_speculative_argument(p)
    add_cache_arguments(p)
    add_adapter_argument(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Load the model, then print the completion as it is generated."""
    problem = sampling_error(args)
    if problem is None and args.system is not None and args.raw:
        problem = "argument --system: not allowed with --raw (the system message goes into the chat template)"
    if problem is None:
        problem = device_error(args.device)
    if problem is not None:
        return fail("generate", problem)
    from ninefold.llm.engine import LLMEngine
    from ninefold.llm.sampling import SamplingParams

    tolerant_stdio()
    text = clean_text(args.prompt)
    engine = None
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed)
        engine = LLMEngine(args.model, dtype=args.dtype, device=args.device, load_format=args.load_format,
                           quantization=args.quantization, tokenizer=args.tokenizer,
                           tensor_parallel_size=args.tensor_parallel_size,
                           speculative_config=args.speculative_config, **adapter_engine_args(args.lora),
                           **cache_engine_args(args))
        tokenizer = engine.tokenizer
        if tokenizer is None:
            raise ValueError("model: has no tokenizer, so text prompts cannot be encoded; give one with --tokenizer DIR")
        if not args.raw and tokenizer.chat_template:
            messages = ([{"role": "system", "content": clean_text(args.system)}] if args.system else [])
            messages.append({"role": "user", "content": text})
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        else:
            if args.system is not None:
                print("ninefold generate: warning: --system ignored: the model has no chat template",
                      file=sys.stderr, flush=True)
            prompt = tokenizer.encode(text)
        engine.add_request(engine.build_request(prompt, params, "cli", lora_request=adapter_request(args.lora)))
    except (ValueError, TypeError) as error:
        if engine is not None:
            engine.close()
        return fail("generate", str(error))
    try:
        _stream(engine)
    finally:
        engine.close()
    return 0


def _stream(engine) -> None:
    """Step ``engine`` until its request ends, writing the text to stdout as it grows."""
    shown = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
            sys.stdout.write(text[shown:])
            sys.stdout.flush()
            shown = len(text)
    sys.stdout.write("\n")
    sys.stdout.flush()
