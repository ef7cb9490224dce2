"""The LoRA options of ``ninefold serve`` (vLLM's names): adapters served as models of their own."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ninefold.cli._common import positive_int_type

_positive = positive_int_type


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    """``--enable-lora``, ``--lora-modules``, ``--max-loras``, ``--max-lora-rank``, ``--max-cpu-loras`` and
    ``--allow-runtime-lora-updating``."""
    parser.add_argument("--enable-lora", action="store_true",
                        help="serve LoRA adapters (PEFT directories) beside the model; requests pick one by name "
                             "in 'model'")
    parser.add_argument("--lora-modules", nargs="+", type=lora_module, default=None, metavar="NAME=PATH",
                        help="adapters to serve, as name=path or vLLM's JSON {\"name\": ..., \"path\": ...} "
                             "(implies --enable-lora)")
    parser.add_argument("--max-loras", type=_positive, default=None,
                        help="adapters that can run in one step (default: 1)")
    parser.add_argument("--max-lora-rank", type=_positive, default=None,
                        help="the largest adapter rank accepted (default: 16)")
    parser.add_argument("--max-cpu-loras", type=_positive, default=None,
                        help="adapters kept in host memory once read (default: --max-loras)")
    parser.add_argument("--allow-runtime-lora-updating", action="store_true",
                        help="add POST /v1/load_lora_adapter and /v1/unload_lora_adapter (they read any path the "
                             "server can reach: for trusted clients only)")


def add_adapter_argument(parser: argparse.ArgumentParser) -> None:
    """``--lora DIR``: generate with one LoRA adapter (``ninefold generate`` and ``ninefold chat``)."""
    parser.add_argument("--lora", default=None, metavar="DIR",
                        help="a LoRA adapter (a PEFT directory, as peft's save_pretrained writes it) to generate with")


def adapter_engine_args(path: str | None) -> dict:
    """Engine keywords for ``--lora``: LoRA on, with room for the adapter's rank as its config states it."""
    if path is None:
        return {}
    rank = 16
    try:
        settings = json.loads((Path(path) / "adapter_config.json").read_text())
        ranks = [settings.get("r", 0), *(settings.get("rank_pattern") or {}).values()]
        rank = max([rank, *(r for r in ranks if isinstance(r, int) and not isinstance(r, bool))])
    except (OSError, ValueError, AttributeError, TypeError):
        pass  # an unreadable config: the engine names what is wrong when the request is built
    return {"enable_lora": True, "max_lora_rank": rank}


def adapter_request(path: str | None):
    """The ``LoRARequest`` of ``--lora`` (None without it)."""
    from ninefold.llm.lora import LoRARequest

    return None if path is None else LoRARequest(Path(path).name or "lora", 1, path)


def lora_engine_args(args: argparse.Namespace) -> dict:
    """The engine keywords the LoRA options ask for (none unless LoRA is on)."""
    enabled = args.enable_lora or bool(args.lora_modules) or args.allow_runtime_lora_updating
    if not enabled:
        return {}
    options = {"max_loras": args.max_loras, "max_lora_rank": args.max_lora_rank, "max_cpu_loras": args.max_cpu_loras}
    return {"enable_lora": True, **{k: v for k, v in options.items() if v is not None}}


def lora_modules(args: argparse.Namespace) -> dict[str, str]:
    """``name -> path`` of ``--lora-modules``; ValueError naming a name given twice."""
    modules: dict[str, str] = {}
    for name, path in args.lora_modules or []:
        if name in modules:
            raise ValueError(f"argument --lora-modules: the name {name!r} is given twice")
        modules[name] = path
    return modules


def lora_module(text: str) -> tuple[str, str]:
    """One ``--lora-modules`` value: ``name=path``, or a JSON object with ``name`` and ``path``."""
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg}): {text}") from None
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not isinstance(spec.get("path"), str):
            raise argparse.ArgumentTypeError(f"expected {{\"name\": str, \"path\": str}}, got {text}")
        name, path = spec["name"], spec["path"]
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    if not name or not path:
        raise argparse.ArgumentTypeError(f"expected a non-empty name and path, got {text!r}")
    return name, path

