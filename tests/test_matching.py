"""Finding shared text in a prompt (no model): hand-built layouts, a store of segments whose KV
is irrelevant here, the tiny byte-level tokenizer (edges tokenize differently in context)."""

import torch

from kvcomm_agents.kv.block import KVBlock
from kvcomm_agents.kv.segments import CONTEXT_TOKENS, KVSegment
from kvcomm_agents.kv.store import SegmentStore
from kvcomm_agents.matching import find_occurrences, find_shared, find_spans, find_token_matches, match_runs
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


# ---- runs of an earlier prompt holding found texts (shared_runs="spans") ----------------------
LONG_QUESTION = ("Natalia sold 48 clips to her friends in April, and then she sold half as many clips in May. "
                 "Her brother sold a third as many clips as she did in both months together, and her cousin "
                 "sold twice as many as her brother in June. How many clips did the three of them sell in all?")


def _spans_setting(question: str, reply_first: bool = False, earlier_system: str = "You are solver two.",
                   question_alone: bool = False, reply: str = REPLY, after: str = ""):
    """A store holding a reply, the first agent's message (the question after a heading; with
    ``question_alone``, the question alone: a text found whole) and an earlier reader's whole
    prompt (the question, then the reply pasted after a lead-in; with ``reply_first``, the reply
    first; ``after``, a text found whole after it) and the next reader's prompt pasting them alike
    after another system text."""
    store = SegmentStore(1 << 20)
    text, reply = reply, make_segment(reply)
    store.put(reply)
    if after:
        store.put(make_segment(after, kind=("tool", "tool")))
    store.put(make_segment(question if question_alone else f"Problem: {question}", kind=("user", None)))
    pasted = f"Solver 1 said: {text}\n\n{question}" if reply_first else f"{question}\n\nSolver 1 said: {text}"
    pasted += f"\n\n{after}" if after else ""
    earlier = layout(earlier_system, f"{pasted}\n\nNow check it.")
    n = earlier.ids.numel()
    store.put_prefix(earlier.ids, KVBlock.stacked(torch.zeros(2, 1, n, 4), torch.zeros(2, 1, n, 4)), "m")
    lay = layout("You are the judge of this debate.", f"{pasted}\n\nSolver 2 said: I agree.")
    return store, reply, lay


def test_a_run_of_an_earlier_prompt_holding_a_text_with_its_context_replaces_it():
    store, reply, lay = _spans_setting(LONG_QUESTION)
    found = find_occurrences(lay, store, "m")
    assert [o.segment_id for o in found] == [reply.id]  # the question is found by its ids only
    reply_span = found[0].token_span(lay)
    kept, spans = find_spans(lay, store, "m", found, 0, 64)
    assert kept == [] and len(spans) == 1
    span = spans[0]
    assert span.segment.ref.kind == SegmentStore.PREFIX_KIND and span.found_by == "span"
    start, end = span.token_span(lay)
    assert start <= reply_span[0] - CONTEXT_TOKENS and end >= reply_span[1]  # the reply, after the same 64 ids and more
    assert lay.ids[start:end].tolist() == list(span.segment.token_ids[span.segment_start:span.segment_start + span.length])
    assert find_shared(lay, store, "m", 0, "spans", 64) == [span]
    # texts matched alone: the reply its own segment, the question a run of ids
    alone = find_shared(lay, store, "m", 0, "anywhere", 64)
    assert [o.segment_id for o in alone if o.found_by == "content"] == [reply.id] and len(alone) > 1
    assert [o.segment_id for o in find_shared(lay, store, "m", 0, "messages", 64)] == [reply.id]
    # found wherever the earlier prompt's indexed windows fall (its system text of any length)
    for system in ("You are solver 2.", "You are solver number two.", "Be brief.", "You check sums, carefully."):
        store, reply, lay = _spans_setting(LONG_QUESTION, earlier_system=system)
        kept, spans = find_spans(lay, store, "m", find_occurrences(lay, store, "m"), 0, 64)
        assert kept == [] and len(spans) == 1, system


def test_a_text_with_too_little_of_the_same_context_before_it_is_matched_alone():
    for question, reply_first in (("How many clips did Natalia sell?", False), (LONG_QUESTION, True)):
        store, reply, lay = _spans_setting(question, reply_first)  # a few ids of the run before the reply
        found = find_occurrences(lay, store, "m")
        assert [o.segment_id for o in found] == [reply.id]
        assert find_spans(lay, store, "m", found, 0, 64) == (found, []), question
    # a longer text found whole keeps its own segment (and its versions): the run starts after it
    store, reply, lay = _spans_setting(LONG_QUESTION, question_alone=True)
    found = find_occurrences(lay, store, "m")
    assert len(found) == 2 and find_spans(lay, store, "m", found, 0, 64) == (found, [])
    # a longer text is never held: its own segment (and its versions) serve it
    store, reply, lay = _spans_setting(LONG_QUESTION, reply=LONG_QUESTION.upper())
    found = find_occurrences(lay, store, "m")
    assert [o.segment_id for o in found] == [reply.id] and find_spans(lay, store, "m", found, 0, 64) == (found, [])
    store, reply, lay = _spans_setting(LONG_QUESTION, after=LONG_QUESTION.upper())  # the run ends where it starts
    found = find_occurrences(lay, store, "m")
    kept, (span,) = find_spans(lay, store, "m", found, 0, 64)
    assert [o.segment_id for o in kept] == [found[1].segment_id] and span.token_span(lay)[1] <= found[1].token_span(lay)[0]
    # a message whose reference cannot be served keeps its failure
    store, reply, lay = _spans_setting(LONG_QUESTION)
    gone = layout(*[lay.content(i) for i in range(2)], refs=[None, make_segment("never stored").ref])
    found = find_occurrences(gone, store, "m")
    assert [o.failure for o in found] == ["not_found"] and find_spans(gone, store, "m", found, 0, 64) == (found, [])
    # a run no longer than the short-run rule would be computed whole: it replaces nothing
    store, reply, lay = _spans_setting(LONG_QUESTION)
    found = find_occurrences(lay, store, "m")
    assert find_spans(lay, store, "m", found, 0, 10_000) == (found, [])


