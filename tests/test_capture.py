"""``kvcomm_agents.capture``: what a finished call leaves in the store for the calls after it
(the exact prefix, user/tool messages seen for the first time, the reply), with which context
ids, and keys in the canonical frame. The call's KV comes from a plain dense prefill here: no
engine is involved."""

import pytest
import torch

from kvcomm_agents import KVCommConfig
from kvcomm_agents.capture import CallCapture, align_ids_to_text, message_kind
from kvcomm_agents.engines import hf
from kvcomm_agents.kv.segments import CONTEXT_TOKENS
from kvcomm_agents.kv.store import SegmentStore
from kvcomm_agents.plan import CallPlan, ReusedRun, SegmentDecision
from kvcomm_agents.prompt import render_prompt
from kvcomm_agents.support import rotator_from_config

from .conftest import QUESTION, REPLY

FINGERPRINT = "capture-test"
SYSTEM = "You are a careful math solver. Answer the question and give the final number."
NOTE = "The quick brown fox jumps over the lazy dog while the agents debate the answer."
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION},
            {"role": "user", "content": NOTE}]
ROLES = [("system", None), ("user", None), ("user", None)]


class Call:
    """One dense call of ``MESSAGES`` with ``REPLY``'s ids fed after the prompt: its layout, the
    ids of prompt and reply, and a ``KVAt`` over its cache."""

    def __init__(self, model, tokenizer):
        self.layout = render_prompt(tokenizer, MESSAGES)
        self.generated = tokenizer(REPLY, add_special_tokens=False)["input_ids"]
        self.n = self.layout.ids.numel()
        self.ids = torch.cat([self.layout.ids, torch.tensor(self.generated)])
        with torch.inference_mode():
            pre = hf.prefill(model, self.ids, torch.arange(self.ids.numel()))
        self.kv_at = hf.kv_reader(pre.cache, pre.slot_positions)

    def span(self, index: int) -> range:
        """Prompt positions of message ``index``'s content tokens."""
        return self.layout.tokens_within(*self.layout.content_spans[index])


@pytest.fixture(scope="module")
def call(llama, tokenizer):
    return Call(llama, tokenizer)


def capture_for(llama, tokenizer, **config):
    store = SegmentStore(1 << 30, min_run=8)
    rotator = rotator_from_config(llama.config)
    return CallCapture(store, tokenizer, rotator, FINGERPRINT, KVCommConfig(**{"method": "rerotate", **config})), store


def test_message_kind_names_user_and_tool_messages_only():
    assert message_kind("user") == ("user", None)
    assert message_kind("tool", "search") == ("search", "tool")
    assert message_kind("tool") == ("tool", "tool")  # a tool result without a name
    assert message_kind("system") is None and message_kind("assistant", "s1") is None


def test_align_ids_to_text_maps_canonical_ids_and_leaves_the_rest_unmapped(tokenizer):
    text = "The answer is 72 because 48 plus 24 equals 72."
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoded["input_ids"], [tuple(o) for o in encoded["offset_mapping"]]
    eos = tokenizer.eos_token_id
    assert align_ids_to_text(tokenizer, ids + [eos], text) == offsets + [None]  # eos maps onto no text
    # the model spelt " because" letter by letter (ids the tokenizer would have merged): those
    # ids map nowhere, the ids around them keep their spans
    j = next(i for i, token in enumerate(tokenizer.convert_ids_to_tokens(ids)) if token == "Ġbecause")
    letters = tokenizer.convert_tokens_to_ids(list("Ġbecause"))
    spelt = ids[:j] + letters + ids[j + 1:]
    assert align_ids_to_text(tokenizer, spelt, text) == offsets[:j] + [None] * len(letters) + offsets[j + 1:]


def test_a_dense_call_keeps_its_prefix_its_new_user_messages_and_its_reply(llama, tokenizer, call):
    capture, store = capture_for(llama, tokenizer)
    ref = capture.keep_call(CallPlan(call.layout.ids), "s1", call.generated, REPLY, call.kv_at,
                            layout=call.layout, roles=ROLES)
    prompt_ids = call.layout.ids.tolist()
    # the reply: its ids and text, stamped with the fingerprint, in the context of the whole prompt
    reply = store.get(ref.id)
    assert ref.kind == ("s1", "assistant") and ref.fingerprint == FINGERPRINT
    assert (reply.text, reply.token_ids) == (REPLY, tuple(call.generated))
    assert reply.context_ids == tuple(prompt_ids[-CONTEXT_TOKENS:]) and reply.computed_at == len(prompt_ids)
    # both user messages, each with the ids before it as its context; the system text is not kept
    for index, text in ((1, QUESTION), (2, NOTE)):
        segment = store.find_text(text, FINGERPRINT)
        span = call.span(index)
        assert segment.ref.kind == ("user", None) and segment.token_ids == tuple(prompt_ids[span.start:span.stop])
        assert segment.context_ids == tuple(prompt_ids[max(0, span.start - CONTEXT_TOKENS):span.start])
        assert segment.computed_at == span.start  # where its KV was computed, whatever its context
    assert store.find_text(SYSTEM, FINGERPRINT) is None
    assert store.stats().segments == 3
    # the exact prefix covers prompt and reply
    assert store.longest_prefix(call.ids, FINGERPRINT)[1] == call.ids.numel()


