"""The engine's ``Sampler`` draws from the distribution its ``SamplingParams`` define (seeded statistical test).

An independent float64 reference (``reference``) turns a logits row, the token history (prompt ids, output ids)
and the requested ``SamplingParams`` fields into the exact probability of every token, following the order that
``docs/architecture.md`` ("Sampling") and ``ops.sample``'s docstring document:

1. penalties as vLLM's SamplingParams documents them: ``repetition_penalty`` over the prompt and the output
   (positive logits divided by it, the others multiplied), ``frequency_penalty`` times each token's count in the
   output and ``presence_penalty`` once per token that the output holds, both subtracted;
2. ``logit_bias`` added (after the penalties: docs/architecture.md), ``allowed_token_ids`` (every other token
   -inf), ``min_tokens`` (EOS unless ``ignore_eos``, and ``stop_token_ids``, -inf until the output is that long);
3. ``temperature=0``: the first largest penalized logit (greedy ignores every filter); a temperature in
   (0, 0.01) is raised to 0.01 (``SamplingParams``' docstring, as vLLM does);
4. top-k on the penalized logits (every token tied with the k-th largest kept), top-p on the temperature-scaled
   probabilities renormalised after top-k (the smallest most likely set whose mass reaches p, and every token
   tied with its last one), min-p last (drop tokens below ``min_p`` times the largest probability).

Each case is drawn many times through ``Sampler`` exactly as ``ModelRunner`` calls it (``sampler.sample(logits,
seqs).read()``), every draw a row of one large batch and a ``Sequence`` built and seeded the way
``LLMEngine`` builds the ``n`` sequences of a seeded request, so every number below is deterministic.

Two places where the documented order is not vLLM's (v1 engine, ``vllm/v1/sample/sampler.py``) have their own
tests, named for the difference: vLLM applies min-p before top-k/top-p (so top-p renormalises over min-p's
survivors), and adds ``logit_bias`` before the penalties. A third difference is pinned by the edge case "top_p cut
inside a tie": every token tied with the last one of the top-p set is kept (``ops.sample``'s docstring), where
vLLM's ``apply_top_k_top_p`` cuts by sorted position and keeps whichever part of the tie its sort put first.
``logprobs`` are the model's raw log-probabilities (before penalties, temperature and filters), as
``test_logprobs_are_the_models_log_softmax`` pins and as vLLM v1's default ``logprobs_mode="raw_logprobs"``
documents.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch

from ninefold import SamplingParams
from ninefold.llm import sampler as sampler_module
from ninefold.llm.sampler import Sampler
from ninefold.llm.sequence import Sequence

INF = float("inf")
MIN_TEMPERATURE = 0.01  # SamplingParams' documented floor for temperatures in (0, 0.01)
DEFAULTS = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, presence_penalty=0.0, frequency_penalty=0.0,
                repetition_penalty=1.0, logit_bias=None, allowed_token_ids=None, min_tokens=0, ignore_eos=False,
                stop_token_ids=None, logprobs=None)
PAD = 3  # extra logits columns past the vocabulary (a padded lm_head), larger than any real logit: never drawn
PAD_LOGIT = 12.0

# -- statistics -------------------------------------------------------------------------------------------------
#
# A case drawn n times from p (K tokens with p_i > 0) is checked on its own three ways,
#  (1) exact: a token with p_i = 0 is never drawn;
#  (2) L1 / total variation, Bretagnolle-Huber-Carol: P(sum_i |f_i - p_i| >= eps) <= 2^K exp(-n eps^2 / 2), so
#      eps = sqrt(2 (K ln 2 + ln(1/delta_case)) / n) is exceeded with probability <= delta_case;
#  (3) per token, Bernstein: P(|f_i - p_i| >= t) <= 2 exp(-n t^2 / (2 v + 2t/3)) with v = p_i (1 - p_i); solving
#      n t^2 = L (2v + 2t/3) with L = ln(2/delta_token) gives t = (L/3 + sqrt(L^2/9 + 2 n v L)) / n.
# and all the sampled cases of a test together, which catches a small bias common to many cases that no single
# case can show:
#  (4) randomised probability integral transform: with a case's tokens ordered by falling probability and F(i) the
#      mass before token i, a draw of token i gives U = F(i) + V p_i (V uniform, from its own seeded generator);
#      under a correct sampler every U is exactly uniform on [0, 1) and all are independent, so by the
#      Dvoretzky-Kiefer-Wolfowitz inequality with Massart's constant the empirical CDF of N of them strays from
#      the identity by more than eps = sqrt(ln(2/delta_pooled) / (2N)) with probability <= delta_pooled.
# delta_case = ALPHA / 3 / cases, delta_token = ALPHA / 3 / (cases * vocabulary) and delta_pooled = ALPHA / 3, so by
# the union bound a correct sampler fails a test function with probability <= ALPHA = 1e-7 (and the seeds are
# fixed: it either always passes or always fails). (2) is the distance bound; (3) is sharper for small p_i, so a
# token dropped or kept by one wrong filter edge shows even when it carries a few percent of the mass.
ALPHA = 1e-7


def l1_bound(n: int, support: int, delta: float) -> float:
    return math.sqrt(2 * (support * math.log(2) + math.log(1 / delta)) / n)


def token_bound(n: int, p: float, delta: float) -> float:
    big_l = math.log(2 / delta)
    return (big_l / 3 + math.sqrt(big_l * big_l / 9 + 2 * n * p * (1 - p) * big_l)) / n


# -- the reference ------------------------------------------------------------------------------------------------


@dataclass
class Reference:
    probs: list[float]  # float64, one per vocabulary token
    penalized: list[float]  # the logits after penalties, bias and bans
    ambiguous: str = ""  # non-empty: a decision sits so near a threshold that float32 rounding may flip it


def _is_small_dyadic(v: float) -> bool:
    """Exactly k / 2^10 with |v| < 2^14: float32 and float64 compute it, and every step towards it, exactly."""
    return abs(v) < 2**14 and float(v * 1024).is_integer()


def reference(logits: list[float], prompt: list[int], output: list[int], request: dict, eos_ids: tuple[int, ...],
              *, min_p_first: bool = False) -> Reference:
    """The probability of each token of ``logits`` (the first ``len(logits)`` are the vocabulary) under ``request``
    (SamplingParams keyword arguments as asked, before SamplingParams touches them), in the documented order; with
    ``min_p_first``, vLLM v1's order instead (temperature, min-p, then top-k and top-p)."""
    r = {**DEFAULTS, **request}
    vocab = len(logits)
    x = [float(v) for v in logits]
    counts = Counter(output)
    signature: list[tuple] = [(v,) for v in x]  # tokens with equal signatures get equal values in any precision
    if r["repetition_penalty"] != 1:
        rp = float(r["repetition_penalty"])
        for t in set(prompt) | set(output):
            x[t] = x[t] / rp if x[t] > 0 else x[t] * rp
            signature[t] += ("rep",)
    for t, c in counts.items():
        x[t] -= r["frequency_penalty"] * c + r["presence_penalty"]
        signature[t] += ("count", c)
    for t, b in (r["logit_bias"] or {}).items():
        if t < vocab:
            x[t] += b
            signature[t] += ("bias", b)
    if r["allowed_token_ids"] is not None:
        allowed = set(r["allowed_token_ids"])
        x = [v if i in allowed else -INF for i, v in enumerate(x)]
    if len(output) < r["min_tokens"]:
        for t in list(r["stop_token_ids"] or []) + ([] if r["ignore_eos"] else list(eos_ids)):
            if t < vocab:
                x[t] = -INF

    ambiguous = []
    finite = [i for i in range(vocab) if x[i] > -INF]
    if not finite:
        return Reference([0.0] * vocab, x, "nothing allowed")
    for a in finite:
        for b in finite:
            if a < b and signature[a] != signature[b] and abs(x[a] - x[b]) < 1e-3 and not (
                    _is_small_dyadic(x[a]) and _is_small_dyadic(x[b])):
                ambiguous.append(f"penalized logits {a} and {b} nearly tie: {x[a]!r} {x[b]!r}")

    if r["temperature"] == 0:
        probs = [0.0] * vocab
        probs[x.index(max(x))] = 1.0  # the first of the largest, as argmax gives
        return Reference(probs, x, "; ".join(ambiguous))
    temperature = max(float(r["temperature"]), MIN_TEMPERATURE)
    keep = set(finite)

    def probabilities(kept):
        top = max(x[i] for i in kept)
        weights = {i: math.exp((x[i] - top) / temperature) for i in kept}
        total = sum(weights.values())
        return {i: w / total for i, w in weights.items()}

    def top_k(kept):
        k = r["top_k"]
        if not 0 < k < vocab:
            return kept
        values = sorted((x[i] if i in kept else -INF for i in range(vocab)), reverse=True)
        return {i for i in kept if x[i] >= values[k - 1]}

    def top_p(kept):
        p = float(r["top_p"])
        if p >= 1:
            return kept
        q = probabilities(kept)
        mass, last, seen_values = 0.0, None, set()
        for i in sorted(kept, key=lambda i: (-x[i], i)):
            if x[i] not in seen_values:  # the start of a group of equal logits: where the set may end
                if last is not None and abs(mass - p) < 1e-4:
                    ambiguous.append(f"top-p: mass {mass!r} before token {i} is within 1e-4 of p={p}")
                seen_values.add(x[i])
            if last is not None and mass >= p:
                break
            last = i
            mass += q[i]
        return {i for i in kept if x[i] >= x[last]}  # and every token tied with the last one

    def min_p(kept):
        m = float(r["min_p"])
        if m <= 0:
            return kept
        q = probabilities(kept)
        largest = max(q.values())
        for i in kept:
            if x[i] != max(x[j] for j in kept) and q[i] > 0 and abs(math.log(q[i] / largest) - math.log(m)) < 1e-3:
                ambiguous.append(f"min-p: token {i}'s ratio {q[i] / largest!r} is within 0.1% of min_p={m}")
        return {i for i in kept if q[i] >= m * largest}

    for step in ((min_p, top_k, top_p) if min_p_first else (top_k, top_p, min_p)):
        keep = step(keep)
    q = probabilities(keep)
    return Reference([q.get(i, 0.0) for i in range(vocab)], x, "; ".join(ambiguous))


