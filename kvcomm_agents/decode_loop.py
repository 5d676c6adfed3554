"""A call's reply after its first token: the decode loop, or a teacher-forced reply.

Each step feeds the last chosen id after the call's KV and picks the next from the logits. How
a step runs:

- alone, on the call's own cache (a call that feeds copies with its steps does so through its
  :class:`~kvcomm_agents.framing.FramedDecode`);
- batched: steps of calls answering at once run in one forward (:mod:`.batched_decode`,
  ``KVCommConfig.batched_decode``);
- drafted: a call decoding alone feeds a draft looked up in its own ids, else in the engine's
  last replies (:mod:`.drafting`, ``KVCommConfig.draft_tokens``), with its token, and keeps the
  draft's ids while the picker, row by row, picks them (:meth:`DecodeLoop.advance`); the KV of
  the refused ids is cut off.
  The picker is called once per chosen id, on the row a token-by-token step would give it, so
  greedy picks are the same argmax and sampled ones the same draws from the same distribution,
  up to float rounding of a forward over several ids (where a stop string completes inside a
  draft, the picker has also picked the draft's later ids, which the reply drops).

Every forward takes the engine lock, never across a yield, and is charged to the call as
``decode``.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator, Optional

import torch

from .batched_decode import DecodeBatcher
from .config import KVCommConfig
from .decoding import TextAccumulator
from .drafting import NgramDraft, RecentReplies
from .engines import hf
from .engines.growing_cache import make_growing
from .forwards import charging
from .framing import Framer
from .step_costs import StepCosts

__all__ = ["DecodeLoop"]

Picker = Callable[[torch.Tensor], int]  # [vocab] float32 logits -> the chosen id


class DecodeLoop:
    """Decode steps for an engine's calls (``call``: a :class:`~kvcomm_agents.call.PreparedCall`).

    Args:
        model: the engine's model.
        config: the engine's settings (``batched_decode``, ``draft_tokens``, ``draft_recent_replies``,
            ``kv_in_place``).
        lock: the engine lock.
        framer: the engine's copies (a step without copies is their cost baseline).
        eos_ids: ids that end a reply.
    """

    def __init__(self, model, config: KVCommConfig, lock, framer: Framer, eos_ids: frozenset) -> None:
        self.model, self.config, self.lock, self.framer, self.eos_ids = model, config, lock, framer, eos_ids
        self.batcher = (DecodeBatcher(model, lock, self.step_alone, kv_in_place=config.kv_in_place)
                        if config.batched_decode else None)
        self.recent = RecentReplies(config.draft_recent_replies if config.draft_tokens else 0)  # drafts' second source
        self.costs = StepCosts()  # what a decode forward of q ids costs here: drafts' lengths

    @property
    def device(self) -> torch.device:
        return hf.input_device(self.model)

    def decode(self, call, next_id: int, sampler: Picker, text: TextAccumulator, max_new_tokens: int) -> Iterator[str]:
        """The decode loop from the first token; yields text pieces, returns the finish reason."""
        position = call.plan.num_prompt  # where the newest chosen id goes
        self._in_place(call)
        chosen = [next_id]  # ids picked by the last step; all but the newest were fed with it
        drafts = self._drafts(call, next_id)
        try:
            while True:
                for i, token in enumerate(chosen):
                    piece = text.push(token)
                    if piece:
                        yield piece
                    finish = self.finish_reason(token, text, max_new_tokens)
                    if finish is not None:
                        fed_after = len(chosen) - 1 - i  # a stop string ending inside a draft
                        if fed_after:  # the KV a reply ending here leaves: its last id never fed
                            self._cut(call, fed_after)
                            call.accepted -= fed_after - 1  # picked, but after the reply's end
                        return finish
                chosen = self.advance(call, chosen[-1], position, sampler, drafts, room=max_new_tokens - len(text.ids))
                position += len(chosen)
        finally:  # a reply that ended, or a stream closed mid-reply
            self.done_stepping(call)

    def advance(self, call, token: int, position: int, pick: Picker, drafts: Optional[NgramDraft],
                room: int, rows: Optional[list] = None) -> list[int]:
        """Feed ``token`` at ``position`` (with a draft, where one is found and the call decodes
        alone); returns the ids picked from the step's rows: the draft's ids while ``pick``
        chose them, then ``pick``'s own id (an end-of-sequence id ends the picks). The KV of
        every picked id but the last is in the call's cache after it. ``room``: ids the reply
        may still take; ``rows``, if given, receives each ``[vocab]`` row that was picked from."""
        alone = self.batcher is None or not self.batcher.busy(call)  # else its steps batch: no lookup
        draft = drafts.draft(room - 1) if drafts is not None and alone else []
        logits = self._verify(call, [token, *draft], position) if draft else None
        if logits is None:
            draft = []
            logits = self.step(call, token, position)[None]
        picked: list[int] = []
        for row in logits:
            picked.append(pick(row))
            if rows is not None:
                rows.append(row)
            if len(picked) > len(draft) or picked[-1] != draft[len(picked) - 1] or picked[-1] in self.eos_ids:
                break
        if draft:
            refused = len(draft) - (len(picked) - 1)  # fed, but not followed by a pick
            if refused:
                self._cut(call, refused)
            drafts.settle(len(draft), len(picked) - 1)
            call.drafted, call.accepted = call.drafted + len(draft), call.accepted + len(picked) - 1
        if drafts is not None:
            drafts.extend(picked)
        return picked

    def step(self, call, token: int, position: int) -> torch.Tensor:
        """One decode step: feed ``token`` at ``position``; returns the ``[vocab]`` float32 logits
        of the next token. Together with the steps other calls post meanwhile
        (:mod:`.batched_decode`) unless the call feeds copies with its steps."""
        if self.batcher is not None and call.framing is None:
            return self.batcher.step(call, token, position)
        return self.step_alone(call, token, position)

    def done_stepping(self, call) -> None:
        """The call's decode steps are over (:meth:`release` takes its KV back from a batch)."""
        if self.batcher is not None:
            self.batcher.leave(call)

    def release(self, call) -> None:
        """The call's KV whole in its own cache (under the engine lock): before it is kept."""
        if self.batcher is not None:
            self.batcher.release(call)

    def step_alone(self, call, token: int, position: int) -> torch.Tensor:
        """:meth:`step` on the call's own cache (with the copies' due share). Timed: a step
        without copies is the baseline a framed call's steps are weighed against
        (:mod:`.framing.cost`)."""
        with self.lock, torch.inference_mode(), charging(call.tally, "decode"):
            started = time.perf_counter()
            if call.framing is not None:
                logits = call.framing.forward(self.model, call.pre.cache, [token])[0, -1].float()
            else:
                device = call.device or self.device
                logits = hf.run_forward(
                    self.model, torch.tensor([[token]], device=device), call.pre.cache,
                    position_ids=torch.tensor([[position]], device=device),
                )[0, -1].float()
            hf.wait_for(logits.device)  # the step's end, not its launch
            seconds = time.perf_counter() - started
        if call.framing is None:
            self.costs.record(1, seconds)
            if self.framer.on:  # an engine that never feeds copies needs no baseline
                self.framer.copy_cost.record_step(seconds)
        else:
            call.steps, call.steps_s = call.steps + 1, call.steps_s + seconds
        return logits

    def force_stepwise(self, call, ids: list[int]) -> torch.Tensor:
        """:meth:`force` as a generated reply costs: one decode step per token, or per drafted
        run where drafts hold (the copies ride on the same steps); the same ``[k, vocab]`` logits
        up to float rounding."""
        rows = [call.pre.logits]
        self._in_place(call)
        drafts = self._drafts(call, ids[0])
        try:
            while len(rows) < len(ids):
                forced = iter(ids[len(rows):])
                self.advance(call, ids[len(rows) - 1], call.plan.num_prompt + len(rows) - 1,
                             lambda row: next(forced), drafts, room=len(ids) - len(rows), rows=rows)
        finally:
            self.done_stepping(call)
        return torch.stack([r.to(rows[0].device) for r in rows])

    def force(self, call, ids: list[int]) -> torch.Tensor:
        """Feed ``ids[:-1]`` after the prompt in one forward; ``[k, vocab]`` logits predicting each
        of ``ids`` (row 0: the prompt's last token)."""
        rows = [call.pre.logits[None]]
        if len(ids) > 1:
            n = call.plan.num_prompt
            with self.lock, torch.inference_mode(), charging(call.tally, "decode"):
                if call.framing is not None:
                    rows.append(call.framing.forward(self.model, call.pre.cache, ids[:-1], last_logits_only=False)[0].float())
                else:
                    rows.append(hf.run_forward(
                        self.model, torch.tensor([ids[:-1]], device=self.device), call.pre.cache,
                        position_ids=torch.arange(n, n + len(ids) - 1, device=self.device)[None],
                        last_logits_only=False,
                    )[0].float())
        return torch.cat([r.to(rows[0].device) for r in rows])

    def finish_reason(self, token_id: int, text: TextAccumulator, max_new_tokens: int) -> Optional[str]:
        """Why decoding stops after ``token_id``, or None to go on."""
        if token_id in self.eos_ids:
            return "stop"
        if text.stopped:
            return "stop_string"
        if len(text.ids) >= max_new_tokens:
            return "length"
        return None

    def _in_place(self, call) -> None:
        """The call's steps write their KV in place (``kv_in_place``; :mod:`.engines.growing_cache`)."""
        if self.config.kv_in_place and call.framing is None:
            with self.lock:
                make_growing(call.pre.cache)

    # ---- drafts ---------------------------------------------------------------------------
    def _cut(self, call, n: int) -> None:
        """Drop the call's last ``n`` cached slots (fed with a draft, not kept), under the engine
        lock: siblings may be reading the call's prompt KV (:mod:`.in_flight`). A sibling's
        leader holding the lock meanwhile does not wait for this call's next step."""
        with self.batcher.awaiting_lock(call) if self.batcher is not None else contextlib.nullcontext():
            self.lock.acquire()
        try:
            hf.keep_first(call.pre.cache, hf.num_cached(call.pre.cache) - n)
        finally:
            self.lock.release()

    def _drafts(self, call, first: int) -> Optional[NgramDraft]:
        """The call's draft source, None where it does not draft (``draft_tokens=0``, copies
        fed with its steps, a cache that cannot be cut back: sliding-window or quantized)."""
        if self.config.draft_tokens < 1 or call.framing is not None or not hf.batchable(call.pre.cache):
            return None
        costs = self.costs if self.config.experimental.measured_draft_lengths else None
        return NgramDraft([*call.layout.ids.tolist(), first], self.config.draft_tokens, recent=self.recent, costs=costs)

    def _verify(self, call, tokens: list[int], position: int) -> Optional[torch.Tensor]:
        """``tokens`` fed at ``position`` on in one forward; their ``[q, vocab]`` float32 rows.
        None while other calls decode (their steps batch instead)."""
        def forward() -> torch.Tensor:
            with self.lock, torch.inference_mode(), charging(call.tally, "decode"):
                device = call.device or self.device
                started = time.perf_counter()
                rows = hf.run_forward(
                    self.model, torch.tensor([tokens], device=device), call.pre.cache,
                    position_ids=torch.arange(position, position + len(tokens), device=device)[None],
                    last_logits_only=False,
                )[0].float()
                hf.wait_for(rows.device)  # the forward's end, not its launch
                self.costs.record(len(tokens), time.perf_counter() - started)
                return rows

        return forward() if self.batcher is None else self.batcher.if_alone(call, forward)
