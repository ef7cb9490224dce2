"""``ninefold serve``: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import os
import socket
import sys

from ninefold.cli._common import (
    add_cache_arguments,
    add_parallel_argument,
    add_speculative_argument,
    add_tokenizer_argument,
    cache_engine_args,
    device_error,
    fail,
    non_negative_int_type,
    port_type,
    positive_int_type,
    seconds_type,
)
from ninefold.cli.lora_options import add_lora_arguments, lora_engine_args, lora_modules


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``serve`` to the top-level parser."""
    parser = subparsers.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server",
        description="Serve a model over the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models), "
        "plus /health, /tokenize, /detokenize and Prometheus /metrics.",
    )
    add_arguments(parser)
    parser.set_defaults(func=run_from_args)


_positive = positive_int_type
_non_negative = non_negative_int_type
_port = port_type
_seconds = seconds_type


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``ninefold serve``."""
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model, as vLLM's `vllm serve MODEL` takes it (same as --model)")
    parser.add_argument("-m", "--model", default=None,
                        help="HF directory, .gguf file or known name (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--served-model-name", default=None, help="name clients use (default: from --model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=_port, default=8000, help="TCP port, 1-65535 (default: 8000)")
    parser.add_argument("--api-key", default=os.environ.get("NINEFOLD_API_KEY"),
                        help="require 'Authorization: Bearer KEY' (default: $NINEFOLD_API_KEY, else none)")
    parser.add_argument("--max-num-seqs", type=_positive, default=None, help="sequences run at once")
    parser.add_argument("--max-num-batched-tokens", type=_positive, default=None,
                        help="tokens one step computes at most (prefill chunks, embedding batches; default 8192)")
    parser.add_argument("--pooling-type", type=str.upper, choices=("LAST", "MEAN", "CLS"), default=None,
                        help="how /v1/embeddings pools the final hidden states (default: what the model's files say, "
                             "else LAST)")
    parser.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default=None,
                        help="fcfs (default), or priority: requests' 'priority' (lower first) orders admission "
                             "and preemption")
    parser.add_argument("--max-queue", type=_non_negative, default=1024,
                        help="sequences waiting beyond --max-num-seqs before 429 (default: 1024)")
    add_cache_arguments(parser)
    parser.add_argument("--dtype", default="auto", help="float32, float16, bfloat16 or auto")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: the best available)")
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                        help="auto reads the weights; dummy makes random ones of the same shapes (benchmarks)")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of the dummy weights (default: 0); requests carry their own sampling seeds")
    parser.add_argument("--quantization", default="auto", choices=["auto", "int4", "none", "fp8"],
                        help="GGUF 4-bit/Q8_0 weights: auto = kept packed on CPUs with bf16 (int4 kernel, bf16 "
                             "activations), int4 = packed on any device, none = dequantized to --dtype (exact); fp8 = "
                        "any checkpoint's layer matrices in FP8 (for GPUs with FP8 tensor cores; elsewhere dequantized "
                        "on every call)")
    add_tokenizer_argument(parser)
    add_parallel_argument(parser)
    add_speculative_argument(parser)
    add_lora_arguments(parser)
    parser.add_argument("--chat-template", default=None,
                        help="a Jinja chat template (a file, or the template text) in place of the model's")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="let the model decide when to call tools (tool_choice 'auto'); needs --tool-call-parser")
    parser.add_argument("--tool-call-parser", default=None, metavar="NAME",
                        help="how the model writes tool calls: hermes (Qwen2.5/3, Hermes), llama3_json, mistral")
    parser.add_argument("--reasoning-parser", default=None, metavar="NAME",
                        help="return reasoning apart from the answer: deepseek_r1 (DeepSeek-R1, QwQ) or qwen3")
    parser.add_argument("--max-body-bytes", type=_positive, default=4 * 1024 * 1024,
                        help="largest request body accepted (default: 4 MiB)")
    parser.add_argument("--drain-timeout", type=_seconds, default=30.0,
                        help="seconds SIGTERM waits for running requests before ending them (default: 30)")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                        help="how much the server logs (default: info)")


def listen_error(host: str, port: int) -> tuple[str, int] | None:
    """Why the server could not listen on ``host:port`` (message, exit code), or None.

    Checked before the model loads, so that a port in use or a host name that does not resolve is
    reported at once rather than after minutes of loading.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as error:
        reason = getattr(error, "strerror", None) or str(error)
        return f"argument --host: cannot listen on {host!r}: {reason}", 2
    family, kind, proto, _, address = infos[0]
    try:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            sock.bind(address)
    except OSError as error:
        return f"cannot listen on {host}:{port}: {error.strerror or error}", 1
    return None