# -- drawing through the engine's sampler --------------------------------------------------------------------------


@dataclass
class Case:
    name: str
    logits: list[float]
    request: dict
    prompt: list[int] = field(default_factory=lambda: [1])
    output: list[int] = field(default_factory=list)
    draws: int = 3000


@dataclass
class Drawn:
    case: Case
    ref: Reference
    raw: list[float]  # the logits row as the sampler saw it (after rounding to the batch's dtype), float64
    tokens: list[int]
    logprobs: list[dict[int, float] | None]


def engine_sequences(case: Case, rows: int, seed: int) -> list[Sequence]:
    """``rows`` sequences of one request as ``LLMEngine`` builds the n sequences of a seeded request: the prompt as
    ``token_ids``, the output appended token by token, the seed spread per sequence and a generator each."""
    params = SamplingParams(**case.request, seed=seed, max_tokens=None)
    seqs = []
    for i in range(rows):
        seq = Sequence(case.name, i, list(case.prompt), len(case.prompt), params)
        for token in case.output:
            seq.append(token)
        seq.seed = (params.seed + 1_000_003 * i) % 2**63
        seq.generator = torch.Generator(device="cpu")
        seqs.append(seq)
    return seqs


def draw(cases: list[Case], vocab: int, eos_ids: tuple[int, ...], dtype=torch.float32, seed: int = 0,
         build=engine_sequences) -> list[Drawn]:
    """Every case's draws as rows of one batch (cases of every route, greedy and sampled, side by side), through
    ``Sampler.sample(...).read()`` as ``ModelRunner`` calls it; ``build(case, rows, seed)`` makes a case's rows."""
    rows, seqs, spans = [], [], []
    for c, case in enumerate(cases):
        assert len(case.logits) == vocab, case.name
        rows.append(torch.tensor([case.logits + [PAD_LOGIT] * PAD], dtype=dtype).expand(case.draws, -1))
        spans.append((len(seqs), len(seqs) + case.draws))
        seqs += build(case, case.draws, seed * 1_000_000_007 + 7919 * c + 1)
    logits = torch.cat(rows)
    sampler = Sampler(torch.device("cpu"), vocab, eos_ids)
    out = sampler.sample(logits, seqs).read()
    assert len(out.token_ids) == len(seqs)
    drawn = []
    for case, (start, end) in zip(cases, spans):
        raw = torch.tensor(case.logits, dtype=dtype).double().tolist()
        ref = reference(raw, case.prompt, case.output, case.request, eos_ids)
        drawn.append(Drawn(case, ref, raw, out.token_ids[start:end], out.logprobs[start:end]))
    return drawn


