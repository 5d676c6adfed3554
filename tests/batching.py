"""Calls decoding at once on one engine, for the batched-decode tests: prompts, a greedy picker
that never ends early, and threads started together."""

import threading

import torch

from kvcomm_agents import ChatResult

PAGE = ("The library opens at nine and closes at five on weekdays. On Saturdays it opens at ten and "
        "closes at two. It is closed on Sundays and on public holidays. Members may borrow six books.")
ROLES = ("Analyst", "Reviewer", "Tester", "Planner")


def branch(k: int) -> list[dict]:
    """Prompts that share no prefix beyond the chat template's first ids (the plans do not
    depend on which sibling runs first)."""
    return [{"role": "system", "content": f"{ROLES[k]} {k}: answer from the page."},
            {"role": "user", "content": f"Page:\n{PAGE}\n\nQuestion {k}: what {'and why ' * k}?"}]


def at_once(engine, calls: int, run) -> dict:
    """``run(engine, k)`` for each of ``calls`` branches in a thread of its own, started together."""
    out, errors = {}, {}
    start = threading.Barrier(calls)

    def go(k):
        start.wait()
        try:
            out[k] = run(engine, k)
        except Exception as error:  # noqa: BLE001 - collected for the test to inspect
            errors[k] = error

    threads = [threading.Thread(target=go, args=(k,)) for k in range(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors or out


def longest(engine):
    """Greedy, never an end-of-sequence id: replies run to ``max_new_tokens`` (the tiny random
    models often end after a token or two)."""
    ends = sorted(engine.info.eos_ids)

    def pick(logits):
        logits = logits[: len(engine.tokenizer)].clone()
        logits[ends] = float("-inf")
        return int(torch.argmax(logits))

    return pick


def generate(engine, k, pick=None, tokens: int = 24):
    """Branch ``k``'s call as :meth:`KVCommEngine.stream` runs it, with the token picker given."""
    return engine._generate(branch(k), f"a{k}", tokens, pick or longest(engine), None, None, None)


def greedy(engine, k):
    return next(i for i in generate(engine, k) if isinstance(i, ChatResult))


def greedy_with(engine, k, pick, tokens: int = 24):
    return next(i for i in generate(engine, k, pick, tokens) if isinstance(i, ChatResult))


def waiting(prefilled: threading.Barrier, engine):
    """:func:`longest`'s picker that waits at ``prefilled`` before the first token (every call
    prefilled before any steps, so they decode at once whatever the thread scheduler does: a
    tiny model's steps are shorter than a thread's time slice); ``pick.rows``: the logits seen."""
    choose, rows = longest(engine), []

    def pick(logits):
        if not rows:
            prefilled.wait()
        rows.append(logits.detach().float().cpu())
        return choose(logits)

    pick.rows = rows
    return pick


def greedy_together(calls: int):
    """Greedy calls decoding at once (:func:`waiting`): ``(ChatResult, [n, vocab] logits)`` each."""
    prefilled = threading.Barrier(calls)

    def run(engine, k):
        pick = waiting(prefilled, engine)
        return next(i for i in generate(engine, k, pick) if isinstance(i, ChatResult)), torch.stack(pick.rows)

    return run
