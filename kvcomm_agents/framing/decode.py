"""Copies of text in other contexts, computed inside a sender's own forwards (none of their own).

Two kinds of copy ride on the forwards a sender runs after its prefill (decode steps, or a
replay's teacher-forced pass), in the same cache, kept apart by a 4-D mask:

- **reply copies** (:mod:`.replies`): the reply's tokens, as they are generated,
  after the sender's prompt without its last ``drop`` ids and a lead-in;
- **text copies** (:mod:`.texts`): text of the sender's prompt that later
  readers read after a prefix of their own (their system text), fed after that prefix's exact
  KV (taken from the exact-prefix store and put in the cache once).

The sender's queries come last in every forward, so its logits are the forward's last rows, and
its KV is found with :meth:`FramedDecode.slot_positions` (the copies' slots read as -1).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .. import forwards
from ..engines import hf
from ..kv.block import KVBlock
from ..kv.segments import CONTEXT_TOKENS

__all__ = ["FramedDecode", "TextCopy", "copy_mask", "copy_chunk", "text_rate", "texts_alone", "CPU_CHUNK", "CPU_TEXT_IDS", "CUDA_TEXT_IDS"]


def copy_chunk(device: torch.device) -> int:
    """Reply tokens fed to the copies at once. On CUDA every decode step carries its token's
    copies (a step costs the read of the weights; one more query is nearly free: assumed, not
    measured yet). On a CPU a 2-token forward of the embedded model costs 1.5x a 1-token one
    (63 against 43 ms; 17 tokens: 73 ms), so the copies wait for 16 tokens and ride on one
    step: about 2 ms more per generated token, and at most 15 tokens fed after the reply
    (:meth:`FramedDecode.flush`). A named heuristic from that one measurement."""
    return 1 if torch.device(device).type == "cuda" else CPU_CHUNK


#: Reply tokens per copy chunk on a CPU (:func:`copy_chunk`).
CPU_CHUNK = 16

#: Text-copy ids fed per sender token on a CPU, all text copies together. Measured on the
#: embedded model over a 450-token cache: a 64-id forward costs 2.2 ms per id, a 256-id one 1.7
#: (a long prefill 1.6-1.8): big chunks waste least, at the price of a few slow steps (about
#: 0.45 s each) early in the sender's reply. A named heuristic from that one measurement.
CPU_TEXT_IDS = 256
#: The same on CUDA, where a decode step is bound by reading the weights until a few hundred
#: queries (assumed, not measured: ``benchmarks/gpu_check.sh`` has never run).
CUDA_TEXT_IDS = 256


def text_rate(device: torch.device, copies: int) -> int:
    """Ids of each of ``copies`` text copies fed per sender token on ``device``."""
    total = CUDA_TEXT_IDS if torch.device(device).type == "cuda" else CPU_TEXT_IDS
    return max(1, total // max(1, copies))


def texts_alone(device: torch.device) -> bool:
    """Whether text copies are computed each in a forward of its own after the reply rather
    than riding on the sender's forwards. On a CPU a forward's cost grows with its ids from a few
    ids on, so riding saves nothing, and a copy fed beside the sender and the other copies attends
    over all of their slots under a 4-D mask: on the long document (h) the first agent's decode
    ran at 819 ms per token against dense's 92 (benchmarks/LAB.md). Alone, a copy costs about
    what its reader's own prefill of the text would. On CUDA a decode step is bound by reading
    the weights, so riding is assumed nearly free (not measured)."""
    return torch.device(device).type != "cuda"


def _compute_alone(model, text: "TextCopy") -> None:
    """Compute ``text``'s ids after its prefix in one forward of their own; sets ``text.kv``.
    A prefix shorter than the text is computed again with it (one causal forward, no mask: on a
    CPU the masked forward after a short cached prefix costs more than the prefix,
    :mod:`kvcomm_agents.prefill_cost`); a longer one is reused from ``text.prefix``."""
    ids = torch.tensor(text.prefix_ids + text.ids, dtype=torch.long)
    start, n = text.start, len(text.prefix_ids) + len(text.ids)
    if start < len(text.ids):
        pre = hf.prefill(model, ids, torch.arange(n))
    else:
        pre = hf.prefill(model, ids, torch.arange(start, n), text.prefix, torch.arange(start))
    text.kv = hf.kv_at_positions(pre.cache, pre.slot_positions, torch.arange(start, n))
    text.fed = len(text.ids)


def copy_mask(key_pos: torch.Tensor, key_ctx: torch.Tensor, q_pos: torch.Tensor, q_ctx: torch.Tensor,
              keep: Sequence[int], *, dtype: torch.dtype) -> torch.Tensor:
    """``[Q, K]`` additive mask of one forward that feeds copies beside the sender.

    A query of context ``c`` at position ``p`` sees a key of context ``s`` at position ``q`` iff
    ``q <= p`` and either ``s == c``, or ``s`` is the sender's (0) and ``q < keep[c - 1]`` (a
    copy reads the sender's prompt up to where its reader's text departs from it; a text copy,
    ``keep`` 0, reads none of it). The sender (context 0) sees its own keys only.

    Args:
        key_pos, key_ctx: ``[K]`` int64 position and context of each key (cached slots, then the
            forward's own queries).
        q_pos, q_ctx: ``[Q]`` int64 position and context of each query.
        keep: per copy context ``1..C``, how many of the sender's first positions it reads.
        dtype: the mask's dtype (hidden positions hold its most negative value).
    """
    limit = torch.tensor([torch.iinfo(torch.long).max] + list(keep), dtype=torch.long)[q_ctx]
    visible = (key_pos[None, :] <= q_pos[:, None]) & (
        (key_ctx[None, :] == q_ctx[:, None]) | ((key_ctx[None, :] == 0) & (key_pos[None, :] < limit[:, None])))
    mask = torch.zeros(visible.shape, dtype=dtype)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    return mask


@dataclass
class TextCopy:
    """Prompt text computed after a reader's prefix.

    Attributes:
        ids: the ``T`` text ids, in the order the reader reads them.
        prefix_ids: the reader's ``P`` ids before the text (from its prompt's first id).
        prefix: their exact KV, keys at positions ``0..P-1`` (``[L][1, kv_heads, P, head_dim]``).
        source_start: prompt position of ``ids[0]`` in the sender's prompt.
        fed: text ids fed so far.
        kv: the copy's KV of the ``T`` text ids (keys at positions ``P..P+T-1``), once every
            id was fed and the copy left the cache (:meth:`FramedDecode.retire_texts`).
    """

    ids: tuple[int, ...]
    prefix_ids: tuple[int, ...]
    prefix: KVBlock
    source_start: int
    fed: int = 0
    kv: Optional[KVBlock] = None  # the text's ``T`` computed KV, once taken out of the cache

    @property
    def start(self) -> int:
        """Position of the text's first id after the prefix."""
        return len(self.prefix_ids)

    def context_ids(self, offset: int) -> tuple[int, ...]:
        """The last ids before text id ``offset`` in this copy."""
        return (self.prefix_ids + self.ids[:offset])[-CONTEXT_TOKENS:]