def describe(d: Drawn, freq=None) -> str:
    lines = [f"case {d.case.name}: request={d.case.request} prompt={d.case.prompt} output={d.case.output}",
             f"  logits    = {d.raw}", f"  penalized = {[round(v, 4) for v in d.ref.penalized]}",
             f"  reference = {[round(p, 4) for p in d.ref.probs]}"]
    if freq is not None:
        lines.append(f"  drawn     = {[round(f, 4) for f in freq]}")
    return "\n".join(lines)


def check_distribution(drawn: list[Drawn], alpha: float = ALPHA) -> None:
    sampled = [d for d in drawn if d.case.request.get("temperature", 1.0) != 0]
    delta_case = alpha / 3 / max(1, len(sampled))
    delta_token = alpha / 3 / max(1, sum(len(d.raw) for d in sampled))
    pooled: list[float] = []  # (4)'s U of every draw of the sampled cases that have more than one possible token
    uniforms = random.Random(12345)
    for d in drawn:
        assert not d.ref.ambiguous, f"test case too close to a threshold, change it: {d.ref.ambiguous}\n{describe(d)}"
        vocab, n = len(d.raw), len(d.tokens)
        counts = Counter(d.tokens)
        freq = [counts.get(i, 0) / n for i in range(vocab)]
        beyond = {t: c for t, c in counts.items() if not 0 <= t < vocab}
        assert not beyond, f"drew tokens outside the vocabulary {beyond}\n{describe(d, freq)}"
        impossible = {i: counts[i] for i in range(vocab) if d.ref.probs[i] == 0 and counts.get(i)}
        assert not impossible, f"drew tokens of probability 0: {impossible}\n{describe(d, freq)}"
        if d.case.request.get("temperature", 1.0) == 0:
            continue  # (greedy: the exact check above is the whole check)
        support = sum(p > 0 for p in d.ref.probs)
        l1 = sum(abs(f - p) for f, p in zip(freq, d.ref.probs))
        assert l1 < l1_bound(n, support, delta_case), f"L1 distance {l1:.4f}\n{describe(d, freq)}"
        for i, (f, p) in enumerate(zip(freq, d.ref.probs)):
            bound = token_bound(n, p, delta_token)
            assert abs(f - p) < bound, f"token {i}: drawn {f:.4f}, reference {p:.4f} (bound {bound:.4f})\n" + describe(
                d, freq)
        if support > 1:
            before, mass = {}, 0.0
            for i in sorted(range(vocab), key=lambda i: (-d.ref.probs[i], i)):
                before[i] = mass
                mass += d.ref.probs[i]
            pooled += [before[t] + uniforms.random() * d.ref.probs[t] for t in d.tokens]
    if pooled:
        u = torch.tensor(sorted(pooled), dtype=torch.float64)
        n = len(pooled)
        ranks = torch.arange(1, n + 1, dtype=torch.float64)
        stray = max(float((ranks / n - u).max()), float((u - (ranks - 1) / n).max()))
        bound = math.sqrt(math.log(2 / (alpha / 3)) / (2 * n))
        assert stray < bound, f"pooled over {len(sampled)} cases, the draws stray {stray:.5f} from their " \
                              f"distributions (bound {bound:.5f})"


