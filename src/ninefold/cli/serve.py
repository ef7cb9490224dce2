"""``ninefold serve``: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import os
import sys


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


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``ninefold serve``."""
    parser.add_argument("--model", default=None,
                        help="HF directory, .gguf file or known name (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--served-model-name", default=None, help="name clients use (default: from --model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    parser.add_argument("--api-key", default=os.environ.get("NINEFOLD_API_KEY"),
                        help="require 'Authorization: Bearer KEY' (default: $NINEFOLD_API_KEY, else none)")
    parser.add_argument("--max-model-len", type=_positive, default=None, help="context length in tokens")
    parser.add_argument("--max-num-seqs", type=_positive, default=None, help="sequences run at once")
    parser.add_argument("--max-queue", type=_non_negative, default=1024,
                        help="sequences waiting beyond --max-num-seqs before 429 (default: 1024)")
    parser.add_argument("--num-kv-blocks", type=_positive, default=None, help="KV-cache blocks (default: sized)")
    parser.add_argument("--dtype", default="auto", help="float32, float16, bfloat16 or auto")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: the best available)")
    parser.add_argument("--quantization", default="auto", choices=["auto", "int4", "none"], help="GGUF 4-bit/Q8_0 weights: auto = kept packed on CPUs with bf16 (int4 kernel, bf16 activations), int4 = packed on any device, none = dequantized to --dtype (exact)")
    parser.add_argument("--max-body-bytes", type=_positive, default=4 * 1024 * 1024,
                        help="largest request body accepted (default: 4 MiB)")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="seconds SIGTERM waits for running requests before ending them (default: 30)")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def run_from_args(args: argparse.Namespace) -> int:
    """Load the engine, print the banner and serve until SIGTERM; returns the exit code."""
    from ninefold.llm.server import build_app, run_server
    from ninefold.llm.server.engine import served_name, start_engine

    engine_args = {
        "dtype": args.dtype,
        "device": args.device,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "num_kv_blocks": args.num_kv_blocks,
        "quantization": getattr(args, "quantization", None),
    }
    try:
        engine = start_engine(args.model, {k: v for k, v in engine_args.items() if v is not None})
    except (ValueError, TypeError, FileNotFoundError) as error:
        print(f"ninefold serve: error: {error}", file=sys.stderr)
        return 2
    app = build_app(
        engine,
        served_model_name=args.served_model_name or served_name(args.model),
        api_key=args.api_key or None,
        max_num_seqs=args.max_num_seqs,
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
    )
    return run_server(app, host=args.host, port=args.port, drain_timeout_s=args.drain_timeout,
                      log_level=args.log_level)
