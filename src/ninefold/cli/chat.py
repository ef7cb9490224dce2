"""``ninefold chat``: an interactive terminal chat with a model, answers streamed as they come.

The conversation is kept as a list of messages and rendered with the model's chat template on
every turn. ``/reset`` starts over, ``/exit`` (or Ctrl-D) quits; Ctrl-C while an answer streams
stops that answer and keeps the program (and what was said so far).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

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

HELP = "Type a message; /reset starts a new conversation, /exit quits, Ctrl-C stops an answer."


def register(subparsers) -> None:
    """Add the ``chat`` subcommand."""
    p = subparsers.add_parser("chat", help="chat with a model in the terminal",
                              description="Interactive chat. " + HELP)
    p.add_argument("-m", "--model", default=None,
                   help="HF directory, .gguf file or known name (default model if omitted)")
    p.add_argument("--system", default=None, help="system message (default: the chat template's own, if any)")
    p.add_argument("--max-tokens", type=int, default=512, help="most tokens per answer (default 512)")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature (default: the checkpoint's, else 0 = greedy)")
    p.add_argument("--top-p", type=float, default=None,
                   help="nucleus sampling threshold in (0, 1] (default: the checkpoint's, else 1 = off)")
    p.add_argument("--top-k", type=int, default=None,
                   help="keep only the k most likely tokens (default: the checkpoint's, else 0 = off)")
    p.add_argument("--seed", type=int, default=None,
                   help="random seed of the sampling, for repeatable answers (default: none)")
    p.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto")
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: the best available)")
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
    """Load the model, then read messages and stream answers until /exit or end of input.

    From a terminal each message is asked for with a ``>>> `` prompt; from a pipe or file the lines
    are read one by one without prompts, so that stdout holds the answers only (status lines go to
    stderr).
    """
    problem = sampling_error(args) or device_error(args.device)
    if problem is not None:
        return fail("chat", problem)
    tolerant_stdio()
    engine = None
    try:
        engine, name, seconds = _load(args)
        tokenizer = engine.tokenizer
        if tokenizer is None or not tokenizer.chat_template:
            raise ValueError(f"model: {name} has no chat template; use `ninefold generate --raw` for plain completion")
        params = _sampling_params(args, getattr(engine, "generation_config", None) or {})
    except (ValueError, TypeError) as error:
        if engine is not None:
            engine.close()
        return fail("chat", str(error))
    try:
        return _converse(args, engine, name, seconds, params)
    finally:
        engine.close()


def _converse(args: argparse.Namespace, engine, name: str, seconds: float, params) -> int:
    """The loop of ``run``: read messages, stream answers, until /exit or the end of input."""
    print(f"ninefold chat: {name} ({engine.dtype}, {engine.device}) loaded in {seconds:.1f} s. {HELP}",
          file=sys.stderr, flush=True)
    interactive = sys.stdin.isatty()
    session = ChatSession(engine, params, clean_text(args.system) if args.system else None,
                          lora=adapter_request(getattr(args, "lora", None)))
    while True:
        try:
            line = clean_text(input(">>> " if interactive else ""))
        except EOFError:
            if interactive:
                print()
            return 0
        except KeyboardInterrupt:
            print("\n(use /exit or Ctrl-D to quit)", file=sys.stderr, flush=True)
            continue
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit", "/bye"):
            return 0
        if text == "/reset":
            session.reset()
            print("(conversation cleared)", file=sys.stderr, flush=True)
            continue
        if text.startswith("/") and text.split()[0] in ("/help", "/?"):
            print(HELP, file=sys.stderr, flush=True)
            continue
        session.ask(line, sys.stdout)


class ChatSession:
    """One conversation with an engine: messages in, answers streamed out."""

    def __init__(self, engine, params, system: str | None = None, lora=None):
        self.engine, self.params, self.system = engine, params, system
        self.lora = lora  # the LoRARequest of --lora, or None
        self.messages: list[dict] = []
        self._turn = 0
        self.reset()

    def reset(self) -> None:
        """Forget the conversation (the system message stays)."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def ask(self, text: str, out) -> str:
        """Send one user message; write the answer to `out` as it streams; return it. A message that cannot fit
        the context is refused on stderr, and the conversation stays as it was."""
        try:
            ids, self.messages = self._prompt_ids([*self.messages, {"role": "user", "content": text}])
        except ValueError as error:
            print(f"(error: {error})", file=sys.stderr, flush=True)
            return ""
        self._turn += 1
        request_id = f"chat-{self._turn}"
        engine = self.engine
        engine.add_request(engine.build_request(ids, self.params, request_id, lora_request=self.lora))
        stopped = False

        def on_interrupt(signum, frame):
            nonlocal stopped
            stopped = True

        previous = signal.signal(signal.SIGINT, on_interrupt)
        shown, answer = 0, ""
        try:
            while engine.has_unfinished_requests() and not stopped:
                for output in engine.step():
                    if output.request_id != request_id:
                        continue
                    answer = output.outputs[0].text
                    out.write(answer[shown:])
                    out.flush()
                    shown = len(answer)
        finally:
            signal.signal(signal.SIGINT, previous)
            if stopped:
                engine.abort_request(request_id)
        out.write("\n[stopped]\n" if stopped else "\n")
        out.flush()
        self.messages.append({"role": "assistant", "content": answer})
        return answer

    def _prompt_ids(self, messages: list[dict]) -> tuple[list[int], list[dict]]:
        """``messages`` rendered and tokenized, and the messages kept: the oldest turns are dropped (from a copy)
        when they do not fit; ValueError when the last message alone does not."""
        tokenizer, limit = self.engine.tokenizer, self.engine.max_model_len
        budget = limit - min(self.params.max_tokens or 1, limit // 2)
        messages = list(messages)
        while True:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if len(ids) <= budget:
                return ids, messages
            first = 1 if messages and messages[0]["role"] == "system" else 0
            if len(messages) - first <= 1:
                raise ValueError(f"message: {len(ids)} tokens with the template; at most {budget} fit the context")
            del messages[first : first + 2]


def _load(args: argparse.Namespace):
    from ninefold.llm import hub
    from ninefold.llm.engine import LLMEngine

    known = hub.find_known(args.model) if args.model is not None else None
    if args.model is None:
        name = hub.DEFAULT_MODEL
    else:
        name = known.name if known is not None and not Path(args.model).exists() else args.model
    print(f"ninefold chat: loading {name} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    model = str(hub.resolve_model(args.model))
    engine = LLMEngine(model, dtype=args.dtype, device=args.device, quantization=getattr(args, "quantization", "auto"),
                       tokenizer=getattr(args, "tokenizer", None),
                       tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
                       speculative_config=getattr(args, "speculative_config", None),
                       **adapter_engine_args(getattr(args, "lora", None)), **cache_engine_args(args))
    return engine, name, time.perf_counter() - start


def _sampling_params(args: argparse.Namespace, generation_config: dict):
    """The options given, else the checkpoint's generation_config.json values (unless it says
    ``do_sample: false``), else greedy. A checkpoint value that is missing, null or refused by
    SamplingParams is skipped (with a warning when present), not an error blamed on the user."""
    from ninefold.llm.sampling import SamplingParams

    sampled = bool(generation_config.get("do_sample", True))
    defaults = {"temperature": 0.0, "top_p": 1.0, "top_k": 0}
    chosen = {}
    for key, default in defaults.items():
        value = getattr(args, key)
        if value is None and sampled:
            value = generation_config.get(key)
            if value is not None:
                try:
                    if isinstance(value, bool) or not isinstance(value, (int, float)):
                        raise ValueError(f"expected a number, got {type(value).__name__}")
                    SamplingParams(**{key: value})
                except ValueError as error:
                    print(f"ninefold chat: warning: generation_config.json: {key}={value!r} ignored ({error})",
                          file=sys.stderr, flush=True)
                    value = None
        chosen[key] = default if value is None else value
    return SamplingParams(max_tokens=args.max_tokens, temperature=float(chosen["temperature"]),
                          top_p=float(chosen["top_p"]), top_k=int(chosen["top_k"]), seed=args.seed)