def raw_logprobs(raw: list[float]) -> list[float]:
    top = max(raw)
    log_total = top + math.log(sum(math.exp(v - top) for v in raw))
    return [v - log_total for v in raw]


def check_logprobs(drawn: list[Drawn]) -> int:
    """Rows that asked for ``logprobs=N``: the sampled token and N most likely tokens by the model's raw
    log-probability (ties in any order), each with its raw log-probability. Returns how many rows were checked."""
    checked = 0
    for d in drawn:
        want = d.case.request.get("logprobs")
        if want is None:
            assert all(entry is None for entry in d.logprobs), describe(d)
            continue
        logp = raw_logprobs(d.raw)
        for token, entry in zip(d.tokens, d.logprobs):
            assert entry is not None and token in entry, f"{entry} lacks the sampled token {token}\n{describe(d)}"
            for tid, value in entry.items():
                close = value == logp[tid] or abs(value - logp[tid]) <= 1e-5 * max(1.0, abs(logp[tid]))
                assert close, f"token {tid}: {value} vs raw {logp[tid]}\n{describe(d)}"
            tops = set(entry) - {token} if len(entry) == want + 1 else set(entry)
            assert len(tops) == want, f"{entry}: expected the top {want} and the sampled token\n{describe(d)}"
            if tops:
                rest = [logp[i] for i in range(len(logp)) if i not in tops]
                assert not rest or min(logp[i] for i in tops) >= max(rest), f"{entry} is not a top {want}\n{describe(d)}"
            checked += 1
    return checked