def test_a_message_whose_reference_this_store_could_not_serve_is_kept_and_a_found_one_is_not(llama, tokenizer, call):
    capture, store = capture_for(llama, tokenizer)
    decisions = (SegmentDecision(segment=None, segment_id="gone", message_index=1, found_by="reference",
                                 span=(call.span(1).start, call.span(1).stop), status="prefilled", reason="evicted"),
                 SegmentDecision(segment=None, segment_id="known", message_index=2, found_by="content",
                                 span=(call.span(2).start, call.span(2).stop), status="prefilled", reason="over_kl_budget"))
    capture.capture_messages(call.layout, ROLES, CallPlan(call.layout.ids, decisions=decisions), call.kv_at)
    assert store.find_text(QUESTION, FINGERPRINT) is not None  # later readers find it here
    assert store.find_text(NOTE, FINGERPRINT) is None  # it holds a known segment

def test_segment_keys_are_in_the_canonical_frame(llama, tokenizer, call):
    """A segment's keys are those of its first token at position 0: in layer 0 (where a token's KV
    depends on nothing before it) they equal the KV of its ids prefilled alone."""
    capture, store = capture_for(llama, tokenizer)
    reply = store.get(capture.capture_reply(call.n, call.generated, REPLY, "s1", call.kv_at).id)
    with torch.inference_mode():
        alone = hf.prefill(llama, torch.tensor(call.generated), torch.arange(len(call.generated)))
    keys, values = hf.layer_kv(alone.cache, 0)
    torch.testing.assert_close(reply.kv.layer(0)[0], keys, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(reply.kv.layer(0)[1], values, atol=1e-5, rtol=1e-5)
    # and moved back to where the call computed it, every layer is the call's KV
    at_home = reply.kv.shifted(capture.rotator, call.n)
    computed = call.kv_at(torch.arange(call.n, call.n + len(call.generated)))
    for layer in range(computed.num_layers):
        torch.testing.assert_close(at_home.layer(layer)[0], computed.layer(layer)[0], atol=1e-5, rtol=1e-5)


def test_kv_after_reused_text_is_kept_without_context(llama, tokenizer, call):
    """A call that reused the question re-rotated: its KV after the question holds estimates, so
    the prefix stops where the reuse starts, and the note and the reply are kept with no context
    ids (they may not serve as versions); the question, already stored, is not stored again."""
    capture, store = capture_for(llama, tokenizer)
    span = call.span(1)
    question = capture.cut(call.kv_at, span.start, call.layout.ids[span.start:span.stop].tolist(),
                           [None] * len(span), QUESTION, ("user", None))
    assert store.put(question)
    plan = CallPlan(call.layout.ids, runs=(ReusedRun(question, span.start, 0, len(span)),))
    ref = capture.keep_call(plan, "s1", call.generated, REPLY, call.kv_at, layout=call.layout, roles=ROLES)
    assert store.get(ref.id).context_ids == ()
    assert store.find_text(NOTE, FINGERPRINT).context_ids == ()
    assert store.find_text(QUESTION, FINGERPRINT) is question and store.stats().segments == 3
    assert store.longest_prefix(call.ids, FINGERPRINT)[1] == span.start


def test_what_the_settings_turn_off(llama, tokenizer, call):
    plan = CallPlan(call.layout.ids)
    # exact_prefix: the prefix only, no segment (nothing would ever read one)
    capture, store = capture_for(llama, tokenizer, method="exact_prefix")
    assert capture.keep_call(plan, "s1", call.generated, REPLY, call.kv_at, layout=call.layout, roles=ROLES) is None
    assert (store.stats().segments, store.stats().prefixes) == (0, 1)
    # no prefix cache, no message capture: the reply alone
    capture, store = capture_for(llama, tokenizer, prefix_cache=False, capture_messages=False)
    assert capture.keep_call(plan, "s1", call.generated, REPLY, call.kv_at, layout=call.layout, roles=ROLES)
    assert (store.stats().segments, store.stats().prefixes) == (1, 0)


def test_a_reply_is_stored_once_and_only_when_long_enough(llama, tokenizer, call):
    capture, store = capture_for(llama, tokenizer, min_match_tokens=4)
    first = capture.capture_reply(call.n, call.generated, REPLY, "s1", call.kv_at)
    assert capture.capture_reply(call.n, call.generated, REPLY, "s1", call.kv_at) == first  # same agent: once
    other = capture.capture_reply(call.n, call.generated, REPLY, "s2", call.kv_at)
    assert other.kind == ("s2", "assistant") and other.id != first.id  # another agent's reply: its own
    short = call.generated[:3]
    assert capture.capture_reply(call.n, short, tokenizer.decode(short), "s3", call.kv_at) is None
    four = call.generated[:4]
    assert capture.capture_reply(call.n, four, tokenizer.decode(four), "s3", call.kv_at).num_tokens == 4
    assert store.stats().segments == 3