NOTES = ("Check each step of the working above before you answer: the sums, the halves and the "
         "thirds, and say which step is wrong if any of them is.")


def _earlier_and_next(pasted: str, *texts: str, kinds=None):
    """A store holding each of ``texts`` as a segment and an earlier reader's prompt pasting
    ``pasted``; the next reader's prompt pasting it alike after another system text."""
    store = SegmentStore(1 << 20)
    segments = [make_segment(text, kind=kind) for text, kind in zip(texts, kinds or [("s1", "assistant")] * len(texts))]
    for segment in segments:
        store.put(segment)
    earlier = layout("You are solver two.", f"{pasted}\n\nNow check it.")
    n = earlier.ids.numel()
    store.put_prefix(earlier.ids, KVBlock.stacked(torch.zeros(2, 1, n, 4), torch.zeros(2, 1, n, 4)), "m")
    return store, segments, layout("You are the judge of this debate.", f"{pasted}\n\nSolver 2 said: I agree.")


def _stored_ids_match(lay, span) -> bool:
    return lay.ids[span.prompt_start:span.prompt_start + span.length].tolist() == \
        list(span.segment.token_ids[span.segment_start:span.segment_start + span.length])


def test_a_text_the_run_cannot_hold_splits_it_and_the_ids_before_it_still_count_as_context():
    other = "Solver 3 thinks it is 70, since 48 and 22 make 70."
    question = ("user", None)
    # the reply after 64+ ids of notes, the longer question (its own segment), another short reply:
    # the second reply's context is the run from its start, through the question
    store, (reply, long_text, reply3), lay = _earlier_and_next(
        f"{NOTES}\n\nSolver 1 said: {REPLY}\n\n{LONG_QUESTION}\n\nSolver 3 said: {other}\n\n{NOTES}",
        REPLY, LONG_QUESTION, other, kinds=[("s1", "assistant"), question, ("s3", "assistant")])
    found = find_occurrences(lay, store, "m")
    assert [o.segment_id for o in found] == [reply.id, long_text.id, reply3.id]
    kept, spans = find_spans(lay, store, "m", found, 0, 64)
    assert [o.segment_id for o in kept] == [long_text.id] and len(spans) == 2
    question_start, question_end = found[1].token_span(lay)
    (first, _), (second, second_end) = (span.token_span(lay) for span in spans)
    assert spans[0].token_span(lay)[1] == question_start and second == question_end  # split around the question
    assert first <= found[0].token_span(lay)[0] - CONTEXT_TOKENS and second_end >= found[2].token_span(lay)[1]
    assert second - CONTEXT_TOKENS < found[2].token_span(lay)[0]  # held on the ids before the question too
    assert all(_stored_ids_match(lay, span) and span.segment is spans[0].segment for span in spans)
    # an exact prefix reaching into the notes: the run starts after it, the reply held where 64
    # ids of it are left before the reply, and left alone where fewer are
    store, (reply,), lay = _earlier_and_next(f"{NOTES}\n\nSolver 1 said: {REPLY}\n\n{NOTES}", REPLY)
    found = find_occurrences(lay, store, "m")
    reply_start = found[0].token_span(lay)[0]
    prefix = lay.tokens_within(*lay.content_spans[1]).start + 8
    assert reply_start - prefix >= CONTEXT_TOKENS
    kept, (span,) = find_spans(lay, store, "m", found, prefix, 64)
    assert kept == [] and span.token_span(lay)[0] == prefix and _stored_ids_match(lay, span)
    assert find_spans(lay, store, "m", found, reply_start - CONTEXT_TOKENS + 1, 64) == (found, [])


def test_only_an_earlier_prompt_holds_texts_not_a_stored_message_pasting_them():
    store = SegmentStore(1 << 20)
    reply = make_segment(REPLY)
    store.put(reply)
    store.put(make_segment(f"Problem: {NOTES}\n\nSolver 1 said: {REPLY}\n\nThat is all.", kind=("user", None)))
    lay = layout("You are the judge of this debate.", f"{NOTES}\n\nSolver 1 said: {REPLY}\n\nSolver 2 said: I agree.")
    found = find_occurrences(lay, store, "m")
    assert [o.segment_id for o in found] == [reply.id]
    assert find_spans(lay, store, "m", found, 0, 64) == (found, [])  # its KV may follow re-rotated text


def test_an_edited_reference_holding_no_whole_token_leaves_its_message_to_token_runs():
    store = SegmentStore(1 << 20)
    reply = make_segment(REPLY)
    store.put(reply)
    lay = layout("Agent 1 said: " + REPLY[:-1] + "!", refs=[reply.ref])
    (occ,) = find_occurrences(lay, store, "m")
    assert occ.edited and occ.limit == 0 and occ.failure is None
    start, end = occ.token_span(lay)
    assert start == end  # no tokens of its own: the message's tokens stay free
    (run,) = find_token_matches(lay, store, "m", [occ], 0)
    assert run.segment is reply and run.length >= 8
    assert find_spans(lay, store, "m", [occ], 0, 64) == ([occ], [])
