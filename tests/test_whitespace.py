"""Contexts compared as text where only the split of their whitespace into ids differs: a reply
that ends in a newline, read before a reader's own newlines, is tokenized with them merged."""

import dataclasses

from kvcomm_agents.anchors.pool import AnchorPool
from kvcomm_agents.anchors.versions import MIN_CONTEXT_MATCH, best_recorded_version
from kvcomm_agents.whitespace import WhitespaceIds

from .anchors.synthetic import KIND, offsets, segment


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_the_same_text_split_into_other_whitespace_ids_is_one_canonical_form(tokenizer):
    whitespace = WhitespaceIds.of(tokenizer)
    assert whitespace is WhitespaceIds.of(tokenizer)  # built once per tokenizer
    assert set(whitespace.texts.values()) >= {"\n", " "}
    merged = _ids(tokenizer, "the basket\n  ")  # the tokenizer merges the newline and spaces
    split = _ids(tokenizer, "the basket\n") + _ids(tokenizer, "  ")
    assert merged != split  # the premise: the same text, other ids
    assert tokenizer.decode(merged) == tokenizer.decode(split)
    assert whitespace.canonical(merged)[0] == whitespace.canonical(split)[0]
    # other whitespace, or other words, stay apart
    assert whitespace.canonical(_ids(tokenizer, "the basket\n\n  "))[0] != whitespace.canonical(merged)[0]
    assert whitespace.canonical(_ids(tokenizer, "the bucket\n  "))[0] != whitespace.canonical(merged)[0]
    # ids that are not whitespace are kept as they are
    words = _ids(tokenizer, "basket")
    assert whitespace.canonical(words) == (tuple(words), (1,) * len(words))
    assert sum(whitespace.canonical(split)[1]) == len(split)  # each value counts the ids it stands for
    newline = _ids(tokenizer, "\n")[0]
    assert whitespace.leading([newline, newline] + words) == 2
    assert whitespace.leading([newline, newline]) == 1  # never all of them
    assert whitespace.leading([newline] * 3 + words, keep=len(words) + 2) == 1


def test_a_version_whose_context_differs_only_in_whitespace_ids_fits_with_the_canonical_form(tokenizer):
    """The version's context (the sender's copy: the reply's newline, then the reader's
    separator) and the reader's prompt (both merged) hold the same text; compared as ids they
    share one id, compared canonically the whole window."""
    whitespace = WhitespaceIds.of(tokenizer)
    text = "Solution from solver one: three apples and four pears make seven"
    copy_context = tuple(_ids(tokenizer, text + "\n") + _ids(tokenizer, "  "))
    reader_context = tuple(_ids(tokenizer, text + "\n  "))
    assert copy_context != reader_context and len(reader_context) >= MIN_CONTEXT_MATCH + 2
    seg = dataclasses.replace(segment(1, tokens=6), context_ids=(7, 7, 7))
    pool = AnchorPool(KIND, max_anchors=4, eviction_window=2)
    slot = pool.add(seg)
    k, v = offsets(1)
    pool.record(slot, "copy", 0, k, v, copy_context)
    assert best_recorded_version(pool, "reader", seg, 0, 6, reader_context) is None
    best = best_recorded_version(pool, "reader", seg, 0, 6, reader_context, whitespace.canonical)
    assert best is not None and best.receiver == "copy" and best.matched >= MIN_CONTEXT_MATCH


def test_a_match_is_counted_in_the_prompts_ids_not_in_canonical_values(tokenizer):
    """A context full of whitespace ids (here pairs of newlines, each pair one canonical value)
    that repeats the version's ids exactly matches for every id: the thresholds (16 ids, a framed
    copy's 16 + its lead-in) are counted in ids, so canonical comparison never loses a match that
    comparing ids finds."""
    whitespace = WhitespaceIds.of(tokenizer)
    newline = _ids(tokenizer, "\n")[0]
    word = _ids(tokenizer, "basket")
    context = tuple((word + [newline, newline]) * 16)[-64:]
    seg = dataclasses.replace(segment(1, tokens=6), context_ids=(7, 7, 7))
    pool = AnchorPool(KIND, max_anchors=4, eviction_window=2)
    slot = pool.add(seg)
    k, v = offsets(1)
    pool.record(slot, "copy", 0, k, v, context, min_match=56)
    by_ids = best_recorded_version(pool, "reader", seg, 0, 6, context)
    by_text = best_recorded_version(pool, "reader", seg, 0, 6, context, whitespace.canonical)
    assert by_ids is not None and by_text is not None and by_text.matched == by_ids.matched == len(context)
