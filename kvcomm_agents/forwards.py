"""Tokens a call forwards through the model, by purpose, charged to the call that caused them.

What a graph costs is every token its calls push through the model, not only the prompt tokens
they compute: a reply's copies ride on the sender's decode forwards, and an audit runs a dense
prefill (and a flipped pass) after the reply. :func:`charging` names the tally and the purpose of
the forwards inside its block; :func:`~kvcomm_agents.engines.hf.run_forward`, which every forward
of the engine goes through, charges each forward's query tokens to it. A forward that carries a
sender's tokens and copies at once (:mod:`kvcomm_agents.framing.decode`) names how many of its
tokens are the sender's (:func:`sender_tokens`); the rest are copies.

The tally is held in a context variable: per thread, and only inside a block that never spans a
``yield`` (a paused stream may resume in another thread).
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator, Literal, Optional

__all__ = ["PURPOSES", "Purpose", "ForwardTally", "charging", "sender_tokens", "charge"]

Purpose = Literal["prompt", "decode", "copies", "audit"]
#: prompt: the call's own prefill; decode: the reply's tokens fed back (decode steps or a
#: teacher-forced pass); copies: copies of text in other agents' framing (reply and text copies);
#: audit: a dense re-check of a reused call (its dense prefill and flipped pass)
PURPOSES: tuple[Purpose, ...] = ("prompt", "decode", "copies", "audit")


class ForwardTally:
    """Query tokens forwarded, per purpose (mutable; one per call)."""

    def __init__(self) -> None:
        self.tokens: dict[str, int] = dict.fromkeys(PURPOSES, 0)

    def add(self, purpose: Purpose, tokens: int) -> None:
        self.tokens[purpose] += tokens

    @property
    def total(self) -> int:
        return sum(self.tokens.values())


# (tally, purpose, how many of the next forward's tokens are the sender's: None = all)
_ACTIVE: ContextVar[Optional[tuple[ForwardTally, Purpose, Optional[int]]]] = ContextVar("kvcomm_forwards",
                                                                                       default=None)


@contextmanager
def charging(tally: Optional[ForwardTally], purpose: Purpose) -> Iterator[None]:
    """Charge the forwards inside the block to ``tally`` under ``purpose`` (nothing when
    ``tally`` is None). Blocks nest: the innermost names the purpose."""
    if tally is None:
        yield
        return
    token = _ACTIVE.set((tally, purpose, None))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


@contextmanager
def sender_tokens(n: int) -> Iterator[None]:
    """Inside the block, of each forward's tokens the first ``n`` charged keep the enclosing
    purpose (the sender's own tokens) and the rest are charged as ``copies``."""
    active = _ACTIVE.get()
    if active is None:
        yield
        return
    token = _ACTIVE.set((active[0], active[1], n))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def charge(tokens: int) -> None:
    """Charge one forward of ``tokens`` query tokens to the active tally, if any."""
    active = _ACTIVE.get()
    if active is None:
        return
    tally, purpose, sender = active
    own = tokens if sender is None else min(tokens, sender)
    tally.add(purpose, own)
    if tokens > own:
        tally.add("copies", tokens - own)