class FramedDecode:
    """A sender's copies (reply framings and prompt texts), fed with its own forwards.

    A query of context ``c`` at position ``p`` sees a key of context ``s`` at position ``q`` iff
    ``q <= p`` and either ``s == c``, or ``s`` is the sender's (0) and ``q < keep_c`` (reply
    framing ``c``: the sender's prompt without its ``drop`` ids; a text copy: nothing of the
    sender's). Contexts ``1..R`` are ``rules``, ``R+1..R+K`` are ``texts``.

    Args:
        rules: the reply framings (:class:`~kvcomm_agents.framing.FramingRule`).
        prompt_slot_positions: ``[S]`` prompt position of each cache slot after the prefill.
        num_prompt: ``N``, the sender's prompt length.
        chunk: reply tokens fed to the reply copies at once (:func:`copy_chunk`).
        texts: the text copies (:mod:`.texts`).
        rate: ids of each text copy fed per sender token (:func:`text_rate`).
        texts_alone: compute each text copy after the reply in a forward of its own (its prefix's
            KV, then its ids under the causal mask) instead of riding on the sender's forwards
            (:func:`texts_alone`).
    """

    def __init__(self, rules: Sequence, prompt_slot_positions: torch.Tensor, num_prompt: int,
                 chunk: int = 1, texts: Sequence[TextCopy] = (), rate: int = 1, texts_alone: bool = False) -> None:
        self.rules = list(rules)
        self.texts = list(texts)
        self.keep = [num_prompt - rule.drop for rule in self.rules] + [0] * len(self.texts)
        self.slot_ctx = torch.zeros(prompt_slot_positions.numel(), dtype=torch.long)
        self.slot_pos = prompt_slot_positions.detach().cpu().clone()
        self.num_prompt, self.chunk, self.rate = num_prompt, max(1, chunk), max(1, rate)
        self.sent = 0  # reply tokens fed to the sender
        self.fed = 0  # reply tokens fed to the reply copies (the same in every framing)
        self.reply_ids: list[int] = []  # those tokens
        self.pending: list[int] = []  # reply tokens the reply copies have not been fed yet
        self.led_out = False  # the reply framings' lead-outs were fed (after the whole reply)
        self.unfed: tuple[int, ...] = ()  # reply ids fed to the copies before their lead-outs only (flush)
        self.texts_alone = texts_alone and bool(self.texts)
        self._prefixes_in = not self.texts or self.texts_alone  # the text copies' prefixes are in the cache
        self._texts_out = not self.texts or self.texts_alone  # the text copies' KV left the cache (or never entered)
        self.texts_s = 0.0  # seconds computing the text copies alone (:meth:`flush`)
        self.reply_copy_ids = 0  # ids fed to the reply framings (lead-ins and lead-outs included)

    def _queries(self, copies: Sequence[int], tokens: Sequence[int], take: int,
                 lead_outs: bool = False) -> tuple[list[int], list[int], list[int]]:
        """Ids, positions and contexts of one forward feeding ``copies`` to every reply framing
        (or, ``lead_outs``, each framing's lead-out after the whole reply), up to ``take`` ids to
        each text copy, and ``tokens`` to the sender (last)."""
        ids, pos, ctx = [], [], []
        for c, rule in enumerate(self.rules, start=1):
            if not copies:
                break
            lead = list(rule.lead_in) if self.fed == 0 else []
            first = self.keep[c - 1] + (0 if self.fed == 0 else len(rule.lead_in) + self.fed)
            ids += lead + list(copies)
            pos += list(range(first, first + len(lead) + len(copies)))
            ctx += [c] * (len(lead) + len(copies))
        for c, rule in enumerate(self.rules if lead_outs else (), start=1):
            fed = (self.unfed + rule.lead_out) if rule.lead_out else ()
            first = self.reply_start(c - 1) + self.fed + len(copies)  # after the reply, ``copies`` included
            ids += list(fed)
            pos += list(range(first, first + len(fed)))
            ctx += [c] * len(fed)
        for c, text in enumerate(self.texts, start=len(self.rules) + 1):
            part = text.ids[text.fed:text.fed + take]
            ids += list(part)
            pos += list(range(text.start + text.fed, text.start + text.fed + len(part)))
            ctx += [c] * len(part)
        first = self.num_prompt + self.sent
        ids += list(tokens)
        pos += list(range(first, first + len(tokens)))
        ctx += [0] * len(tokens)
        return ids, pos, ctx

    def mask(self, q_pos: torch.Tensor, q_ctx: torch.Tensor, *, dtype: torch.dtype, device) -> torch.Tensor:
        """``[1, 1, Q, S + Q]`` additive mask of queries at ``q_pos`` in contexts ``q_ctx`` over
        the cached slots then the queries themselves (:func:`copy_mask`)."""
        return copy_mask(torch.cat([self.slot_pos, q_pos]), torch.cat([self.slot_ctx, q_ctx]), q_pos, q_ctx,
                         self.keep, dtype=dtype)[None, None].to(device)

    def forward(self, model, cache, tokens: Sequence[int], *, last_logits_only: bool = True) -> torch.Tensor:
        """Feed ``tokens`` to the sender, and the copies their due share (``cache`` grows);
        returns the sender's logits ``[1, len(tokens) or 1, vocab]``. Many tokens at once (a
        replay) go in windows whose mask stays within :data:`~kvcomm_agents.engines.hf.MASK_BUDGET`
        elements, as a long prefill does; each window carries what as many decode steps would."""
        tokens = list(tokens)
        rows = []
        for window in self._windows(len(tokens)):
            part = tokens[window]
            self.pending += part
            copies = self.pending if len(self.pending) >= self.chunk else []
            rows.append(self._run(model, cache, copies, part, 1 if last_logits_only else len(part),
                                  self._take(self.rate * len(part), (len(self.rules) + 1) * len(part))))
        return rows[-1] if last_logits_only else torch.cat(rows, dim=1)

    def _windows(self, n: int) -> list[slice]:
        """Slices of ``n`` tokens fed at once: each forward's queries times its keys within the
        mask budget (at least :data:`CPU_CHUNK` tokens a window)."""
        live = [text for text in self.texts if text.fed < len(text.ids) and not self.texts_alone]  # copies still fed
        per_token = len(self.rules) + 1 + self.rate * len(live)
        keys = (self.slot_pos.numel() + per_token * n + sum(len(rule.lead_in) for rule in self.rules)
                + sum(len(text.prefix_ids) for text in live))
        width = max(CPU_CHUNK, hf.MASK_BUDGET // max(1, per_token * keys))
        return [slice(i, min(n, i + width)) for i in range(0, n, width)]

    @property
    def text_left(self) -> int:
        """Text-copy ids not fed yet."""
        return sum(len(text.ids) - text.fed for text in self.texts)

    def _take(self, take: int, others: int) -> int:
        """Ids of each text copy one forward feeds: ``take``, halved (down to :data:`CPU_CHUNK`)
        until the forward's queries (``others`` besides the text ids) times its keys fit the
        mask budget; what is left rides on later forwards or :meth:`flush`."""
        if self.texts_alone:
            return 0
        k, slots = len(self.texts), self.slot_pos.numel()
        while take > CPU_CHUNK and (k * take + others) * (slots + k * take + others) > hf.MASK_BUDGET:
            take //= 2
        return take

    def feed_copies(self, model, cache, ids: Sequence[int]) -> None:
        """Feed reply ``ids`` to the reply copies only (no sender token: the sender's reply was
        computed in another cache), in forwards whose mask stays within
        :data:`~kvcomm_agents.engines.hf.MASK_BUDGET`; :meth:`flush` then feeds the lead-outs."""
        ids, rules = list(ids), max(1, len(self.rules))
        lead_ins = sum(len(rule.lead_in) for rule in self.rules)
        at = 0
        while at < len(ids):
            keys = self.slot_pos.numel() + rules * (len(ids) - at) + lead_ins  # at most, this forward
            width = max(CPU_CHUNK, hf.MASK_BUDGET // max(1, rules * keys))
            self._run(model, cache, ids[at:at + width], [], 1, 0)
            at += width

    def flush(self, model, cache, tail: Sequence[int] = ()) -> None:
        """Feed the copies what they have not been fed yet (after the reply), then each reply
        framing's lead-out after ``tail`` (the reply's ids never fed: its last generated id,
        unless an end of sequence), in forwards whose mask stays within the budget."""
        lead_outs = bool(self.fed or self.pending) and not self.led_out and any(rule.lead_out for rule in self.rules)
        if lead_outs:  # in the same forward as the reply's last ids
            self.unfed = tuple(tail)
            self._run(model, cache, self.pending, [], 1, 0, lead_outs=True)
            self.led_out = True
        elif self.pending and self.rules:
            self._run(model, cache, self.pending, [], 1, 0)
        if self.texts_alone:
            started = time.perf_counter()
            for text in self.texts:
                _compute_alone(model, text)
            hf.wait_for(hf.input_device(model))  # the forwards' end, not their launch
            self.texts_s += time.perf_counter() - started
        while self.text_left:
            self._run(model, cache, [], [], 1, self._take(max(len(t.ids) - t.fed for t in self.texts), 0))

    def _inject_prefixes(self, cache) -> None:
        """Put each text copy's prefix KV into the cache, as slots of its context."""
        for c, text in enumerate(self.texts, start=len(self.rules) + 1):
            hf.append_kv(cache, text.prefix)
            self.slot_pos = torch.cat([self.slot_pos, torch.arange(text.start)])
            self.slot_ctx = torch.cat([self.slot_ctx, torch.full((text.start,), c, dtype=torch.long)])
        self._prefixes_in = True

    def retire_texts(self, cache) -> None:
        """Take the text copies' KV out of the cache (into :attr:`TextCopy.kv`), prefixes
        included, once every text id was fed: the sender's later steps attend over its own slots
        (and the reply copies') only."""
        if self._texts_out or self.text_left:
            return
        text_contexts = torch.zeros(len(self.rules) + len(self.texts) + 1, dtype=torch.bool)
        text_contexts[len(self.rules) + 1:] = True
        for index, text in enumerate(self.texts):
            text.kv = hf.kv_at_positions(cache, self.slot_positions(self.text_context(index)),
                                         torch.arange(text.start, text.start + len(text.ids)))
        keep = (~text_contexts[self.slot_ctx]).nonzero().flatten()
        hf.keep_slots(cache, keep)
        self.slot_pos, self.slot_ctx = self.slot_pos[keep], self.slot_ctx[keep]
        self._texts_out = True

    @property
    def _alone(self) -> bool:
        """Only the sender's slots are left: a plain causal forward serves."""
        return not self.rules and self._texts_out

    def _run(self, model, cache, copies: list[int], tokens: Sequence[int], rows: int, take: int,
             lead_outs: bool = False) -> torch.Tensor:
        """One forward; the logits of its last ``rows`` queries (the sender's)."""
        if not self._prefixes_in:
            self._inject_prefixes(cache)
        ids, pos, ctx = self._queries(copies, tokens, take, lead_outs)
        q_pos, q_ctx = torch.tensor(pos, dtype=torch.long), torch.tensor(ctx, dtype=torch.long)
        device = hf.input_device(model)
        mask = None if self._alone else self.mask(q_pos, q_ctx, dtype=model.dtype, device=device)
        with forwards.sender_tokens(len(tokens)):  # the rest of the forward's ids are copies
            logits = hf.run_forward(model, torch.tensor([ids], device=device), cache,
                                    position_ids=q_pos[None].to(device), attention_mask=mask, logits_rows=rows)
        self.slot_pos = torch.cat([self.slot_pos, q_pos])
        self.slot_ctx = torch.cat([self.slot_ctx, q_ctx])
        self.sent += len(tokens)
        self.reply_copy_ids += int(((q_ctx >= 1) & (q_ctx <= len(self.rules))).sum())
        if copies:
            self.fed += len(copies)
            self.reply_ids += copies
            self.pending = []
        for text in self.texts:
            text.fed = min(len(text.ids), text.fed + take)
        self.retire_texts(cache)
        return logits

    def slot_positions(self, context: int = 0) -> torch.Tensor:
        """``[slots]`` position of each cache slot in ``context`` (-1 for the other contexts')."""
        return torch.where(self.slot_ctx == context, self.slot_pos, torch.full_like(self.slot_pos, -1))

    def reply_start(self, index: int) -> int:
        """Position of the reply's first token in framing ``index``."""
        return self.keep[index] + len(self.rules[index].lead_in)

    def lead_out_start(self, index: int) -> int:
        """Position of framing ``index``'s lead-out (after the reply and its :attr:`unfed`)."""
        return self.reply_start(index) + self.fed + len(self.unfed)

    def context_ids(self, prompt_ids: torch.Tensor, index: int) -> tuple[int, ...]:
        """The last ids before the reply in framing ``index`` (``prompt_ids``: ``[N]`` int64)."""
        keep, rule = self.keep[index], self.rules[index]
        ids = tuple(prompt_ids[max(0, keep - CONTEXT_TOKENS):keep].tolist()) + tuple(rule.lead_in)
        return ids[-CONTEXT_TOKENS:]

    def text_context(self, index: int) -> int:
        """The context number of text copy ``index``."""
        return len(self.rules) + 1 + index