# -- random cases -------------------------------------------------------------------------------------------------


def random_case(rng: random.Random, vocab: int, eos: int, name: str) -> Case:
    """Logits on a 1/8 grid in [-4, 4] with ties, very negative and -inf entries; a random history and a random mix
    of every field the sampler applies. Values are dyadic, so only the reference's guard decides what is too
    close to call."""
    logits = [rng.randint(-32, 32) / 8 for _ in range(vocab)]
    for _ in range(rng.choice([0, 1, 2, 3])):  # ties, often at the top
        a, b = rng.sample(range(vocab), 2)
        logits[a] = max(logits) if rng.random() < 0.5 else logits[b]
    for _ in range(rng.choice([0, 0, 1, 2])):
        logits[rng.randrange(vocab)] = rng.choice([-1e4, -60.0, -25.0])
    if rng.random() < 0.15:
        logits[rng.randrange(vocab)] = -INF
    prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
    output = [rng.randrange(vocab) for _ in range(rng.randint(0, 6))]
    request: dict = dict(temperature=rng.choice([0.0, 1e-4, 0.05, 0.3, 0.7, 1.0, 1.0, 1.5, 3.0]))
    if rng.random() < 0.6:
        request["top_k"] = rng.choice([-1, 1, 2, 3, rng.randint(4, vocab - 1), rng.randint(4, vocab - 1), vocab,
                                       vocab + 2])
    if rng.random() < 0.5:
        request["top_p"] = rng.choice([1e-6, round(rng.uniform(0.05, 0.99), 3), round(rng.uniform(0.6, 0.95), 3)])
    if rng.random() < 0.4:
        request["min_p"] = rng.choice([0.999, 1.0, round(rng.uniform(0.01, 0.6), 3), round(rng.uniform(0.01, 0.15), 3)])
    if rng.random() < 0.5:
        request["repetition_penalty"] = rng.choice([0.5, 0.75, 1.0, 1.25, 1.5, 2.0])
        request["presence_penalty"] = rng.randint(-16, 16) / 8
        request["frequency_penalty"] = rng.randint(-16, 16) / 8
    if rng.random() < 0.15:
        request["logit_bias"] = {rng.randrange(vocab): rng.choice([-100.0, rng.randint(-24, 24) / 8])
                                 for _ in range(rng.randint(1, 3))}
    if rng.random() < 0.1:
        request["allowed_token_ids"] = rng.sample(range(vocab), rng.randint(2, vocab))
    if rng.random() < 0.1:
        request["min_tokens"] = len(output) + 1
        request["ignore_eos"] = rng.random() < 0.3
        request["stop_token_ids"] = [rng.randrange(vocab)]
    if rng.random() < 0.3:
        request["logprobs"] = rng.randint(0, 4)
    return Case(name, logits, request, prompt, output, draws=3 if request["temperature"] == 0 else 3000)


def random_cases(seed: int, count: int, vocab: int, eos: int) -> list[Case]:
    rng = random.Random(seed)
    cases = []
    while len(cases) < count:
        case = random_case(rng, vocab, eos, f"random{seed}-{len(cases)}")
        ref = reference(case.logits, case.prompt, case.output, case.request, (eos,))
        if not ref.ambiguous and max(ref.probs) > 0:  # (too close to a threshold to call: draw another)
            cases.append(case)
    return cases


