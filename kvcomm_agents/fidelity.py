"""Fidelity metrics: how far a reuse strategy's output is from dense prefill on the same ids.

Shared by the engine's audits, the evaluation scripts and the benchmark, so every number in the
docs means the same thing:

- first-token KL: ``KL(p_dense || p_strategy)`` in nats over the full vocabulary, in float32;
- k-token agreement: a greedy run agrees if its first ``min(k, until end-of-sequence)``
  generated ids equal dense's (k = 32 unless said otherwise);
- the noise floor: the same figures for a harmless change (dense bf16 against dense fp32).
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch

__all__ = ["first_token_kl", "tokens_agree", "agreement_rate", "mean"]


def first_token_kl(dense_logits: torch.Tensor, other_logits: torch.Tensor) -> float:
    """``KL(p_dense || p_other)`` in nats, from two ``[vocab]`` logit vectors (computed in fp32)."""
    p_log = torch.log_softmax(dense_logits.detach().float().cpu(), dim=-1)
    q_log = torch.log_softmax(other_logits.detach().float().cpu(), dim=-1)
    return float((p_log.exp() * (p_log - q_log)).sum().clamp_min(0.0))


def tokens_agree(
    dense_ids: Sequence[int], other_ids: Sequence[int], k: int = 32, eos_ids: Iterable[int] = ()
) -> bool:
    """True if the first ``min(k, until end-of-sequence)`` generated ids are equal.

    The comparison window ends at dense's first end-of-sequence id (inclusive), so a reply that
    ends early must end at the same place; if either run was cut before the window ends (fewer
    ids than the window), only the ids both have are compared.
    """
    eos = set(eos_ids)
    window = k
    for i, token in enumerate(dense_ids[:k]):
        if token in eos:
            window = i + 1
            break
    n = min(window, len(dense_ids), len(other_ids))
    return list(dense_ids[:n]) == list(other_ids[:n])


def agreement_rate(pairs: Iterable[tuple[Sequence[int], Sequence[int]]], k: int = 32, eos_ids: Iterable[int] = ()) -> float:
    """Share of ``(dense_ids, other_ids)`` pairs that agree over ``k`` tokens."""
    results = [tokens_agree(d, o, k, eos_ids) for d, o in pairs]
    return sum(results) / len(results) if results else float("nan")


def mean(values: Iterable[float]) -> Optional[float]:
    """Mean of the values, or None for none."""
    values = list(values)
    return sum(values) / len(values) if values else None
