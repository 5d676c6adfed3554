"""Evaluation off the user's call path: replay a known reply under any reuse method.

``engine.replay(messages, agent=..., reply_ids=...)`` runs one agent call as ``chat`` would (same
prompt ids, same planning, same KV kept for later agents) but feeds ``reply_ids`` as the reply
instead of sampling (teacher forcing), in one forward. It returns the logits that predict each
reply token, so a benchmark gets first-token KL against dense and k-token agreement from a
single run: agreement over ``k`` tokens holds exactly when ``greedy_prefix >= k``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .results import ChatResult

__all__ = ["Replay", "trim_at_eos", "greedy_prefix"]


@dataclass
class Replay:
    """One replayed agent call.

    Attributes:
        result: the call's :class:`ChatResult` (``finish_reason="forced"``, ``token_ids`` the
            replayed ids up to the first end-of-sequence, ``stats`` as for ``chat``).
        logits: ``[k, vocab]`` float32 on the CPU: row ``i`` predicts ``result.token_ids[i]``
            (row 0 comes from the prompt's last token).
        greedy_prefix: how many leading replayed ids greedy decoding would also have produced.
    """

    result: ChatResult
    logits: torch.Tensor
    greedy_prefix: int

    @property
    def first_token_logits(self) -> torch.Tensor:
        """``[vocab]`` float32 logits of the prompt's last token."""
        return self.logits[0]


def trim_at_eos(ids: Sequence[int], eos_ids) -> list[int]:
    """``ids`` up to and including the first end-of-sequence id."""
    ids = [int(t) for t in ids]
    ends = [i for i, t in enumerate(ids) if t in eos_ids]
    return ids[: ends[0] + 1] if ends else ids


def greedy_prefix(logits: torch.Tensor, ids: Sequence[int], vocab_size: Optional[int] = None) -> int:
    """How many leading ``ids`` greedy decoding would also produce (``logits[i]`` predicts ``ids[i]``;
    as in generation, no id at or past ``vocab_size`` is picked). ``logits``: ``[k, vocab]``, one
    row per id of ``ids`` (``k = len(ids)``)."""
    agree = (logits[:, :vocab_size].argmax(dim=-1).cpu() == torch.tensor(list(ids))).long()
    return int(agree.cumprod(0).sum())