@pytest.mark.parametrize("vocab, dtype, candidates", [
    (8, torch.float32, None),
    (24, torch.bfloat16, None),
    # off CUDA, rows with 0 < top_k <= TOP_K_CANDIDATES draw among that many largest logits, larger top_k through
    # ops.sample's sorting race, and a row whose k-th logit ties past the candidates over its whole row: with 6
    # candidates a small vocabulary takes all three routes
    (32, torch.float32, 6),
], ids=["v8-f32", "v24-bf16", "v32-f32-6-candidates"])
def test_random_requests_draw_from_the_documented_distribution(monkeypatch, vocab, dtype, candidates):
    if candidates is not None:
        monkeypatch.setattr(sampler_module, "TOP_K_CANDIDATES", candidates)
    eos = vocab - 1
    cases = random_cases(seed=vocab, count=36, vocab=vocab, eos=eos)
    drawn = draw(cases, vocab, (eos,), dtype=dtype, seed=vocab)
    check_distribution(drawn)
    assert check_logprobs(drawn) > 0
    # (the mix must hold what it is meant to: greedy rows beside sampled ones, and every filter)
    requests = [c.request for c in cases]
    assert any(r["temperature"] == 0 for r in requests) and any(r["temperature"] > 0 for r in requests)
    for key in ("top_k", "top_p", "min_p", "repetition_penalty", "logprobs"):
        assert any(key in r for r in requests), key


# -- hand-picked edges ----------------------------------------------------------------------------------------------

V = 8
EOS = 7
BASE = [1.0, 3.0, 2.0, 2.5, -1.0, 0.5, 0.0, 1.5]  # token 1 the largest, then 3, 2, 7


