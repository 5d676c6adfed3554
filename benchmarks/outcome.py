"""What every strategy is and returns: the :class:`Strategy` interface and one call's
:class:`CallOutcome` (``benchmarks.strategies`` has the strategies)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch

__all__ = ["CallOutcome", "Strategy", "cuda_peak_start", "cuda_peak_extra"]


@dataclass
class CallOutcome:
    """One agent call under one strategy.

    Attributes:
        ttft_s: time to first token (entering the call to the first token id, device synced).
        before_prefill_s: rendering, planning, anchor matching, offsets, recompute selection and
            cache assembly: everything before the prefill forward ("time aligning").
        logits: ``[vocab]`` float32 first-token logits (CPU), None for a free (end-to-end) run.
        greedy_prefix: leading forced reply ids greedy decoding also gives (teacher forcing).
        token_ids / text: the reply (generated or forced).
        stats: the engine's ``CallStats`` (None for the lower bound).
        peak_extra_bytes: CUDA memory allocated at the call's peak beyond its start (None on CPU).
    """

    ttft_s: float
    before_prefill_s: float
    prompt_tokens: int
    reused_tokens: int
    logits: Optional[torch.Tensor]
    greedy_prefix: Optional[int]
    token_ids: list[int]
    text: str
    stats: object = None
    peak_extra_bytes: Optional[int] = None
    untimed_tokens: int = 0  # forwards the strategy ran that its figure leaves out (the lower bound's exact cache)
    untimed_s: float = 0.0  # and the seconds they took


class Strategy:
    """Interface: ``call(messages, agent, forced_ids=None, max_new_tokens=...)``.

    Attributes:
        generates: can run end to end (feeding itself).
        computes_ahead: :meth:`ahead` computes something (pipelined prefill).
        requests: indices of the requests it takes part in (None: all), for the rows measured
            on a subset (the decision strategies' extra requests).
        decider_only: takes part only in the call of a workload's last agent (the bf16 noise
            floor: its drift is measured where the decision is made, not a graph of its own).
    """

    name: str
    generates: bool = True
    computes_ahead: bool = False
    requests: Optional[range] = None
    decider_only: bool = False

    def takes_part(self, request: int) -> bool:
        return self.requests is None or request in self.requests

    def call(self, messages: list[dict], agent: str, forced_ids: Optional[Sequence[int]] = None,
             max_new_tokens: int = 128, *, stepwise: bool = True, shared_texts: Sequence[str] = ()) -> CallOutcome:
        """One agent call: ``forced_ids`` replayed (``stepwise``: one decode step per token, as a
        generated reply costs), or, without them, a greedy reply of at most ``max_new_tokens``.
        ``shared_texts``: the texts of the prompt an earlier agent already read or wrote (only
        the lower bound uses them)."""
        raise NotImplementedError

    def ahead(self, prompts: Sequence[torch.Tensor]) -> None:
        """While a sender decodes: what this strategy computes of its readers' ``prompts`` (each
        ``[n]`` ids, a reader's prompt as far as it is known); only if ``computes_ahead``."""

    @contextmanager
    def frozen(self) -> Iterator[None]:
        """Calls inside the block leave what the strategy learns unchanged where it can (an
        engine's anchors); for measurements outside the graph."""
        yield

    def kv_bytes(self) -> int:
        """KV this strategy holds between calls (store, anchors, own text)."""
        return 0

    def anchor_bytes(self) -> int:
        return 0

    def evictions(self) -> int:
        """Store entries evicted for the byte budget so far."""
        return 0


def cuda_peak_start(device: torch.device) -> Optional[int]:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def cuda_peak_extra(device: torch.device, start: Optional[int]) -> Optional[int]:
    return None if start is None else torch.cuda.max_memory_allocated(device) - start
