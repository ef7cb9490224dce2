"""Prompt logprobs: the log-probability of every prompt token given the tokens before it.

A sequence whose ``SamplingParams.prompt_logprobs`` is set collects one entry per prompt token in
``Sequence.prompt_logprobs`` (``None`` for the first token, which nothing predicts). The hidden state
at position ``p`` scores token ``p + 1``, so each prefill chunk scores the positions it computes,
except the prompt's last one (whose logits sample the first output token). Entries are appended in
position order and never twice: after a preemption the recomputed prefill skips positions already
scored, and ``BlockManager.match_prefix`` reuses cached blocks only over scored positions.

Scoring reads the logprobs back to the host at once, so a step holding such a chunk synchronises,
as a step sampling with ``logprobs`` does.
"""

from __future__ import annotations

import torch

from ninefold.llm.sampler import logprob_entries

# hidden rows turned into full-vocabulary logits at a time: no more than a decode step of 128 sequences
# computes, which the KV cache's activation profile leaves room for
ROWS_PER_PASS = 128


def positions_to_score(seq, start: int, num_new_tokens: int) -> range:
    """The positions of ``[start, start + num_new_tokens)`` whose hidden states score a prompt token not scored yet."""
    if seq.prompt_logprobs is None:
        return range(0)
    first = max(start, len(seq.prompt_logprobs) - 1)
    return range(first, min(start + num_new_tokens, seq.num_prompt_tokens - 1))


def score(model, hidden: torch.Tensor, rows: list[int], targets: list[int], tops: list[int],
          vocab_size: int) -> list[dict[int, float]]:
    """For each hidden row ``rows[i]``: ``{targets[i]: logprob, and the tops[i] most likely tokens}``."""
    out: list[dict[int, float]] = []
    device = hidden.device
    for begin in range(0, len(rows), ROWS_PER_PASS):
        index = torch.tensor(rows[begin:begin + ROWS_PER_PASS], dtype=torch.int64).to(device)
        target = torch.tensor(targets[begin:begin + ROWS_PER_PASS], dtype=torch.int64).to(device)
        logits = model.compute_logits(hidden.index_select(0, index))[:, :vocab_size]
        out += logprob_entries(logits, target, tops[begin:begin + ROWS_PER_PASS])
    return out
