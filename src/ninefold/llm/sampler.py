"""Turns the logits of one step into next tokens: penalties, EOS suppression, ``ops.sample``, logprobs."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ninefold import ops
from ninefold.llm.sequence import Sequence


@dataclass
class SampledTokens:
    """Host-side results of one step: a token per row, and top logprobs where asked for."""

    token_ids: list[int]
    logprobs: list[dict[int, float] | None]


class PendingTokens:
    """The sampled tokens of one step on their way to the host.

    On CUDA a non-blocking copy into page-locked memory and an event follow the sampling, so
    ``read`` waits for this step's work only, not for steps enqueued after it.
    """

    def __init__(self, sampler: Sampler, tokens: torch.Tensor):
        self.sampler = sampler
        self.tokens = tokens  # on the device: int64 [rows]
        self._result: SampledTokens | None = None
        self._event = None
        if tokens.is_cuda:
            self._pooled = tokens.dtype == torch.int64 and tokens.dim() == 1
            self._host = (sampler.pinned_tokens(tokens.shape[0]) if self._pooled
                          else torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True))
            self._host.copy_(tokens, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(tokens.device))

    @property
    def read_back(self) -> bool:
        """True once the tokens are on the host (``read`` returns at once)."""
        return self._result is not None

    def read(self) -> SampledTokens:
        """The tokens as host ints; the first call waits for this step's device work."""
        if self._result is None:
            waited = time.perf_counter()
            if self._event is not None:
                self._event.synchronize()  # the one host synchronisation of a step
                token_list = self._host.tolist()
                if self._pooled:
                    self.sampler.release_pinned(self._host)
                self._host = None
            else:
                token_list = self.tokens.tolist()
            self.sampler.sync_seconds += time.perf_counter() - waited
            self._result = SampledTokens(token_list, [None] * len(token_list))
        return self._result


# Off CUDA, rows with 0 < top_k <= this draw among this many largest logits (torch.topk) instead of sorting whole rows.
TOP_K_CANDIDATES = 256