def edge_cases() -> list[Case]:
    tie_top = [1.0, 3.0, 2.0, 3.0, -1.0, 0.5, 0.0, 1.5]  # tokens 1 and 3 tie for the largest
    close = [0.0, 2.0, 2.0 - 1 / 128, 2.0 - 1 / 8, -1.0, -2.0, -3.0, -4.0]
    reorder = [3.0, 2.5, 2.25, 1.0, 0.5, -0.5, 0.0, -1.0]
    return [
        Case("top_k=1", BASE, dict(temperature=2.0, top_k=1)),
        Case("top_k=1, tie at the top", tie_top, dict(temperature=2.0, top_k=1)),
        Case("top_k ties with the k-th", [3.0, 2.0, 2.0, 2.0, 1.0, 0.0, -1.0, -2.0], dict(top_k=2)),
        Case("top_k=vocab is off", BASE, dict(temperature=1.5, top_k=V)),
        Case("top_k=-1", BASE, dict(temperature=1.5, top_k=-1)),
        Case("top_p tiny", BASE, dict(temperature=1.5, top_p=1e-6)),
        Case("top_p tiny, tie at the top", tie_top, dict(temperature=1.5, top_p=1e-6)),
        Case("top_p cut inside a tie", [2.0, 1.0, 1.0, 1.0, 0.0, -1.0, -2.0, -3.0], dict(top_p=0.6)),
        Case("top_p cut inside a tie, with top_k", [2.0, 1.0, 1.0, 1.0, 0.0, -1.0, -2.0, -3.0], dict(top_p=0.6, top_k=6)),
        Case("top_p renormalised after top_k", BASE, dict(top_k=3, top_p=0.75)),
        Case("min_p 0.999", BASE, dict(temperature=1.0, min_p=0.999)),
        Case("min_p 1, tie at the top", tie_top, dict(temperature=1.0, min_p=1.0)),
        Case("min_p uses the temperature", BASE, dict(temperature=3.0, min_p=0.7)),
        # raised to 0.01, not greedy: 1/128 apart the top two are drawn e^(-0.78):1
        Case("tiny temperature", close, dict(temperature=1e-5)),
        Case("penalties reorder the top tokens", reorder, dict(
            temperature=1.0, top_k=2, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
            prompt=[0, 2, 5], output=[0, 4, 0]),
        Case("repetition penalty on negative logits", [0.0, -0.5, -0.5, 1.0, 1.0, -3.0, -3.0, -3.0],
             dict(repetition_penalty=2.0), prompt=[1, 3], output=[]),
        Case("negative frequency penalty favours repeats", BASE, dict(frequency_penalty=-1.0, presence_penalty=-0.5),
             prompt=[1], output=[6, 6, 4]),
        Case("all three filters at once", BASE, dict(
            temperature=0.8, top_k=5, top_p=0.9, min_p=0.35, repetition_penalty=1.25, presence_penalty=0.5),
            prompt=[1, 2], output=[3], draws=4000),
        Case("bans, allowed ids and -inf", [1.0, 2.0, -INF, 0.0, 0.5, 1.5, -1.0, 4.0], dict(
            temperature=1.0, min_tokens=3, allowed_token_ids=[0, 2, 5, 7]), output=[1]),
        Case("logit_bias", BASE, dict(logit_bias={1: -100.0, 4: 3.5}, top_k=3)),
        Case("very negative logits", [2.0, -1e4, 1.0, -1e4, -1e4, 0.0, -60.0, -1e4], dict(temperature=3.0, top_k=7)),
        # greedy rows beside the sampled ones: the first largest penalized logit, whatever the filters
        Case("greedy", BASE, dict(temperature=0.0), draws=4),
        Case("greedy, penalties reorder", reorder, dict(
            temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25, logprobs=2),
            prompt=[0, 2, 5], output=[0, 4, 0], draws=4),
        Case("greedy, penalized tie: the first", [0.0, 1.0, 0.5, 2.0, -1.0, 2.5, 0.0, 1.0], dict(
            temperature=0.0, presence_penalty=0.5, logprobs=1), output=[5], draws=4),
        Case("greedy ignores the filters", BASE, dict(temperature=0.0, top_k=3, top_p=0.3, min_p=0.5,
                                                      frequency_penalty=1.0), output=[1], draws=4),
        Case("greedy with a banned eos", BASE[:7] + [9.0], dict(temperature=0.0, min_tokens=2), output=[3], draws=4),
        Case("sampled with logprobs", BASE, dict(temperature=0.7, top_p=0.8, repetition_penalty=1.5, logprobs=3),
             prompt=[1, 3], output=[2]),
    ]


@pytest.mark.parametrize("candidates", [None, 1], ids=["default", "1-candidate"])
def test_edge_cases_draw_from_the_documented_distribution(monkeypatch, candidates):
    if candidates is not None:  # every top-k row through ops.sample's sorting race (top_k=1 by the tie spill)
        monkeypatch.setattr(sampler_module, "TOP_K_CANDIDATES", candidates)
    drawn = draw(edge_cases(), V, (EOS,))
    check_distribution(drawn)
    assert check_logprobs(drawn) > 0
    by_name = {d.case.name: d for d in drawn}
    # spot checks of what the reference says, so that a wrong reference cannot pass quietly
    assert set(by_name["top_k=1"].tokens) == {1}
    assert set(by_name["top_k=1, tie at the top"].tokens) == {1, 3}
    assert set(by_name["top_k ties with the k-th"].tokens) == {0, 1, 2, 3}
    assert set(by_name["top_p cut inside a tie"].tokens) == {0, 1, 2, 3}
    assert set(by_name["top_p cut inside a tie, with top_k"].tokens) == {0, 1, 2, 3}
    assert set(by_name["min_p 0.999"].tokens) == {1}
    assert {1, 2} <= set(by_name["tiny temperature"].tokens) <= {1, 2, 3}
    assert set(by_name["all three filters at once"].tokens) == {1, 2}
    assert set(by_name["penalties reorder the top tokens"].tokens) == {1, 2}  # token 0: 3.0 -> 0.25
    assert by_name["greedy, penalties reorder"].tokens == [1] * 4
    assert by_name["greedy, penalized tie: the first"].tokens == [3] * 4
    assert by_name["greedy ignores the filters"].tokens == [3] * 4  # token 1: 3.0 - 1.0 = 2.0 < 2.5
    assert by_name["greedy with a banned eos"].tokens == [1] * 4
    assert set(by_name["bans, allowed ids and -inf"].tokens) == {0, 5}


def one_sequence_at_every_position(case: Case, rows: int, seed: int) -> list[Sequence]:
    """One seeded sequence as it stands at output positions 0, 1, ..., rows - 1 (its generator is reseeded from
    (seed, position) for every token). The output tokens do not matter to these cases (no penalties), so each row's
    output is filled in directly instead of appended token by token."""
    assert not SamplingParams(**case.request).has_penalties
    params = SamplingParams(**case.request, seed=seed, max_tokens=None)
    filler = [0] * rows
    seqs = []
    for position in range(rows):
        seq = Sequence(case.name, 0, list(case.prompt) + filler[:position], len(case.prompt), params)
        seq.output_ids = filler[:position]
        seq.seed, seq.generator = params.seed, torch.Generator(device="cpu")
        seqs.append(seq)
    return seqs


@pytest.mark.parametrize("candidates", [None, 1], ids=["default", "1-candidate"])
def test_one_seeded_sequence_draws_from_the_distribution_across_its_positions(monkeypatch, candidates):
    """The rows above are the n sequences of a request at one position; a long generation is one sequence over
    many positions, each drawn with its generator reseeded from (seed, position): that stream must follow the
    distribution too."""
    if candidates is not None:
        monkeypatch.setattr(sampler_module, "TOP_K_CANDIDATES", candidates)
    cases = [Case("whole row, top_p", BASE, dict(temperature=1.2, top_p=0.9)),
             Case("top_k, min_p", BASE, dict(temperature=0.9, top_k=5, min_p=0.1)),
             Case("plain", BASE, dict(temperature=1.0))]
    check_distribution(draw(cases, V, (EOS,), build=one_sequence_at_every_position))


def test_logprobs_are_the_raw_model_logprobs_not_the_processed_ones():
    """Documented (``test_logprobs_are_the_models_log_softmax``, and vLLM v1's default ``raw_logprobs``): the
    model's log-softmax before penalties, temperature and filters. Here the processed log-probabilities differ
    by far more than the tolerance, so the check tells the two apart."""
    case = Case("logprobs", BASE, dict(temperature=0.5, top_k=4, repetition_penalty=2.0, logprobs=V - 1),
                prompt=[1], output=[3], draws=200)
    (d,) = draw([case], V, (EOS,))
    check_logprobs([d])
    raw = raw_logprobs(d.raw)
    processed = [math.log(p) if p > 0 else -INF for p in d.ref.probs]
    for token, entry in zip(d.tokens, d.logprobs):
        assert len(entry) == V - 1 and abs(entry[token] - raw[token]) < 1e-5
        assert abs(entry[token] - processed[token]) > 0.1


# -- where the documented order is not vLLM's ---------------------------------------------------------------------

# probabilities at temperature 1: 0.4, 0.3, 0.2, 0.05, 0.05 (then ~0)
MIN_P_LOGITS = [math.log(0.4), math.log(0.3), math.log(0.2), math.log(0.05), math.log(0.05), -60.0, -60.0, -60.0]


def test_min_p_applies_after_top_p_as_documented_which_differs_from_vllm_v1():
    """``ops.sample`` documents top-k, then top-p, then min-p (vLLM's v0 sampler order). vLLM's v1 sampler applies
    min-p first (an argmax-invariant logits processor, before ``TopKTopPSampler``), so its top-p renormalises over
    min-p's survivors: here min-p drops the two 0.05 tokens, and top-p=0.75 then keeps 0.4 and 0.3 only
    (mass before the third: 0.7 / 0.9 = 0.78 >= 0.75), while the documented order keeps the 0.2 token too (mass
    before it: 0.7 < 0.75). Pinned to the documented order; the difference is reported, not hidden."""
    request = dict(temperature=1.0, top_p=0.75, min_p=0.2)
    raw = torch.tensor(MIN_P_LOGITS).double().tolist()
    vllm_v1 = reference(raw, [1], [], request, (EOS,), min_p_first=True)
    assert [i for i, p in enumerate(vllm_v1.probs) if p > 0] == [0, 1]
    (d,) = draw([Case("min_p after top_p", MIN_P_LOGITS, request, draws=4000)], V, (EOS,))
    assert [i for i, p in enumerate(d.ref.probs) if p > 0] == [0, 1, 2]
    check_distribution([d])
    assert d.tokens.count(2) > 600  # ~2/9 of 4000 (vLLM v1: never)


def test_logit_bias_is_added_after_the_penalties_as_documented_which_differs_from_vllm_v1():
    """docs/architecture.md: penalties, then ``logit_bias``. vLLM v1 applies ``logit_bias`` (a non-argmax-invariant
    logits processor) before the penalties. Token 0 (logit 1.0, in the prompt) with repetition_penalty=2 and a bias
    of +1: documented 1.0 / 2 + 1 = 1.5 beats token 1's 1.25; vLLM v1 gives (1.0 + 1) / 2 = 1.0, and token 1 wins."""
    request = dict(temperature=0.0, repetition_penalty=2.0, logit_bias={0: 1.0})
    logits = [1.0, 1.25, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0]
    (d,) = draw([Case("bias after penalties", logits, request, prompt=[0], draws=2)], V, (EOS,))
    check_distribution([d])
    assert d.tokens == [0, 0]  # vLLM v1: [1, 1]
