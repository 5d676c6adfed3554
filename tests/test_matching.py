"""Finding shared text in a prompt (no model): hand-built layouts, a store of segments whose KV
is irrelevant here, the tiny byte-level tokenizer (edges tokenize differently in context)."""

import torch

from kvcomm_agents.kv.block import KVBlock
from kvcomm_agents.kv.segments import KVSegment
from kvcomm_agents.kv.store import SegmentStore
from kvcomm_agents.matching import find_occurrences, match_runs
from kvcomm_agents.prompt import PromptLayout
from kvcomm_agents.testing import tiny_tokenizer

TOKENIZER = tiny_tokenizer()
REPLY = "the answer is 72 because 48 plus 24 equals 72."


def make_segment(text: str, fingerprint: str = "m", kind=("s1", "assistant")) -> KVSegment:
    """A segment of ``text`` tokenized alone, as a producer's reply is (KV: zeros)."""
    encoded = TOKENIZER(text, add_special_tokens=False, return_offsets_mapping=True)
    n = len(encoded["input_ids"])
    return KVSegment.create(kind=kind, text=text, token_ids=encoded["input_ids"],
                            char_spans=[tuple(s) for s in encoded["offset_mapping"]],
                            kv=KVBlock.stacked(torch.zeros(2, 1, n, 4), torch.zeros(2, 1, n, 4)), fingerprint=fingerprint)


def layout(*contents: str, refs=()) -> PromptLayout:
    """Messages rendered as ``<role>\\n{content}\\n`` by hand, tokenized as a whole."""
    text, spans = "", []
    for content in contents:
        text += "<m>\n"
        spans.append((len(text), len(text) + len(content)) if content else None)
        text += content + "\n"
    encoded = TOKENIZER(text, add_special_tokens=False, return_offsets_mapping=True)
    return PromptLayout(text, torch.tensor(encoded["input_ids"]), [tuple(s) for s in encoded["offset_mapping"]],
                        spans, list(refs) + [None] * (len(contents) - len(refs)))


def pieces(lay: PromptLayout, start: int, length: int) -> list[str]:
    return [lay.text[slice(*lay.offsets[j])] for j in range(start, start + length)]


def test_a_segment_alone_in_its_message_matches_every_token():
    seg = make_segment(REPLY)
    lay = layout("You are solver two.", REPLY)
    start = lay.content_spans[1][0]
    runs = match_runs(lay, seg, start, len(REPLY))
    assert len(runs) == 1
    p, s, length = runs[0]
    assert (s, length) == (0, seg.num_tokens)
    assert lay.ids[p : p + length].tolist() == list(seg.token_ids)
    assert "".join(pieces(lay, p, length)) == REPLY


def test_edge_tokens_that_merge_with_the_context_do_not_match():
    seg = make_segment(REPLY)
    alone = [REPLY[a:b] for a, b in seg.char_spans]
    assert alone[:3] == ["th", "e", " answer"]  # alone, "the" is two tokens; after a space, " the" is one
    lay = layout("Agent 1 said: " + REPLY)
    start = lay.content_spans[0][0] + len("Agent 1 said: ")
    runs = match_runs(lay, seg, start, len(REPLY))
    assert len(runs) == 1
    p, s, length = runs[0]
    assert (s, length) == (2, seg.num_tokens - 2)
    assert pieces(lay, p - 1, 1) == [" the"] and pieces(lay, p, 1) == [" answer"]
    assert lay.ids[p : p + length].tolist() == list(seg.token_ids[2:])
    # only the characters [0, limit) may match (an edited message)
    limit = REPLY.index(" plus")
    edited = match_runs(lay, seg, start, limit)
    assert edited == [(p, 2, seg.token_ids.index(TOKENIZER(" pl", add_special_tokens=False)["input_ids"][0]) - 2)]
    assert "".join(pieces(lay, p, edited[0][2])) == REPLY[len("the") : limit]


def test_content_search_finds_every_stored_text_of_this_model():
    store = SegmentStore(1 << 20)
    reply, question = make_segment(REPLY), make_segment("How many clips did Natalia sell?", kind=("user", None))
    foreign = make_segment("You are solver two.", fingerprint="other")
    for seg in (reply, question, foreign):
        store.put(seg)
    lay = layout("You are solver two.", "How many clips did Natalia sell?", "Agent 1 said: " + REPLY)
    found = find_occurrences(lay, store, "m")
    assert [(o.message_index, o.segment_id, o.found_by, o.failure) for o in found] == [
        (1, question.id, "content", None), (2, reply.id, "content", None)]
    occ = found[1]
    assert lay.text[occ.start : occ.start + occ.limit] == REPLY and occ.ref == reply.ref
    span = occ.token_span(lay)
    assert "".join(pieces(lay, span[0], span[1] - span[0])) == REPLY[len("the") :]  # " the" straddles the start


def test_references_are_resolved_or_say_why_not():
    store = SegmentStore(1 << 20)
    reply, gone = make_segment(REPLY), make_segment("an answer that was evicted later on")
    store.put(gone)
    store.resize(0)  # evicts it
    store.resize(1 << 20)
    store.put(reply)
    foreign = make_segment(REPLY, fingerprint="other")
    unknown = make_segment("never stored anywhere at all")
    edited = REPLY.replace("equals 72.", "makes 73!")
    refs = [reply.ref, reply.ref.model_dump(), gone.ref, unknown.ref, foreign.ref, {"id": "x"}, reply.ref, reply.ref]
    contents = [REPLY, "Agent 1 said: " + REPLY, REPLY, REPLY, REPLY, REPLY, edited, ""]
    lay = layout(*contents, refs=refs)
    found = find_occurrences(lay, store, "m")
    assert [(o.message_index, o.found_by, o.failure, o.edited) for o in found] == [
        (0, "reference", None, False), (1, "reference", None, False), (2, "reference", "evicted", False),
        (3, "reference", "not_found", False), (4, "reference", "foreign_model", False),
        (5, "reference", "bad_reference", False), (6, "reference", None, True), (7, "reference", "not_in_prompt", False)]
    assert found[1].start == lay.content_spans[1][0] + len("Agent 1 said: ")
    assert found[5].segment is None and found[5].ref is None
    assert found[6].limit == edited.index("makes") and found[6].start == lay.content_spans[6][0]
    assert found[7].token_span(lay) == (0, 0)  # no content: no tokens
