"""Decode steps of calls answering at once, run in one forward.

LangGraph runs a fan-out's branches (``Send``, several edges out of one node) in threads, so
sibling agents decode at the same time, each step taking the engine lock in turn: four siblings
pay four forwards per token, and each forward streams every weight of the model once. A forward
of four query rows costs little more than one of one (on the embedded model on 2 CPU cores: 57 ms
against 46 ms at 300 cached tokens, 98 ms against 48 ms at 1,600; ``benchmarks/batched_steps.py``),
so the steps that are posted while the lock is busy run together:

- a thread about to step posts its token; the first thread to find no leader leads: it takes the
  engine lock, waits up to ``window_s`` for every other call still decoding to post its next
  step (they are only sampling and detokenizing), then runs every posted step in one forward and
  hands each thread its logits. A call that does not post in time (a paused stream) is not
  waited for again until it posts; it steps alone or joins a later batch. A call decoding alone
  (a graph whose agents run one after another) never waits.
- the batch keeps its own cache while its calls stay the same: each call's KV left-padded to the
  longest, ``[B, kv_heads, T, head_dim]`` per layer, and a padding mask. When a call leaves
  (its reply ended, it dropped out) or joins, every call's rows are written back into its own
  cache (prompt slots, then the reply's ids, as a call stepping alone leaves them) and the
  batch is packed again. A call's own cache is not touched while it is batched, so siblings
  reading its prompt's KV (:mod:`.in_flight`) read it as the prefill left it.

Batched rows are exact up to float rounding (the matrix products see more rows), so a greedy
reply may differ from a lone call's where two tokens' logits tie to rounding; the first token
comes from the prefill and is never batched. Only calls on caches of full-attention layers take
part (a sliding-window or quantized cache steps alone), and never a call that feeds copies with
its steps (:mod:`.framing.decode`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from .engines import hf

__all__ = ["DecodeBatcher"]


@dataclass(eq=False)
class _Step:
    """One posted decode step: ``token`` fed at ``position`` after ``call``'s cache."""

    call: Any  # a PreparedCall
    token: int
    position: int
    logits: Optional[torch.Tensor] = None  # [vocab] float32
    error: Optional[BaseException] = None
    done: bool = False


@dataclass(eq=False)
class _Batch:
    """Calls stepping together: their KV left-padded into one cache.

    ``pads[i]``: the padding slots before row ``i``'s KV; ``cache``: ``[B, kv_heads, T,
    head_dim]`` per layer."""

    calls: list
    pads: list[int]
    cache: Any  # a transformers DynamicCache
    mask: torch.Tensor  # [B, T] int64 on the input device: 0 at padding slots


