"""Guided decoding's host cost: building the allowed-token mask of a recognizer state not seen before.

    python -m ninefold.bench.guided [--model PATH] [--repeats 3] [--out DIR]

Loads the model's tokenizer (default: the cached SmolLM2-135M-Instruct GGUF, 49152 tokens), indexes its
vocabulary as the engine does, then walks each format's recognizer along a typical output, byte by byte,
and times ``TokenMasks.allowed`` at every distinct state (uncached: what a step pays the first time it
meets the state) against a brute-force check of every token (what a mask costs without an index).
The formats: ``json_object``; the ``tool_choice: "required"`` schema of two tools; one tool's arguments
(a named tool choice); a ``guided_choice`` of 20 strings; a ``guided_regex`` of a dated weather line, and
one whose ``.*`` lets nearly every token through. Prints a table; writes JSON under --out.
"""

from __future__ import annotations

import argparse
import statistics
import time

from ninefold.bench.results import write_json

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": [
    "celsius", "fahrenheit"]}, "days": {"type": "integer"}}, "required": ["city"]}
TIME = {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}
REQUIRED = {"type": "array", "minItems": 1, "items": {"anyOf": [
    {"type": "object", "properties": {"name": {"const": name}, "parameters": schema}, "required": ["name", "parameters"]}
    for name, schema in (("get_weather", WEATHER), ("get_time", TIME))]}}
CALL = '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius", "days": 12}}]'
ARGUMENTS = '{\n  "city": "Saint-\\u00c9tienne",\n  "unit": "fahrenheit",\n  "days": 3\n}'
REGEX = r"[A-Z][a-z]+, \d{4}-\d{2}-\d{2}: (?:sunny|rainy|cloudy)(?: and (?:warm|cold))?\."
CHOICES = [f"option {word} {i}" for i, word in enumerate(
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
    "upsilon".split())]


def formats():
    """(name, recognizer, output text) of each benchmarked format."""
    from ninefold.llm.guided import ChoiceMachine, SchemaMachine
    from ninefold.llm.guided.json_machine import JSON_OBJECT
    from ninefold.llm.guided.regex_machine import RegexMachine

    return [("json_object", JSON_OBJECT, '{"answer": [1, 2.5, true, null], "why": "it is \\"so\\""}'),
            ("tools required", SchemaMachine(REQUIRED), CALL),
            ("named tool", SchemaMachine(WEATHER), ARGUMENTS),
            ("choice of 20", ChoiceMachine(tuple(CHOICES)), CHOICES[7]),
            ("regex", RegexMachine(REGEX), "Paris, 2026-12-05: sunny and warm."),
            ("regex .*", RegexMachine(r"[A-Z].*\."), "Paris, 2026-12-05: sunny and warm.")]


def states(machine, text: str) -> list:
    """The distinct (by cache key) states along ``text``, the start included, the complete one left out."""
    seen, out, state = set(), [], machine.start
    for byte in b"\0" + text.encode():
        if byte and (state := machine.step(state, byte)) is None:
            raise ValueError(f"the recognizer refuses its own example at byte {byte!r}")
        key = machine.cache_key(state)
        if key not in seen and not machine.complete(state):
            seen.add(key)
            out.append(state)
    return out


def measure(table, machine, text: str, repeats: int) -> dict:
    """Per-state mask times (ms) of ``table.allowed`` and of a brute-force check, and that both agree."""
    vocab = table.vocab
    indexed, brute = [], []
    for state in states(machine, text):
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            allowed = table.allowed(machine, state)
            best = min(best, time.perf_counter() - start)
        indexed.append(best * 1e3)
        start = time.perf_counter()
        expected = [i for i, data in enumerate(vocab) if data and machine.advance(state, data) is not None]
        brute.append((time.perf_counter() - start) * 1e3)
        if allowed != expected:
            raise AssertionError(f"mask differs from the brute-force check at state {state!r}")
    return {"states": len(indexed), "mean_ms": statistics.mean(indexed), "max_ms": max(indexed),
            "brute_mean_ms": statistics.mean(brute), "brute_max_ms": max(brute)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ninefold.bench.guided", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model directory or .gguf (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--repeats", type=int, default=3, help="timings per state; the best is kept")
    parser.add_argument("--out", default=None, help="directory for guided.json")
    args = parser.parse_args(argv)

    from ninefold.llm import hub
    from ninefold.llm.api import LLM

    path = hub.resolve_model(args.model)
    engine = LLM(str(path), device="cpu").engine
    start = time.perf_counter()
    table = engine._token_masks()  # the engine's own index, built as its first guided request builds it
    index_s = time.perf_counter() - start
    size = table.size
    print(f"\n{path.name}: {size} tokens, vocabulary indexed in {index_s * 1e3:.0f} ms")
    print(f"{'format':<16} {'states':>6} {'mask ms mean':>12} {'max':>7} {'brute force mean':>17} {'max':>7} "
          f"{'speed-up':>8}")
    rows = {}
    for name, machine, text in formats():
        row = measure(table, machine, text, args.repeats)
        rows[name] = row
        print(f"{name:<16} {row['states']:>6} {row['mean_ms']:>12.2f} {row['max_ms']:>7.2f} "
              f"{row['brute_mean_ms']:>17.1f} {row['brute_max_ms']:>7.1f} "
              f"{row['brute_mean_ms'] / row['mean_ms']:>7.0f}x")
    if args.out:
        write_json("guided.json", {"model": str(path), "vocab": size, "index_s": index_s, "formats": rows}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