class Sampler:
    """Applies each row's ``SamplingParams`` and draws one token per row."""

    def __init__(self, device: torch.device, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.device = device
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.sync_seconds = 0.0  # time spent waiting for the device to hand back tokens (benchmarks)
        self._pinned_free: list[torch.Tensor] = []  # page-locked token buffers read back and free again

    def pinned_tokens(self, rows: int) -> torch.Tensor:
        """A page-locked int64 buffer of ``rows`` entries for one step's tokens (reused: allocating
        page-locked memory every step costs the host more than the rest of a small step's sampling)."""
        while self._pinned_free:
            buffer = self._pinned_free.pop()
            if buffer.numel() >= rows:
                return buffer[:rows]
        return torch.empty(max(rows, 256), dtype=torch.int64, pin_memory=True)[:rows]

    def release_pinned(self, buffer: torch.Tensor) -> None:
        """Hand back a buffer from ``pinned_tokens`` once its tokens are read (a few are kept)."""
        if len(self._pinned_free) < 4:
            self._pinned_free.append(buffer._base if buffer._base is not None else buffer)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampledTokens:
        """Sample one token for each row of ``logits`` ``[B, V]`` (any float dtype), row b for ``seqs[b]``."""
        return self.sample(logits, seqs).read()

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> PendingTokens:
        """Enqueue the sampling of ``logits`` on the device; ``.read()`` on the result gives the tokens.

        Without logprobs nothing waits for the device here: on CUDA the tokens are copied to
        page-locked memory behind the step's work, so the host can prepare the next step meanwhile.
        float32 ``logits`` may be changed in place (logit_bias, allowed or banned tokens, guides, when no row
        asks for logprobs or penalties): the engine hands over fresh logits each step and saves the copy.
        """
        params = [s.params for s in seqs]
        logits = logits[:, : self.vocab_size]
        if all(s.plain_greedy for s in seqs):  # the common case, kept short: no per-row work
            # (on logits in the model's dtype: widening is exact, so the maximum and ties are the same)
            return PendingTokens(self, ops.argmax(logits, dim=-1))
        # Logits stay in the model's dtype unless a row changes them (ops.sample reads half the bytes then)
        want_logprobs = [p.logprobs is not None for p in params]
        raw = logits if any(want_logprobs) else None
        if any(p.has_penalties for p in params):
            logits = self._penalize(_writable(logits, logits), seqs)
        if any(p.logit_bias for p in params):
            logits = _writable(logits, raw)
            for row, p in enumerate(params):
                if p.logit_bias:
                    ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=self.device)
                    values = torch.tensor(list(p.logit_bias.values()), dtype=torch.float32, device=self.device)
                    logits[row].index_add_(0, ids, values)
        allowed = [row for row, p in enumerate(params) if p.allowed_token_ids is not None]
        if allowed:
            logits = _writable(logits, raw)
            for row in allowed:
                logits[row] += self._allowed_mask(seqs[row])
        banned = [self._banned(s) for s in seqs]
        if any(banned):
            logits = _writable(logits, raw)
            for row, ids in enumerate(banned):
                if ids:
                    logits[row, ids] = float("-inf")
        guided = [row for row, s in enumerate(seqs) if s.guide is not None]
        if guided:  # last: nothing may bring back a token the guide rules out
            logits = _writable(logits, raw)
            allowed = torch.stack([seqs[row].guide.mask(self.device) for row in guided])[:, : logits.shape[1]]
            rows = torch.tensor(guided, dtype=torch.long).to(self.device, non_blocking=True)
            logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
        if all(p.greedy for p in params):
            tokens = ops.argmax(logits, dim=-1)
        else:
            tokens = self._sample(logits, seqs)
        pending = PendingTokens(self, tokens)
        if raw is not None:
            pending.read().logprobs = self._logprobs(raw, tokens, params, want_logprobs)
        return pending

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Draw each row by the route its own top_k picks (so a seeded row's tokens do not depend on its batch):
        off CUDA among the ``TOP_K_CANDIDATES`` largest logits where 0 < top_k <= that, else over the whole row
        (``ops.sample`` with top_k where one is set)."""
        vocab = logits.shape[1]
        # (on CUDA, ops.sample's kernels find each row's k-th largest logit themselves, faster than torch.topk)
        width = min(TOP_K_CANDIDATES, vocab) if self.device.type != "cuda" else 0
        route = ["candidates" if 0 < s.params.top_k <= width and s.params.top_k < vocab
                 else "top_k" if 0 < s.params.top_k < vocab else "whole" for s in seqs]
        if len(set(route)) == 1:
            return self._draw(logits, seqs, route[0], width)
        tokens = torch.empty(len(seqs), dtype=torch.int64, device=self.device)
        for kind in dict.fromkeys(route):
            rows = [i for i, r in enumerate(route) if r == kind]
            index = torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)
            tokens.index_copy_(0, index, self._draw(logits.index_select(0, index), [seqs[i] for i in rows], kind, width))
        return tokens

    def _draw(self, logits: torch.Tensor, seqs: list[Sequence], route: str, width: int) -> torch.Tensor:
        params = [s.params for s in seqs]

        def column(values, dtype):
            return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

        temperature = column([p.temperature for p in params], torch.float32)
        top_p = column([p.top_p for p in params], torch.float32) if any(p.top_p < 1 for p in params) else None
        min_p = column([p.min_p for p in params], torch.float32) if any(p.min_p > 0 for p in params) else None
        if route != "candidates":
            top_k = column([p.top_k for p in params], torch.int32) if route == "top_k" else None
            return ops.sample(logits, temperature, top_k=top_k, top_p=top_p, min_p=min_p, generators=generators(seqs))
        # A fixed number of candidates, largest first (a row's draw sees the same columns whatever its batch);
        # rows asking for fewer mask the rest.
        values, ids = _candidates(logits, width)
        kth = values.gather(1, column([p.top_k for p in params], torch.int64)[:, None] - 1)
        if width < logits.shape[1]:
            # a row whose k-th logit ties with the last candidate may have tied tokens beyond the candidates: it
            # draws over its whole row (decided by the row alone; off CUDA the read is free)
            spill = values[:, -1] >= kth[:, 0]
            if bool(spill.any()):
                tokens = torch.empty(len(seqs), dtype=torch.int64, device=self.device)
                for rows, kind in ((spill, "top_k"), (~spill, "candidates")):
                    index = rows.nonzero().squeeze(1)
                    if len(index):
                        tokens[index] = self._draw(logits[index], [seqs[i] for i in index.tolist()], kind, width)
                return tokens
        values = values.masked_fill(values < kth, float("-inf"))  # every candidate at or above the k-th
        picked = ops.sample(values, temperature, top_p=top_p, min_p=min_p, generators=generators(seqs))
        tokens = ids.gather(1, picked[:, None]).squeeze(1)
        if any(p.temperature <= 0 for p in params):  # greedy rows: the first largest logit, as argmax gives
            tokens = torch.where(temperature <= 0, ops.argmax(logits, dim=-1), tokens)
        return tokens

    def _allowed_mask(self, seq: Sequence) -> torch.Tensor:
        """0 at ``allowed_token_ids``, -inf elsewhere (built once per sequence)."""
        if seq.allowed_mask is None:
            mask = torch.full((self.vocab_size,), float("-inf"), device=self.device)
            mask[torch.tensor(seq.params.allowed_token_ids, dtype=torch.long, device=self.device)] = 0.0
            seq.allowed_mask = mask
        return seq.allowed_mask

    def _banned(self, seq: Sequence) -> list[int]:
        """Token ids not allowed next: those that would end the sequence before ``min_tokens``, and the last
        token of each bad word whose other tokens end the output."""
        p = seq.params
        ids = []
        if seq.num_output_tokens < p.min_tokens:
            ids += list(p.stop_token_ids or [])
            if not p.ignore_eos:
                ids += list(self.eos_token_ids)
        if seq.bad_words:
            output = seq.output_ids
            for word in seq.bad_words:
                head = len(word) - 1
                if head == 0 or (len(output) >= head and tuple(output[len(output) - head:]) == word[:-1]):
                    ids.append(word[-1])
        return [i for i in ids if i < self.vocab_size]

    def _penalize(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        rows = [b for b, s in enumerate(seqs) if s.params.has_penalties]
        V = self.vocab_size
        for b in rows:
            seq, p = seqs[b], seqs[b].params
            row = logits[b]
            if p.repetition_penalty != 1:
                # ids are < V (prompts are checked, outputs sampled): no masking, which would sync
                seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long).to(self.device)
                values = row[seen]
                row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
            if p.presence_penalty or p.frequency_penalty:
                out = torch.tensor(seq.output_ids, dtype=torch.long).to(self.device)
                counts = torch.zeros(V, dtype=torch.float32, device=self.device)
                counts.scatter_add_(0, out, torch.ones(out.numel(), device=self.device))
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        return logits

    def _logprobs(self, raw, tokens, params, want) -> list[dict[int, float] | None]:
        rows = [b for b, w in enumerate(want) if w]
        entries = logprob_entries(raw[rows], tokens[rows], [params[b].logprobs for b in rows])
        result: list[dict[int, float] | None] = [None] * len(params)
        for b, entry in zip(rows, entries):
            result[b] = entry
        return result


def _writable(logits: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """``logits`` in float32, safe to change in place: a copy when it is in another dtype or is ``keep``."""
    if logits.dtype != torch.float32:
        return logits.float()
    return logits.clone() if logits is keep else logits


def generators(seqs) -> list | None:
    """Per row, the sequence's generator seeded for the output position this row samples (None where the
    request has no seed): a token depends on the seed and its position only, not on how many draws the
    sequence made before, so seeded sampling gives the same tokens whatever the batch, the step budget
    or speculation (whose refused drafts would otherwise have used up draws)."""
    if all(s.generator is None for s in seqs):
        return None
    out, taken = [], set()
    for s in seqs:
        g = s.generator
        if g is not None:
            if id(g) in taken:  # a draft row of a sequence with a row already in this step: a generator of its own
                g = torch.Generator(device=g.device)
            taken.add(id(g))
            g.manual_seed((s.seed * 0x9E3779B97F4A7C15 + s.num_output_tokens) % 2**63)
        out.append(g)
    return out


def logprob_entries(logits: torch.Tensor, tokens: torch.Tensor, tops: list[int]) -> list[dict[int, float]]:
    """Per row of ``logits`` ``[R, V]``: ``{token id: log-probability}`` of its ``tops[r]`` most likely tokens
    and of ``tokens[r]`` (read back to the host)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    k = max(tops)
    top_values, top_ids = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
    chosen = logp.gather(1, tokens.view(-1, 1)).squeeze(1).tolist()
    top_values, top_ids, token_list = top_values.tolist(), top_ids.tolist(), tokens.tolist()
    entries = []
    for r, n in enumerate(tops):
        entry = dict(zip(top_ids[r][:n], top_values[r][:n]))
        entry[token_list[r]] = chosen[r]
        entries.append(entry)
    return entries


def _candidates(logits: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``width`` largest logits of each row and their token ids, largest first and equal logits in token-id
    order. ``topk`` leaves the order of equal values unspecified (on CUDA it can change from one call to the next),
    and a candidate's column decides which noise it draws."""
    values, ids = logits.topk(width, dim=-1)
    ids, by_id = ids.sort(dim=-1)
    values, by_value = values.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
    return values, ids.gather(1, by_value)
