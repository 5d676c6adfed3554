"""Calls still answering, shared with the calls planned meanwhile (parallel siblings).

LangGraph runs parallel branches (a ``Send`` fan-out, several edges out of one node) in
threads, so sibling agents call one engine together: each plans while the others decode, before
any of them has kept its prompt's KV (a call keeps it after its reply, :mod:`.capture`).
Planned against the store alone, siblings reading the same document, or prompts that begin
alike, would all compute it. A call past its prefill is registered here, and a call about to
plan first keeps, from the calls in flight (of the same weights), what their own keep would:

- the exact KV of their prompt's beginning where its own prompt begins alike (kept as an exact
  prefix: no approximation, the same entry their own keep would make, which then covers it);
- the user and tool messages they saw first (kept as segments, as their keep would; re-rotated
  for a reader only under the usual trust rules, :mod:`.planner`).

Both are copied from the in-flight call's cache when a later plan comes (the prefix only where
that plan's prompt begins alike), never otherwise: a graph whose calls come one after another
pays nothing here. The copies and the sibling's re-rotation check then run in the planning
call's time. Engines without holes (the paged broker, vLLM) do not take part.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .capture import CallCapture
from .engines import hf
from .plan import CallPlan
from .prompt import PromptLayout

__all__ = ["CallsInFlight"]

logger = logging.getLogger("kvcomm_agents")

Roles = list[tuple[Optional[str], Optional[str]]]  # per message: (role, tool or speaker name)


@dataclass(eq=False)
class _InFlight:
    layout: PromptLayout
    plan: CallPlan
    cache: object  # the call's DynamicCache, growing as it decodes
    slot_positions: torch.Tensor  # [C] prompt position of each of the prompt's cache slots
    roles: Roles
    fingerprint: str  # the model's when the call prefilled: its KV is never kept under another
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
        self._lock = threading.RLock()  # remove() may run from a collected stream's cleanup while held
        self._warned: set[str] = set()  # kinds of sharing failure already warned of

    def __len__(self) -> int:
        with self._lock:
            return len(self._calls)

    def add(self, layout: PromptLayout, plan: CallPlan, pre: hf.Prefill, roles: Roles,
            before_shared: Callable[[], None] = lambda: None) -> Callable[[], None]:
        """Register a call right after its prefill (its prompt, plan and filled cache); returns
        what takes it off (at the call's end). ``before_shared``: what must run before any of its
        KV is kept for others (its re-rotation check, which must not find the call's own KV)."""
        entry = _InFlight(layout, plan, pre.cache, pre.slot_positions, roles, self.capture.fingerprint, before_shared)
        with self._lock:
            self._calls.append(entry)

        def remove() -> None:
            with self._lock:
                if entry in self._calls:
                    self._calls.remove(entry)
        return remove

    def share_with(self, ids: torch.Tensor) -> None:
        """Before planning a prompt of ``ids`` (``[T]`` int64): keep the exact beginning it shares
        with a call in flight, and the messages those calls saw first (as their own keep would).
        Run under the engine lock (no call decodes meanwhile). Sharing only saves work: a call
        whose KV cannot be read or kept is skipped (logged), never failing the call planned."""
        with self._lock:
            calls = [c for c in self._calls if c.fingerprint == self.capture.fingerprint]  # weights unchanged
        held = self.capture.store.longest_prefix(ids, self.capture.fingerprint) if calls else None
        held_ids = held[1] if held is not None else 0
        for call in calls:
            try:
                held_ids = max(held_ids, self._share_prefix(call, ids, held_ids))
            except Exception:  # an optimisation: the sibling's own keep stores it later
                self._failed("prefix")
            try:
                if not call.messages_shared and self.capture.keeps_segments:
                    call.before_shared()
                    self.capture.capture_messages(call.layout, call.roles, call.plan, call.kv_at())
                    call.messages_shared = True
            except Exception:
                self._failed("messages")

    def _failed(self, what: str) -> None:
        """A sibling's KV could not be shared: a bug, not a state to hide. Warned once per kind,
        with the traceback (sharing only saves work: the call planned goes on)."""
        if what not in self._warned:
            self._warned.add(what)
            logger.warning("a call in flight could not share its %s (later failures logged at debug)", what,
                           exc_info=True)
        else:
            logger.debug("a call in flight could not share its %s", what, exc_info=True)

    def _share_prefix(self, call: _InFlight, ids: torch.Tensor, held: int) -> int:
        """Keep ``call``'s exact prompt KV as a prefix where ``ids`` begin like it for at least
        ``min_gain`` ids more than the ``held`` ids the store already serves them; returns the
        ids of ``ids`` it serves (0: nothing kept)."""
        if call.prefix_shared:
            return 0
        n = min(call.plan.first_rerotated(), ids.numel())
        same = call.plan.prompt_ids[:n].cpu() == ids[:n].cpu()
        common = int(same.logical_not().nonzero()[0, 0]) if not bool(same.all()) else n
        if common - held < self.min_gain:
            return 0
        call.before_shared()
        self.capture.store_prefix(call.plan, [], call.kv_at())
        call.prefix_shared = True  # the whole exact part, once: later siblings share it too
        return common
