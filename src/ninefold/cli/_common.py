"""What the model subcommands (generate, chat, serve) share: option values checked before a model
loads, with errors naming the option, the value and what is accepted; text in and out that cannot
fail on odd bytes or encodings. Not a subcommand (``main.SUBCOMMAND_MODULES`` does not list it).
"""

from __future__ import annotations

import argparse
import math
import sys

SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes


def fail(command: str, message: str, code: int = 2) -> int:
    """Print ``ninefold COMMAND: error: MESSAGE`` on stderr; return ``code`` (2: bad usage)."""
    print(f"ninefold {command}: error: {message}", file=sys.stderr, flush=True)
    return code


def sampling_error(args) -> str | None:
    """The first bad sampling option among those ``args`` has (None = left to the defaults), else None.

    The message names the flag, the value and what is accepted (and the SamplingParams field the
    flag sets), e.g. ``argument --top-p: got 1.5; top_p must be a number in (0, 1]``.
    """
    checks = (
        ("max_tokens", lambda v: v >= 1, "an integer >= 1"),
        ("temperature", lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0 (0 = greedy)"),
        ("top_p", lambda v: 0 < v <= 1, "a number in (0, 1] (1 = off)"),
        ("top_k", lambda v: v >= -1, "an integer >= -1 (0 or -1 = off)"),
        ("seed", lambda v: SEED_RANGE[0] <= v <= SEED_RANGE[1], "an integer that fits in 64 bits"),
    )
    for name, ok, accepted in checks:
        value = getattr(args, name, None)
        if value is not None and not ok(value):
            return f"argument --{name.replace('_', '-')}: got {value!r}; {name} must be {accepted}"
    return None


def add_parallel_argument(parser) -> None:
    """``--tensor-parallel-size`` / ``-tp``, as vLLM spells it."""
    parser.add_argument("-tp", "--tensor-parallel-size", type=checked_type(int, lambda v: v >= 1, "an integer >= 1"),
                        default=1, help="ranks that each hold a slice of every layer: this process and N-1 "
                                        "workers, on consecutive GPUs from --device or all on the CPU (default: 1)")


def speculative_config_type(text: str) -> dict:
    """An argparse ``type`` for ``--speculative-config``: a JSON object vLLM's way, checked here."""
    import json

    from ninefold.llm.speculative import SpeculativeConfig

    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"expected a JSON object such as "
                                         f"'{{\"method\": \"ngram\", \"num_speculative_tokens\": 4}}', "
                                         f"got {text!r} ({error.msg})") from None
    try:
        SpeculativeConfig.parse(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return value


def add_cache_arguments(parser) -> None:
    """vLLM's context, KV-cache and execution flags: --max-model-len, --num-kv-blocks, --gpu-memory-utilization,
    --block-size, --kv-cache-dtype, --[no-]enable-prefix-caching, --enforce-eager."""
    parser.add_argument("--max-model-len", type=positive_int_type, default=None,
                        help="context length in tokens (default: the model's, capped by what the KV cache holds)")
    parser.add_argument("--num-kv-blocks", type=positive_int_type, default=None,
                        help="KV-cache blocks (default: sized from the device's memory; at most 1 GiB of cache on CPUs)")
    parser.add_argument("--gpu-memory-utilization", type=fraction_type, default=None,
                        help="share of the GPU's memory this engine may use in all, weights and KV cache included, "
                             "whatever else runs there (default: the KV cache fills the GPU to 90%%; not used with "
                             "--num-kv-blocks or on CPUs)")
    parser.add_argument("--block-size", type=positive_int_type, default=None,
                        help="tokens per KV-cache block (default: 16)")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8", "fp8_e4m3"), default=None,
                        help="what the KV cache holds: auto = the model's dtype (default); fp8 = FP8 codes "
                             "(float8_e4m3fn, no scale), half the memory per token of bfloat16")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                        help="reuse the KV blocks of earlier requests' identical prompt starts (default: on)")
    parser.add_argument("--enforce-eager", action="store_true", default=None,
                        help="run every step eagerly, without CUDA graphs")


def cache_engine_args(args) -> dict:
    """The engine arguments :func:`add_cache_arguments`' flags give (those left out are absent)."""
    names = ("max_model_len", "num_kv_blocks", "gpu_memory_utilization", "block_size", "kv_cache_dtype",
             "enable_prefix_caching", "enforce_eager")
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}


def add_tokenizer_argument(parser) -> None:
    """``--tokenizer``, as vLLM spells it: a tokenizer directory used instead of the model's own."""
    parser.add_argument("--tokenizer", default=None, metavar="DIR",
                        help="a Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json) to use "
                             "instead of the model's own, e.g. for a GGUF file or dummy weights (default: the model's)")


def add_speculative_argument(parser) -> None:
    """``--speculative-config``, as vLLM spells it (n-gram prompt lookup only)."""
    parser.add_argument("--speculative-config", type=speculative_config_type, default=None, metavar="JSON",
                        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                             '"prompt_lookup_max": 4}\': drafts copied from earlier in the text, checked in one pass')


def device_error(spec: str | None) -> str | None:
    """Why ``--device spec`` cannot be used here (not a device name, not on this machine), or None."""
    if spec is None:
        return None
    from ninefold.runtime import Device

    try:
        Device(spec)
    except (ValueError, TypeError) as error:
        text = str(error)
        return "argument --device: " + (text[len("device: "):] if text.startswith("device: ") else text)
    return None


def clean_text(text: str) -> str:
    """``text`` with bytes that were not valid in the locale's encoding (argv and stdin keep them as
    lone surrogates) replaced by U+FFFD, so that a tokenizer can take it."""
    if not any("\udc80" <= ch <= "\udcff" for ch in text):
        return text
    encoding = sys.getfilesystemencoding()
    return text.encode(encoding, "surrogateescape").decode(encoding, "replace")


def tolerant_stdio() -> None:
    """Model output a terminal's encoding cannot show becomes '?' instead of an exception; input
    bytes that are not valid text become U+FFFD."""
    for stream, errors in ((sys.stdout, "replace"), (sys.stdin, "replace")):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None and getattr(stream, "errors", None) == "strict":
            try:
                reconfigure(errors=errors)
            except (ValueError, OSError):  # a stream already read from, or closed
                pass


def checked_type(convert, ok, accepted: str):
    """An argparse ``type``: ``convert(text)``, refused with a message naming what is accepted unless ``ok``."""
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"expected {accepted}, got {text!r}")
        return value
    return parse


positive_int_type = checked_type(int, lambda v: v >= 1, "an integer >= 1")
non_negative_int_type = checked_type(int, lambda v: v >= 0, "an integer >= 0")
port_type = checked_type(int, lambda v: 1 <= v <= 65535, "a TCP port, an integer in [1, 65535]")
seconds_type = checked_type(float, lambda v: math.isfinite(v) and v >= 0, "a number of seconds >= 0")
fraction_type = checked_type(float, lambda v: 0 < v <= 1, "a fraction in (0, 1]")
