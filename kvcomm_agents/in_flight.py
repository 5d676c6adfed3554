"""Calls still answering, shared with the calls planned meanwhile (parallel siblings).

LangGraph runs parallel branches (a ``Send`` fan-out, several edges out of one node) in
threads, so sibling agents call one engine together: each plans while the others decode, before
any of them has kept its prompt's KV (a call keeps it after its reply, :mod:`.capture`).
Planned against the store alone, siblings reading the same document, or prompts that begin
alike, would all compute it. A call past its prefill is registered here, and a call about to
plan first takes from the calls in flight what its prompt could reuse of theirs:

- the exact KV of their prompt's beginning where its own prompt begins alike (kept as an exact
  prefix: no approximation, the same entry their own keep would make, which then covers it);
- the user and tool messages they saw first (kept as segments, as their keep would; re-rotated
  for a reader only under the usual trust rules, :mod:`.planner`).

Both are copied from the in-flight call's cache when a later plan comes, never otherwise: a
graph whose calls come one after another pays nothing here.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .capture import CallCapture
from .engines import hf
from .plan import CallPlan
from .prompt import PromptLayout

__all__ = ["CallsInFlight"]

Roles = list[tuple[Optional[str], Optional[str]]]  # per message: (role, tool or speaker name)


@dataclass(eq=False)
class _InFlight:
    layout: PromptLayout
    plan: CallPlan
    cache: object  # the call's DynamicCache, growing as it decodes
    slot_positions: torch.Tensor  # [C] prompt position of each of the prompt's cache slots
    roles: Roles
    before_shared: Callable[[], None]  # run once before anything of the call is kept for others
    prefix_shared: bool = False
    messages_shared: bool = False

    def kv_at(self):
        return hf.kv_reader(self.cache, self.slot_positions)


class CallsInFlight:
    """The engine's calls between their prefill and their end (none on a model with a sliding
    window, whose cache drops early slots as a call decodes: the engine registers none there).

    Args:
        capture: where a call's prefix and messages are kept (the engine's
            :class:`~kvcomm_agents.capture.CallCapture`).
        min_gain: ids a shared prefix must add to what the store already holds for a prompt.
    """

    def __init__(self, capture: CallCapture, min_gain: int = 16) -> None:
        self.capture, self.min_gain = capture, min_gain
        self._calls: list[_InFlight] = []
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._calls)

    def add(self, layout: PromptLayout, plan: CallPlan, pre: hf.Prefill, roles: Roles,
            before_shared: Callable[[], None] = lambda: None) -> Callable[[], None]:
        """Register a call right after its prefill (its prompt, plan and filled cache); returns
        what takes it off (at the call's end). ``before_shared``: what must run before any of its
        KV is kept for others (its re-rotation check, which must not find the call's own KV)."""
        entry = _InFlight(layout, plan, pre.cache, pre.slot_positions, roles, before_shared)
        with self._lock:
            self._calls.append(entry)

        def remove() -> None:
            with self._lock:
                if entry in self._calls:
                    self._calls.remove(entry)
        return remove

    def share_with(self, ids: torch.Tensor) -> None:
        """Before planning a prompt of ``ids`` (``[T]`` int64): keep what the calls in flight
        computed that it could reuse. Run under the engine lock (no call decodes meanwhile)."""
        with self._lock:
            calls = list(self._calls)
        held = self.capture.store.longest_prefix(ids, self.capture.fingerprint) if calls else None
        for call in calls:
            self._share_prefix(call, ids, held[1] if held is not None else 0)
            if not call.messages_shared and self.capture.keeps_segments:
                call.before_shared()
                call.messages_shared = True
                self.capture.capture_messages(call.layout, call.roles, call.plan, call.kv_at())

    def _share_prefix(self, call: _InFlight, ids: torch.Tensor, held: int) -> None:
        """Keep ``call``'s exact prompt KV as a prefix where ``ids`` begin like it for at least
        ``min_gain`` ids more than the ``held`` ids the store already serves them."""
        if call.prefix_shared:
            return
        n = min(call.plan.first_rerotated(), ids.numel())
        same = call.plan.prompt_ids[:n].cpu() == ids[:n].cpu()
        common = int(same.logical_not().nonzero()[0, 0]) if not bool(same.all()) else n
        if common - held >= self.min_gain:
            call.before_shared()
            call.prefix_shared = True  # the whole exact part, once: later siblings share it too
            self.capture.store_prefix(call.plan, [], call.kv_at())
