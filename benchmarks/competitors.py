"""The workload's limit (the lower bound): each call with the prefill of shared text removed,
the competitor every whole-graph speed-up is a share of."""

from __future__ import annotations

import time

import torch

from kvcomm_agents import KVCommConfig
from kvcomm_agents.drafting import NgramDraft, RecentReplies
from kvcomm_agents.engines import hf
from kvcomm_agents.prompt import render_prompt
from kvcomm_agents.step_costs import StepCosts

from .outcome import CallOutcome, Strategy, cuda_peak_extra, cuda_peak_start

__all__ = ["LowerBound"]

DEFAULT = KVCommConfig()


class LowerBound(Strategy):
    """The workload's limit: the same call with the prefill of shared text removed. The prompt's
    positions holding ``shared_texts`` (text an earlier agent already read or wrote), and its
    longest exact prefix any earlier call computed (what prefix caching gives every strategy),
    take exact KV from a dense prefill run beforehand, left out of the figure
    (``untimed_tokens``, ``untimed_s``); the call computes only the rest of its prompt, under the
    position mask, and decodes its reply as the library's calls do (drafts from its own ids, else
    its last replies, their lengths from the forward costs it measured: ``KVCommConfig.draft_tokens``,
    ``draft_recent_replies``, ``experimental.measured_draft_lengths``): a reuse method
    that lost nothing and cost nothing."""

    generates = False

    def __init__(self, model, tokenizer):
        self.name = "lower-bound"
        self.model, self.tokenizer = model, tokenizer
        self.device = model.get_input_embeddings().weight.device
        self.seen: list[torch.Tensor] = []  # every earlier call's prompt and reply ids
        self.recent = RecentReplies(DEFAULT.draft_recent_replies)  # as an engine's decode steps keep them
        self.costs = StepCosts()  # and its draft lengths (experimental.measured_draft_lengths)

    def _prefix(self, ids: torch.Tensor) -> int:
        """The longest common prefix of ``ids`` with an earlier call's prompt and reply."""
        best = 0
        for earlier in self.seen:
            n = min(earlier.numel(), ids.numel())
            differ = (earlier[:n] != ids[:n]).nonzero()
            best = max(best, int(differ[0, 0]) if differ.numel() else n)
        return best

    @torch.inference_mode()
    def call(self, messages, agent, forced_ids=None, max_new_tokens=128, *, stepwise=True,
             shared_texts=()) -> CallOutcome:
        from .measure import shared_text_positions

        ids = render_prompt(self.tokenizer, messages).ids
        n = int(ids.numel())
        if not stepwise:  # a warm-up call: only what prefix caching would remember of it
            reply = list(forced_ids or [])
            self.seen.append(torch.cat([ids, torch.tensor(reply[:-1], dtype=torch.long)]))
            self.recent.add(reply)
            return CallOutcome(ttft_s=0.0, before_prefill_s=0.0, prompt_tokens=n, reused_tokens=0, logits=None,
                               greedy_prefix=None, token_ids=reply, text="")
        found = shared_text_positions(self.tokenizer, messages, list(shared_texts), n) if shared_texts else None
        shared = sorted(p for p in set(found or ()) | set(range(self._prefix(ids))) if p < n - 1)
        untimed = time.perf_counter()
        dense = hf.prefill(self.model, ids, torch.arange(n)) if shared else None
        reused_positions = torch.tensor(shared, dtype=torch.long)
        computed = torch.tensor(sorted(set(range(n)) - set(shared)), dtype=torch.long)
        block = hf.kv_at_positions(dense.cache, dense.slot_positions, reused_positions) if shared else None
        hf.wait_for(self.device)  # the untimed prefill's end, not its launch: none of it in the timed window
        untimed = time.perf_counter() - untimed
        start = cuda_peak_start(self.device)
        t0 = time.perf_counter()
        layout = render_prompt(self.tokenizer, messages)  # timed: every strategy renders its prompt
        pre = hf.prefill(self.model, layout.ids, computed, block, reused_positions if shared else None,
                         masked=bool(shared))
        first = int(torch.argmax(pre.logits))  # waits for the device
        ttft = time.perf_counter() - t0
        reply = list(forced_ids) if forced_ids is not None else [first]
        rows = [pre.logits]
        costs = self.costs if DEFAULT.experimental.measured_draft_lengths else None
        drafts = (NgramDraft([*layout.ids.tolist(), reply[0]], DEFAULT.draft_tokens, recent=self.recent,
                             costs=costs)  # as the library's calls
                  if hf.batchable(pre.cache) else None)  # (a sliding-window cache cannot be cut back)
        while len(rows) < len(reply):
            r = len(rows)
            draft = drafts.draft(len(reply) - r - 1) if drafts is not None else []
            stepped = time.perf_counter()
            out = hf.run_forward(self.model, torch.tensor([[reply[r - 1], *draft]], device=self.device), pre.cache,
                                 position_ids=torch.arange(n + r - 1, n + r + len(draft), device=self.device)[None],
                                 last_logits_only=False)[0].float()
            hf.wait_for(out.device)  # the forward's end, not its launch
            self.costs.record(len(draft) + 1, time.perf_counter() - stepped)
            kept = next((i for i, d in enumerate(draft) if d != reply[r + i]), len(draft))
            rows.extend(out[:kept + 1])
            if drafts is not None:
                hf.keep_first(pre.cache, hf.num_cached(pre.cache) - (len(draft) - kept))
                drafts.settle(len(draft), kept)
                drafts.extend(reply[r:r + kept + 1])
        greedy = 0
        while greedy < len(reply) and int(torch.argmax(rows[greedy])) == reply[greedy]:
            greedy += 1
        self.seen.append(torch.cat([ids, torch.tensor(reply[:-1], dtype=torch.long)]))
        self.recent.add(reply)
        return CallOutcome(
            ttft_s=ttft, before_prefill_s=0.0, prompt_tokens=n, reused_tokens=len(shared), logits=pre.logits.cpu(),
            greedy_prefix=greedy, token_ids=reply, text="", peak_extra_bytes=cuda_peak_extra(self.device, start),
            untimed_tokens=n if shared else 0, untimed_s=untimed,
        )
