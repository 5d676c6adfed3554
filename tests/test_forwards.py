"""Every token a call forwards through the model is charged to the call (CallStats.forwarded),
by purpose: the prompt's prefill, the decode, the copies riding on it or fed after it, audits."""

import pytest
import torch

from kvcomm_agents import KVCommConfig, KVCommEngine
from kvcomm_agents.forwards import ForwardTally, charge, charging, sender_tokens

from .conftest import QUESTION, REPLY, forced, solver_messages


class ModelTokens:
    """Counts the query tokens of every forward of a model (independent of the engine)."""

    def __init__(self, model):
        self.tokens = 0
        self.handle = model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.tokens += int(ids.numel())

    def take(self) -> int:
        tokens, self.tokens = self.tokens, 0
        return tokens


def test_the_tally_splits_a_forward_between_the_sender_and_its_copies():
    tally = ForwardTally()
    charge(5)  # no active tally: nothing happens
    with charging(tally, "decode"):
        charge(1)
        with sender_tokens(1):
            charge(17)  # one sender token, sixteen copy tokens
        with charging(tally, "audit"):
            charge(30)
    assert tally.tokens == {"prompt": 0, "decode": 2, "copies": 16, "audit": 30}
    assert tally.total == 48


def _pipeline(engine, tokenizer, rounds: int, stepwise: bool):
    """``rounds`` requests of a sender and two readers; yields each call's stats."""
    for r in range(rounds):
        question = f"{QUESTION} Count them for basket {'XYZW'[r]}."
        sent = engine.replay([{"role": "system", "content": "You are solver one."},
                              {"role": "user", "content": question}],
                             agent="s1", reply_ids=forced(tokenizer), stepwise=stepwise).result
        yield sent.stats
        for k in (2, 3):
            messages = solver_messages(f"You are solver {k}.", REPLY)
            messages[1]["content"] = question
            if k == 3:
                yield engine.chat(messages, agent=f"s{k}", max_new_tokens=6).stats
            else:
                yield engine.replay(messages, agent=f"s{k}", reply_ids=forced(tokenizer), stepwise=stepwise).result.stats


@pytest.mark.parametrize("stepwise", [True, False])
def test_every_forward_of_a_call_is_in_its_stats(model, tokenizer, stepwise):
    """KVCOMM with copies switched on and an audit on every reused call: what the model forwarded in
    each call (counted by a hook on the model) is what the call's stats say, and the copies and
    audits are among it (a forward the engine did not charge fails here). Re-rotation is not
    trusted on measurement here: a reader served re-rotated is fed no copies."""
    engine = KVCommEngine(model, tokenizer, config=KVCommConfig(audit_every=1, audit_share=None, measured_rerotation=False,
                                                                reply_copies=True, text_copies=True))
    meter = ModelTokens(model)
    try:
        seen = {"copies": 0, "audit": 0}
        for stats in _pipeline(engine, tokenizer, rounds=4, stepwise=stepwise):
            assert meter.take() == stats.forwarded.total
            assert stats.forwarded.prompt == stats.computed_tokens
            for purpose in seen:
                seen[purpose] += getattr(stats.forwarded, purpose)
    finally:
        meter.handle.remove()
    assert seen["audit"] > 0 and seen["copies"] > 0


def test_a_dense_call_forwards_its_prompt_and_its_reply_once(model, tokenizer):
    engine = KVCommEngine(model, tokenizer, config=KVCommConfig(method="dense"))
    ids = forced(tokenizer)
    messages = solver_messages("You are solver two.", REPLY)
    stepwise = engine.replay(messages, agent="s2", reply_ids=ids, stepwise=True)
    whole = engine.replay(messages, agent="s2", reply_ids=ids)
    for replay in (stepwise, whole):
        f = replay.result.stats.forwarded
        assert (f.prompt, f.decode, f.copies, f.audit) == (replay.result.stats.prompt_tokens, len(ids) - 1, 0, 0)
    assert stepwise.greedy_prefix == whole.greedy_prefix
    torch.testing.assert_close(stepwise.logits, whole.logits, atol=1e-4, rtol=1e-4)


def test_greedy_is_chat_with_the_logits_of_every_token(model, tokenizer):
    """``engine.greedy``: the reply ``chat`` gives at temperature 0, and row ``i`` of its logits is
    what teacher forcing that reply gives (row 0: the first token's)."""
    messages = solver_messages("You are solver two.", REPLY)
    free = KVCommEngine(model, tokenizer, config=KVCommConfig(method="dense")).greedy(
        messages, agent="s2", max_new_tokens=8)
    chat = KVCommEngine(model, tokenizer, config=KVCommConfig(method="dense")).chat(
        messages, agent="s2", max_new_tokens=8)
    assert free.result.token_ids == chat.token_ids and free.greedy_prefix == len(chat.token_ids)
    forced = KVCommEngine(model, tokenizer, config=KVCommConfig(method="dense")).replay(
        messages, agent="s2", reply_ids=chat.token_ids)
    assert free.logits.shape[0] == len(chat.token_ids)
    torch.testing.assert_close(free.logits[: forced.logits.shape[0]], forced.logits, atol=1e-4, rtol=1e-4)