def run_from_args(args: argparse.Namespace) -> int:
    """Load the engine, print the banner and serve until SIGTERM; returns the exit code."""
    model = args.model
    if args.model_tag is not None:
        if model is not None and model != args.model_tag:
            return fail("serve", f"argument --model: got {model!r} and the positional MODEL {args.model_tag!r}; "
                                 "give the model once")
        model = args.model_tag
    problem = device_error(args.device)
    if problem is not None:
        return fail("serve", problem)
    listen = listen_error(args.host, args.port)
    if listen is not None:
        return fail("serve", *listen)
    tool_parser = _tool_parser(args)
    if isinstance(tool_parser, tuple):
        return fail("serve", tool_parser[0])
    if args.reasoning_parser is not None:
        from ninefold.llm.reasoning import get_reasoning_parser

        try:
            get_reasoning_parser(args.reasoning_parser)
        except ValueError as error:
            return fail("serve", f"argument --reasoning-parser: {error}")
    try:
        adapters = lora_modules(args)
    except ValueError as error:
        return fail("serve", str(error))
    template = None
    if args.chat_template is not None:
        try:
            template = read_chat_template(args.chat_template)
        except ValueError as error:
            return fail("serve", f"argument --chat-template: {error}")

    from ninefold.llm.server import build_app, run_server
    from ninefold.llm.server.engine import served_name, start_engine

    engine_args = {
        "dtype": args.dtype,
        "device": args.device,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": getattr(args, "max_num_batched_tokens", None),
        "pooling_type": getattr(args, "pooling_type", None),
        "quantization": getattr(args, "quantization", None),
        "load_format": None if getattr(args, "load_format", "auto") == "auto" else args.load_format,
        "seed": getattr(args, "seed", None),
        "tokenizer": getattr(args, "tokenizer", None),
        "tensor_parallel_size": getattr(args, "tensor_parallel_size", None),
        "speculative_config": getattr(args, "speculative_config", None),
        "scheduling_policy": getattr(args, "scheduling_policy", None),
        **lora_engine_args(args),
        **cache_engine_args(args),
    }
    try:
        engine = start_engine(model, {k: v for k, v in engine_args.items() if v is not None})
    except (ValueError, TypeError, FileNotFoundError) as error:
        return fail("serve", str(error))
    if template is not None:
        if engine.tokenizer is None:
            engine.shutdown()
            return fail("serve", "argument --chat-template: this model has no tokenizer (dummy weights of a bare "
                                 "config), so it has no chat to template; give one with --tokenizer DIR")
        engine.tokenizer.chat_template = template
    try:
        app = build_app(
            engine,
            served_model_name=args.served_model_name or served_name(model),
            api_key=args.api_key or None,
            max_num_seqs=args.max_num_seqs,
            max_queue=args.max_queue,
            max_body_bytes=args.max_body_bytes,
            tool_call_parser=tool_parser,
            reasoning_parser=args.reasoning_parser,
            lora_modules=adapters,
            allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        )
    except (ValueError, TypeError) as error:
        shutdown = getattr(engine, "shutdown", None)
        if shutdown is not None:
            shutdown()
        return fail("serve", str(error))
    return run_server(app, host=args.host, port=args.port, drain_timeout_s=args.drain_timeout,
                      log_level=args.log_level)


def _tool_parser(args: argparse.Namespace) -> str | None | tuple[str]:
    """The parser auto tool choice reads outputs with (None: off), or ``(message,)`` when the flags are wrong."""
    if args.tool_call_parser is None:
        return ("argument --enable-auto-tool-choice: needs --tool-call-parser NAME",) \
            if args.enable_auto_tool_choice else None
    from ninefold.llm.tools import get_parser

    try:
        get_parser(args.tool_call_parser)
    except ValueError as error:
        return (f"argument --tool-call-parser: {error}",)
    if not args.enable_auto_tool_choice:
        print("ninefold serve: warning: --tool-call-parser is used only with --enable-auto-tool-choice; "
              "tool_choice 'auto' stays off", file=sys.stderr, flush=True)
        return None
    return args.tool_call_parser


def read_chat_template(value: str) -> str:
    """The template a ``--chat-template`` value gives: a file's text, or the value itself when it is a template;
    ValueError when it is neither, or not valid Jinja."""
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as file:
                template = file.read()
        except (OSError, UnicodeDecodeError) as error:
            raise ValueError(f"cannot read {value!r} as UTF-8 text: {error}") from None
    elif "{{" in value or "{%" in value:
        template = value
    else:
        raise ValueError(f"{value!r} is neither a file nor a template (expected a path to a .jinja file, or text "
                         "with {{ }} or {% %})")
    import jinja2

    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(f"not a valid Jinja template: {error.message} (line {error.lineno})") from None
    return template
