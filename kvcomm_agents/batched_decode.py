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
  (a graph whose agents run one after another) never waits, nor is a call waited for whose last
  step came from a thread now waiting on another step (one thread interleaving two streams), nor
  a call waiting for the engine lock (a refused draft's cut); a
  call made under the engine lock steps alone (a leader may be waiting for that lock). At most ``max_rows``
  calls per forward: the running batch's first, then the others in the order they came.
- the batch keeps its own cache while its calls stay the same: each call's KV left-padded to the
  longest, ``[B, kv_heads, T, head_dim]`` per layer, and a padding mask. When a call leaves
  (its reply ended, it dropped out) or joins, every call's rows are written back into its own
  cache (prompt slots, then the reply's ids, as a call stepping alone leaves them) and the
  batch is packed again. A call's own cache is not touched while it is batched, so siblings
  reading its prompt's KV (:mod:`.in_flight`) read it as the prefill left it; the call takes
  its KV back before keeping it (:meth:`DecodeBatcher.release`). A call far longer than the
  others steps alone: a batch holds at most as many padding slots as KV.
- a batched forward that fails (out of memory, say) is cut back to before it, and its steps run
  alone: a failure stays with the call whose own step fails.

Batched rows are exact up to float rounding (the matrix products see more rows), so a greedy
reply may differ from a lone call's where two tokens' logits tie to rounding; the first token
comes from the prefill and is never batched. Only calls on caches of full-attention layers take
part (a sliding-window or quantized cache steps alone), and never a call that feeds copies with
its steps (:mod:`.framing.decode`).
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, TypeVar

import torch

from .engines import hf
from .engines.growing_cache import make_growing

__all__ = ["DecodeBatcher"]

logger = logging.getLogger("kvcomm_agents")
T = TypeVar("T")


def _owns(lock) -> bool:
    """Whether this thread holds ``lock`` (an ``RLock``; False where it cannot tell)."""
    owned = getattr(lock, "_is_owned", None)
    return bool(owned()) if owned is not None else False


@dataclass(eq=False)
class _Step:
    """One posted decode step: ``token`` fed at ``position`` after ``call``'s cache."""

    call: Any  # a PreparedCall
    token: int
    position: int
    thread: int = 0  # the posting thread's ident (it waits for this step: it posts nothing else meanwhile)
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
        window_s: how long a leader waits for the other calls decoding to post.
        max_rows: the most calls stepped in one forward.
        kv_in_place: the batch's steps write their KV in place (:mod:`.engines.growing_cache`).
    """

    def __init__(self, model, lock, single: Callable[[Any, int, int], torch.Tensor],
                 window_s: float = 0.01, max_rows: int = 16, kv_in_place: bool = False) -> None:
        self.model, self.lock, self.single, self.kv_in_place = model, lock, single, kv_in_place
        self.window_s, self.max_rows = window_s, max_rows
        self._posted: list[_Step] = []
        self._wake = threading.Condition()
        self._leading = False
        self._active: dict[int, int] = {}  # call id -> the thread that last posted for it (first step to leave)
        self._lagging: set[int] = set()  # active calls that missed a window: not waited for
        self._awaiting: dict[int, int] = {}  # call id -> its :meth:`awaiting_lock` scopes open
        self._batch: Optional[_Batch] = None
        self.batched_steps = 0  # forwards that ran more than one call's step
        self.rows = 0  # call steps those forwards ran
        self.missed_windows = 0  # calls a leader waited for in vain (then not waited for until they post)

    # ---- the step a call's thread takes -----------------------------------------------------
    def step(self, call, token: int, position: int) -> torch.Tensor:
        """Feed ``token`` at ``position`` after ``call``'s KV, in one forward with the steps
        posted meanwhile; returns the ``[vocab]`` float32 logits of the next token."""
        logits = self.if_alone(call, lambda: self.single(call, token, position))
        if logits is not None:
            return logits
        mine = _Step(call, token, position, threading.get_ident())
        with self._wake:
            self._posted.append(mine)
            self._wake.notify_all()
        try:
            while True:
                with self._wake:
                    while not mine.done and self._leading:
                        self._wake.wait()
                    if mine.done:
                        break
                    self._leading = True
                self._lead(mine)
        except BaseException:  # interrupted while waiting: the step is not run for a call that gave up
            with self._wake:
                self._posted = [s for s in self._posted if s is not mine]
            raise
        if mine.error is not None:
            raise mine.error
        return mine.logits

    def if_alone(self, call, work: Callable[[], T]) -> Optional[T]:
        """``work()`` (a forward on ``call``'s own cache, taking the engine lock) where ``call``
        is the only one decoding (a graph whose agents run one after another) or is made under
        the engine lock (a plan hook's: a leader may wait for that lock); None otherwise, with
        nothing run (the caller posts a step)."""
        if _owns(self.lock):
            self.release(call)
            return work()
        with self._wake:
            self._active[id(call)] = threading.get_ident()
            self._lagging.discard(id(call))
            if len(self._active) > 1 or self._posted or self._leading or self._batch is not None:
                return None
            self._leading = True
        try:
            return work()
        finally:
            with self._wake:
                self._leading = False
                self._wake.notify_all()

    @contextmanager
    def awaiting_lock(self, call) -> Iterator[None]:
        """Around ``call``'s wait for the engine lock outside a step (a refused draft's cut, on
        whichever thread its stream runs): a leader holding the lock does not wait for ``call``
        to post meanwhile, as it cannot before the lock is let go (the leader would lose its
        whole window). Only the wait: once the lock is taken, the call is waited for again."""
        key = id(call)
        with self._wake:
            self._awaiting[key] = self._awaiting.get(key, 0) + 1
            self._wake.notify_all()
        try:
            yield
        finally:
            with self._wake:
                self._awaiting[key] -= 1
                if not self._awaiting[key]:
                    del self._awaiting[key]

    def busy(self, call) -> bool:
        """Whether other calls are decoding now (advisory, without the condition: their steps
        would batch; :meth:`if_alone` decides)."""
        return bool(self._posted) or self._batch is not None or len(self._active) > (id(call) in self._active)

    def leave(self, call) -> None:
        """``call`` steps no more (its reply ended, or its stream closed). Never waits for the
        engine lock (a dropped stream's cleanup may run anywhere, even inside this batcher's own
        condition): its KV goes back home now if the lock is free, else at :meth:`release` or
        when the next forward finds the batch's calls changed. On a thread that holds the lock
        already (a leader's, where a dropped stream's cleanup may run in the middle of its
        forward; a call made under the lock) the KV stays too: an unpack there could split a
        step between its layers."""
        with self._wake:
            self._active.pop(id(call), None)
            self._lagging.discard(id(call))
            self._wake.notify_all()
        if not _owns(self.lock) and self.lock.acquire(blocking=False):
            try:
                with torch.inference_mode():  # the caches' tensors are inference tensors
                    self.release(call)
            except Exception:  # noqa: BLE001 - a finished reply stays finished: keep() releases again
                logger.warning("writing a batch's KV back failed; retried at the call's keep", exc_info=True)
            finally:
                self.lock.release()

    def release(self, call) -> None:
        """``call``'s KV whole in its own cache (its rows written back if it is batched). Under
        the engine lock: before anything reads the call's cache after its steps."""
        batch = self._batch
        if batch is not None and (self._holds(call) or any(id(c) not in self._active for c in batch.calls)):
            self._unpack()  # also a batch holding calls that left (closed streams) gives their memory back

    # ---- the leader ---------------------------------------------------------------------------
    def _lead(self, mine: _Step) -> None:
        steps: list[_Step] = [mine]
        try:
            with self.lock, torch.inference_mode():
                steps = self._gather()
                self._run(steps)
        except BaseException as error:  # an interrupt, or a failure outside any step's own
            for s in steps:
                if not s.done:
                    s.error = error
        finally:
            with self._wake:
                for s in steps:
                    s.done = True
                self._posted = [s for s in self._posted if not s.done]  # none run twice, even after an interrupt
                self._leading = False
                self._wake.notify_all()

    def _gather(self) -> list[_Step]:
        """The posted steps, once every active call has posted its next one (they are sampling
        and detokenizing) or the window has passed; those that missed it are not waited for
        again until they post (a paused stream costs one window), nor are calls whose last step
        came from a thread now waiting on another step (one thread interleaving two streams), nor
        calls waiting for the engine lock (:meth:`awaiting_lock`). At
        most ``max_rows``: the
        running batch's calls, then the others in the order they came (as a server's running
        requests keep their slots; a step left out waits for the next forward, its thread
        leading it if need be)."""
        deadline = time.monotonic() + self.window_s
        me = threading.get_ident()
        with self._wake:
            while True:
                posted = {id(s.call) for s in self._posted}
                waiting = {s.thread for s in self._posted} | {me}  # threads blocked on a step of their own
                missing = {c for c, thread in self._active.items()
                           if c not in posted and c not in self._lagging and thread not in waiting
                           and c not in self._awaiting}  # nor calls waiting for the lock held here
                left = deadline - time.monotonic()
                if not missing:
                    break
                if left <= 0:
                    self._lagging |= missing
                    self.missed_windows += len(missing)
                    break
                self._wake.wait(left)
            rows = {id(c): row for row, c in enumerate(self._batch.calls)} if self._batch is not None else {}
            order = sorted(self._posted, key=lambda s: rows.get(id(s.call), len(rows)))
            steps = order[: self.max_rows]
            self._posted = [s for s in self._posted if not any(s is t for t in steps)]
        return steps

    def _run(self, steps: list[_Step]) -> None:
        if len(steps) == 1 and self._batch is None:  # a call decoding alone: nothing to pack
            self._alone(steps)
            return
        together = [s for s in steps if self._holds(s.call) or hf.batchable(s.call.pre.cache)]
        together = self._within_padding(together)
        alone = [s for s in steps if not any(s is t for t in together)]
        if self._batch is not None:
            rows = {id(c): row for row, c in enumerate(self._batch.calls)}
            if set(rows) == {id(s.call) for s in together}:
                together.sort(key=lambda s: rows[id(s.call)])
            else:
                self._unpack()
        self._alone(alone)
        if together:
            if self._batch is None:
                try:
                    self._pack([s.call for s in together])
                except Exception:  # noqa: BLE001 - out of memory for the batch's copy, say: each steps alone
                    logger.warning("packing %d calls failed; they step alone", len(together), exc_info=True)
                    self._alone(together)
                    return
            self._forward(together)

    def _alone(self, steps: list[_Step]) -> None:
        """Each step on its call's own cache; a failure is that call's alone."""
        for s in steps:
            try:
                s.logits = self.single(s.call, s.token, s.position)
            except Exception as error:  # noqa: BLE001 - handed to the call's own thread
                s.error = error
            s.done = True

    def _within_padding(self, steps: list[_Step]) -> list[_Step]:
        """``steps`` minus their longest calls until the batch holds no more padding slots than
        KV (one long call among short ones would pad every row to its length: memory and
        attention spent on nothing); fewer than two left: none."""
        lengths = {id(s.call): self._length(s.call) for s in steps}
        kept = sorted(steps, key=lambda s: lengths[id(s.call)])
        while len(kept) >= 2:
            held = [lengths[id(s.call)] for s in kept]
            if len(kept) * max(held) - sum(held) <= sum(held):
                break
            kept.pop()
        return kept if len(kept) >= 2 else []

    def _length(self, call) -> int:
        """Slots ``call`` holds: in the batch (its row without padding) or in its own cache."""
        if self._holds(call):
            row = next(i for i, c in enumerate(self._batch.calls) if c is call)
            return hf.num_cached(self._batch.cache) - self._batch.pads[row]
        return hf.num_cached(call.pre.cache)

    def _holds(self, call) -> bool:
        return self._batch is not None and any(c is call for c in self._batch.calls)

    def _forward(self, steps: list[_Step]) -> None:
        """One forward of the batch, a step per row (rows in the batch's order). Where it fails
        (out of memory, say), the batch is cut back to before it and each step runs alone."""
        batch = self._batch
        device = hf.input_device(self.model)
        ids = torch.tensor([[s.token] for s in steps], device=device)
        positions = torch.tensor([[s.position] for s in steps], device=device)
        before = hf.num_cached(batch.cache)
        try:
            logits = hf.run_forward(self.model, ids, batch.cache, position_ids=positions,
                                    attention_mask=torch.cat([batch.mask, batch.mask.new_ones(len(steps), 1)], dim=1))
        except Exception:  # noqa: BLE001 - retried alone: a lone step's failure is its call's own
            logger.warning("a batched decode step failed; its %d calls step alone", len(steps), exc_info=True)
            hf.keep_first(batch.cache, before)
            self._unpack()
            self._alone(steps)
            return
        logits = logits[:, -1].float()
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones(len(steps), 1)], dim=1)
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
        if self.kv_in_place:
            make_growing(cache)
        mask = torch.ones(len(calls), hf.num_cached(cache), dtype=torch.long, device=hf.input_device(self.model))
        for row, pad in enumerate(pads):
            mask[row, :pad] = 0
        self._batch = _Batch(list(calls), pads, cache, mask)

    def _unpack(self) -> None:
        """Every batched call's rows back into its own cache (the batch's cache is freed)."""
        batch = self._batch
        if batch is not None:
            for row, (call, pad) in enumerate(zip(batch.calls, batch.pads)):
                hf.take_row(batch.cache, row, pad, call.pre.cache)
            self._batch = None  # only once every row is home: a failed copy leaves the batch whole