class DecodeBatcher:
    """Runs the decode steps posted at once in one forward (module docstring).

    Args:
        model: the engine's model.
        lock: the engine lock, held around every forward.
        single: ``(call, token, position) -> [vocab] float32 logits``: a step alone, on the
            call's own cache (under the engine lock).
        window_s: how long a leader waits for the running batch's calls to post.
        max_rows: the most calls stepped in one forward.
    """

    def __init__(self, model, lock, single: Callable[[Any, int, int], torch.Tensor],
                 window_s: float = 0.01, max_rows: int = 16) -> None:
        self.model, self.lock, self.single = model, lock, single
        self.window_s, self.max_rows = window_s, max_rows
        self._posted: list[_Step] = []
        self._wake = threading.Condition()
        self._leading = False
        self._active: set[int] = set()  # ids of calls between their first step and their leave
        self._lagging: set[int] = set()  # active calls that missed a window: not waited for
        self._batch: Optional[_Batch] = None
        self.batched_steps = 0  # forwards that ran more than one call's step
        self.rows = 0  # call steps those forwards ran

    # ---- the step a call's thread takes -----------------------------------------------------
    def step(self, call, token: int, position: int) -> torch.Tensor:
        """Feed ``token`` at ``position`` after ``call``'s KV, in one forward with the steps
        posted meanwhile; returns the ``[vocab]`` float32 logits of the next token."""
        mine = _Step(call, token, position)
        with self._wake:
            self._active.add(id(call))
            self._lagging.discard(id(call))
            self._posted.append(mine)
            self._wake.notify_all()
            while not mine.done and self._leading:
                self._wake.wait()
            if not mine.done:
                self._leading = True
        if not mine.done:
            self._lead()
        if mine.error is not None:
            raise mine.error
        return mine.logits

    def leave(self, call) -> None:
        """``call`` steps no more (its reply ended, or its stream closed): its KV goes back into
        its own cache. Takes the engine lock."""
        with self._wake:
            self._active.discard(id(call))
            self._lagging.discard(id(call))
            self._wake.notify_all()
        with self.lock:
            if self._holds(call):
                self._unpack()

    # ---- the leader ---------------------------------------------------------------------------
    def _lead(self) -> None:
        steps: list[_Step] = []
        try:
            with self.lock, torch.inference_mode():
                steps = self._gather()
                self._run(steps)
        except BaseException as error:  # every waiting thread learns of it, then the leader raises
            for s in steps:
                if not s.done:
                    s.error = error
            raise
        finally:
            with self._wake:
                for s in steps:
                    s.done = True
                self._leading = False
                self._wake.notify_all()

    def _gather(self) -> list[_Step]:
        """The posted steps, once every active call has posted its next one (they are sampling
        and detokenizing) or the window has passed; those that missed it are not waited for
        again until they post (a paused stream costs one window)."""
        deadline = time.monotonic() + self.window_s
        with self._wake:
            while missing := self._active - self._lagging - {id(s.call) for s in self._posted}:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._lagging |= missing
                    break
                self._wake.wait(left)
            steps, self._posted = self._posted[: self.max_rows], self._posted[self.max_rows:]
        return steps

    def _run(self, steps: list[_Step]) -> None:
        if len(steps) == 1 and self._batch is None:  # a call decoding alone: nothing to pack
            steps[0].logits = self.single(steps[0].call, steps[0].token, steps[0].position)
            steps[0].done = True
            return
        together = [s for s in steps if self._holds(s.call) or hf.batchable(s.call.pre.cache)]
        alone = [s for s in steps if not any(s is t for t in together)]
        if len(together) < 2:
            alone, together = steps, []
        if self._batch is not None:
            rows = {id(c): row for row, c in enumerate(self._batch.calls)}
            if set(rows) == {id(s.call) for s in together}:
                together.sort(key=lambda s: rows[id(s.call)])
            else:
                self._unpack()
        for s in alone:
            s.logits = self.single(s.call, s.token, s.position)
            s.done = True
        if together:
            if self._batch is None:
                self._pack([s.call for s in together])
            self._forward(together)

    def _holds(self, call) -> bool:
        return self._batch is not None and any(c is call for c in self._batch.calls)

    def _forward(self, steps: list[_Step]) -> None:
        """One forward of the batch, a step per row (rows in the batch's order)."""
        batch = self._batch
        device = hf.input_device(self.model)
        ids = torch.tensor([[s.token] for s in steps], device=device)
        positions = torch.tensor([[s.position] for s in steps], device=device)
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones(len(steps), 1)], dim=1)
        logits = hf.run_forward(self.model, ids, batch.cache, position_ids=positions,
                                attention_mask=batch.mask)[:, -1].float()
        for row, s in enumerate(steps):
            s.call.tally.add("decode", 1)
            s.call.batched_steps += 1
            s.logits = logits[row]
            s.done = True
        self.batched_steps += 1
        self.rows += len(steps)

    # ---- packing --------------------------------------------------------------------------------
    def _pack(self, calls: list) -> None:
        """One cache for ``calls``: each call's KV left-padded to the longest."""
        cache, pads = hf.left_padded(self.model, [c.pre.cache for c in calls])
        mask = torch.ones(len(calls), hf.num_cached(cache), dtype=torch.long, device=hf.input_device(self.model))
        for row, pad in enumerate(pads):
            mask[row, :pad] = 0
        self._batch = _Batch(list(calls), pads, cache, mask)

    def _unpack(self) -> None:
        """Every batched call's rows back into its own cache (the batch's cache is freed)."""
        batch, self._batch = self._batch, None
        if batch is not None:
            for row, (call, pad) in enumerate(zip(batch.calls, batch.pads)):
                hf.take_row(batch.cache, row, pad, call.pre.cache)
