"""The whole-graph protocol: what a user waits for and what the graph costs, every strategy on
the same token ids, in one run (``docs/benchmarks.md``, ``../shared/docs/measuring.md``).

For each request, agent by agent, the strategies take turns in each slot, dense first:

- dense generates the agent's reply greedily: the dense pipeline, run in this run (never read
  from a cache);
- every other strategy replays that reply one decode step per token (``stepwise``), so each
  call costs what a generated reply costs (its copies ride on the same steps), and its first
  token's KL and greedy agreement are taken against dense on the same ids; on a request that
  not every strategy runs (the decision strategies' extra requests: their graphs are not
  timed, only their decisions compared) the reply is fed in one forward, as in a warm-up;
- a ``decider_only`` strategy (the bf16 noise floor) takes part in the last agent's call only;
- a strategy that computes ahead (pipelined exact prefill) gets, right after the sender's reply
  and inside the sender's turn, every later reader's prompt as far as it is known;
- where the workload's last agent decides (a judge, an aggregator), a strategy whose greedy run
  departs from dense's reply then generates its own decision (anchors frozen, untimed and not
  charged to the graph: a measurement, not part of it), so that its pick can be compared with
  dense's (judge consistency, arXiv 2601.08343).

Every call's cost is charged to the graph whose request caused it: its wall time (the whole call:
prefill, decode, copies fed during or after it, audits, planning, capture, and what the strategy
computed ahead for its readers) and the tokens forwarded through the model, counted by a hook on
the model itself (:class:`ModelMeter`), so a forward no one itemized is still counted.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import torch

from kvcomm_agents.engines import hf
from kvcomm_agents.fidelity import first_token_kl
from kvcomm_agents.prompt import render_prompt

from .measure import _record, _rotated, agreement_window, reused_positions, shared_text_positions
from .strategies import CallOutcome, Strategy
from .workloads import Request, Workload

__all__ = ["ModelMeter", "run_graph", "known_prompts"]

#: two stand-ins for a reply not written yet: a reader's prompt is known up to where they differ
_UNKNOWN = ("Alpha bravo charlie, a reply not written yet.", "Zulu yankee xray: another text.")


class ModelMeter:
    """Counts the query tokens of every forward of ``model`` (a forward pre-hook), and of any
    model :meth:`watch` adds (the bf16 noise floor's copy): independent of what any engine
    reports about itself."""

    def __init__(self, model) -> None:
        self.tokens = 0
        self._handles = []
        self._devices: list[torch.device] = []
        self.watch(model)

    def watch(self, model) -> None:
        self._handles.append(model.register_forward_pre_hook(self._count, with_kwargs=True))
        self._devices.append(hf.input_device(model))

    def finish(self) -> None:
        """Wait for the work queued on the watched models' devices: a timer read after it
        counts what a strategy launched (an accelerator runs asynchronously), so that nothing
        it queued is paid inside the next strategy's window."""
        for device in dict.fromkeys(self._devices):
            hf.wait_for(device)

    def _count(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids")
        if ids is None and args:
            ids = args[0]
        if ids is None:
            ids = kwargs["inputs_embeds"][..., 0]
        self.tokens += int(ids.numel())

    @contextmanager
    def measuring(self) -> Iterator[list[int]]:
        """Yields a one-item list that holds, after the block, the tokens forwarded inside it."""
        box = [0]
        start = self.tokens
        try:
            yield box
        finally:
            box[0] = self.tokens - start

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def known_prompts(tokenizer, request: Request, k: int, replies: list[str]) -> list[torch.Tensor]:
    """While agent ``k`` decodes, each later agent's prompt ids as far as they are known: rendered
    with two different stand-ins for every reply not written yet, up to where the two differ."""
    out = []
    for j in range(k + 1, len(request.agents)):
        first, second = (render_prompt(tokenizer, request.messages(j, replies[:k] + [u] * (j - k))).ids
                         for u in _UNKNOWN)
        n = min(first.numel(), second.numel())
        differ = (first[:n] != second[:n]).nonzero()
        out.append(first[: int(differ[0, 0]) if differ.numel() else n])
    return out


def run_graph(workload: Workload, strategies: list[Strategy], *, warmup: int, phase: str, tokenizer, eos_ids,
              meter: ModelMeter, progress: Callable[[int], None] = lambda n: None,
              checkpoint: Callable[[list[dict]], None] = lambda records: None,
              renew: Optional[Callable[[], list[Strategy]]] = None) -> tuple[list[dict], list[dict]]:
    """The protocol over every request (the first ``warmup`` marked warm-up: they fill stores
    and anchor pools and are left out of summaries; non-dense strategies replay them in one
    forward per reply, which fills the same state faster). ``renew``: fresh strategies (nothing
    stored, nothing learned) for every request, so that each is a graph's first. Returns per-call
    records and, for a workload whose last agent decides, per-request answers."""
    names = [s.name for s in strategies]
    if not names or names[0] != "dense":
        raise ValueError("the graph protocol needs the dense strategy first (it writes the replies)")
    records, answers = [], []
    for r, request in enumerate(workload.requests):
        if renew is not None and r:
            strategies = renew()
        replies: list[str] = []
        reply_ids: list[list[int]] = []
        picks: dict[str, Optional[str]] = {}
        measured = r >= warmup
        # a graph is timed where every strategy runs it whole: elsewhere replies are fed at once
        timed = measured and all(s.takes_part(r) for s in strategies if not s.decider_only)
        kls: dict[str, Optional[float]] = {}
        for k, agent in enumerate(request.agents):
            messages = request.messages(k, replies)
            shared = request.shared_texts(k, replies)
            last = k + 1 == len(request.agents)
            taking_part = [s for s in strategies if s.takes_part(r) and (last or not s.decider_only)]
            order = [taking_part[0]] + _rotated(taking_part[1:], r + k)
            outcomes: dict[str, CallOutcome] = {}
            costs: dict[str, tuple[float, float, int]] = {}  # wall s, call s, tokens
            for strategy in order:
                forced = reply_ids[k] if strategy.name != "dense" else None
                with meter.measuring() as tokens:
                    started = time.perf_counter()
                    out = strategy.call(messages, agent, forced, max_new_tokens=workload.reply_tokens,
                                        stepwise=timed, shared_texts=shared)
                    meter.finish()
                    called = time.perf_counter()
                    if strategy.name == "dense":
                        reply_ids.append(list(out.token_ids))
                        replies.append(out.text)
                    if strategy.computes_ahead and not last:
                        strategy.ahead(known_prompts(tokenizer, request, k, replies))
                        meter.finish()
                    wall = time.perf_counter() - started
                outcomes[strategy.name] = out
                costs[strategy.name] = (wall - out.untimed_s, called - started - out.untimed_s,
                                        tokens[0] - out.untimed_tokens)
            dense = outcomes["dense"]
            window = agreement_window(reply_ids[k], eos_ids)
            texts = list(shared)
            positions = shared_text_positions(tokenizer, messages, texts, dense.prompt_tokens) if texts else None
            for strategy in taking_part:
                out = outcomes[strategy.name]
                wall, call_s, tokens = costs[strategy.name]
                records.append({
                    **_record(phase, workload, r, request.key, not measured, k, agent, strategy, out, dense),
                    "format": request.meta.get("format"),
                    "wall_s": wall, "call_s": call_s, "model_tokens": tokens, "decoded_tokens": max(0, len(out.token_ids) - 1),
                    "forwarded": None if out.stats is None else out.stats.forwarded.model_dump(),
                    "kl": None if out.logits is None else first_token_kl(dense.logits, out.logits),
                    "agree": None if out.greedy_prefix is None or window == 0 else out.greedy_prefix >= window,
                    "agree_window": window, "greedy_prefix": out.greedy_prefix, "forced_tokens": len(reply_ids[k]),
                    "shared_text_tokens": None if positions is None else len(positions),
                    "shared_text_reused": None if positions is None else len(positions & (
                        set(range(out.prompt_tokens)) if out.stats is None else reused_positions(out.stats))),
                })
                if last and workload.decider and measured and strategy.generates:
                    picks[strategy.name] = _decision(workload, strategy, out, messages, agent, replies, meter)
                    kls[strategy.name] = records[-1]["kl"]
            progress(1)
        if picks:
            answers.append({"phase": phase, "request": r, "key": request.key, "warmup": not measured,
                            "gold": request.gold, "answers": picks, "kl": kls})
        checkpoint(records)
    return records, answers


def _decision(workload: Workload, strategy: Strategy, out: CallOutcome, messages: list[dict], agent: str,
              replies: list[str], meter: ModelMeter) -> Optional[str]:
    """The decider's pick under ``strategy``: dense's where its greedy run gives dense's whole
    reply, else its own greedy reply's (generated apart: anchors frozen, outside the graph's cost)."""
    if strategy.name == "dense" or out.greedy_prefix is None or out.greedy_prefix >= len(out.token_ids):
        return workload.final_answer(replies)
    with meter.measuring(), strategy.frozen():
        own = strategy.call(messages, agent, None, max_new_tokens=workload.reply_tokens)
    return workload.final_answer(replies[:-1] + [own.text])
