"""Contexts compared as text where only the split of their text into ids differs: a reply that
ends in a newline, read before a reader's own newlines, is tokenized with them merged; a word the
model generated in two ids is read back as one."""

import dataclasses

import pytest

from kvcomm_agents.anchors.pool import AnchorPool
from kvcomm_agents.versions.match import MIN_CONTEXT_MATCH, best_recorded_version, common_suffix
from kvcomm_agents.versions import token_texts
from kvcomm_agents.versions.token_texts import TokenTexts

from .anchors.synthetic import KIND, offsets, segment


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_the_same_text_split_into_other_ids_matches_as_text(tokenizer):
    texts = TokenTexts.of(tokenizer)
    assert texts is TokenTexts.of(tokenizer)  # built once per tokenizer
    merged = _ids(tokenizer, "the basket\n  ")  # the tokenizer merges the newline and spaces
    split = _ids(tokenizer, "the basket\n") + _ids(tokenizer, "  ")
    assert merged != split  # the premise: the same text, other ids
    assert texts.same_text(merged, split)
    assert texts.matched(merged, split) == len(merged)  # counted in the first sequence's ids
    assert texts.matched(split, merged) == len(split)
    assert common_suffix(merged, split) < len(merged)
    # a word split in two ids (as a model may generate it) against the tokenizer's one id
    text = " three apples"
    cut = next(i for i in range(2, len(text) - 1)
               if _ids(tokenizer, text[:i]) + _ids(tokenizer, text[i:]) != _ids(tokenizer, text))
    word, pieces = _ids(tokenizer, text), _ids(tokenizer, text[:cut]) + _ids(tokenizer, text[cut:])
    assert word != pieces and texts.same_text(word, pieces)
    before = _ids(tokenizer, "The input of itertools.")
    assert texts.matched(before + word, before + pieces) == len(before + word)
    # other whitespace, or other words, stay apart: the match stops there
    assert not texts.same_text(_ids(tokenizer, "the basket\n\n  "), merged)
    bucket = _ids(tokenizer, "the bucket\n  ")
    assert texts.matched(bucket, merged) == common_suffix(bucket, merged)
    # a partly shared last id is not counted: only ids whose whole text is shared
    made = TokenTexts(["ab", "b", "x", "a"], frozenset())
    assert made.matched([0], [2, 1]) == 0  # "ab" against "xb": one character shared, no whole id
    assert made.matched([2, 0], [3, 1]) == 1 and made.matched([3, 1], [2, 0]) == 2
    newline = _ids(tokenizer, "\n")[0]
    words = _ids(tokenizer, "basket")
    assert texts.leading([newline, newline] + words) == 2
    assert texts.leading([newline, newline]) == 1  # never all of them
    assert texts.leading([newline] * 3 + words, keep=len(words) + 2) == 1


def test_matches_are_the_same_whatever_sequence_holds_the_ids(tokenizer):
    """Lists, tuples and tensors of the same ids give the same match (the remembered pairs are
    keyed on the ids, not on the container)."""
    import torch

    texts = TokenTexts.of(tokenizer)
    a, b = _ids(tokenizer, "Solver 1 answered: 12 apples"), _ids(tokenizer, "Solver 2 answered: 12 apples")
    expected = texts.matched(a, b)
    assert 0 < expected < len(a)
    for x, y in [(tuple(a), tuple(b)), (torch.tensor(a), b), (a, torch.tensor(b)), (torch.tensor(a), torch.tensor(b))]:
        assert texts.matched(x, y) == expected
    assert texts.same_text(torch.tensor(a), tuple(a))


def test_special_tokens_only_match_themselves(tokenizer):
    texts = TokenTexts.of(tokenizer)
    special = sorted(tokenizer.all_special_ids)
    assert len(special) >= 2
    a, b = special[:2]
    assert not texts.same_text([a], [b])
    assert texts.matched([a], [a]) == 1 and texts.matched([a], [b]) == 0
    # not even the characters of its name
    assert all(tokenizer.decode([s]) not in texts.text((s,))[0] for s in special)


def test_a_version_whose_context_differs_only_in_whitespace_ids_fits_with_the_canonical_form(tokenizer):
    """The version's context (the sender's copy: the reply's newline, then the reader's
    separator) and the reader's prompt (both merged) hold the same text; compared as ids they
    share one id, compared as text the whole window."""
    texts = TokenTexts.of(tokenizer)
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
    best = best_recorded_version(pool, "reader", seg, 0, 6, reader_context, texts.matched)
    assert best is not None and best.receiver == "copy" and best.matched >= MIN_CONTEXT_MATCH


def test_a_match_is_counted_in_the_prompts_ids_not_in_canonical_values(tokenizer):
    """A context full of whitespace ids (here pairs of newlines)
    that repeats the version's ids exactly matches for every id: the thresholds (16 ids, a framed
    copy's 16 + its lead-in) are counted in ids, so comparing text never loses a match that
    comparing ids finds."""
    texts = TokenTexts.of(tokenizer)
    newline = _ids(tokenizer, "\n")[0]
    word = _ids(tokenizer, "basket")
    context = tuple((word + [newline, newline]) * 16)[-64:]
    seg = dataclasses.replace(segment(1, tokens=6), context_ids=(7, 7, 7))
    pool = AnchorPool(KIND, max_anchors=4, eviction_window=2)
    slot = pool.add(seg)
    k, v = offsets(1)
    pool.record(slot, "copy", 0, k, v, context, min_match=56)
    by_ids = best_recorded_version(pool, "reader", seg, 0, 6, context)
    by_text = best_recorded_version(pool, "reader", seg, 0, 6, context, texts.matched)
    assert by_ids is not None and by_text is not None and by_text.matched == by_ids.matched == len(context)


@pytest.mark.embedded
def test_added_special_tokens_outside_all_special_ids_stand_for_themselves():
    """The embedded tokenizer marks ``<file_sep>`` (id 5) special without listing it in
    ``all_special_ids``: its text must not match the same characters generated as plain ids."""
    from transformers import AutoTokenizer

    from kvcomm_agents.embedded import embedded_model_dir

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
    texts = TokenTexts.from_tokenizer(tokenizer)
    special = tokenizer.convert_tokens_to_ids("<file_sep>")
    assert special not in tokenizer.all_special_ids  # the premise
    plain = tokenizer("<file_sep>", add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert special not in plain and not texts.same_text([special], plain)
    assert texts.matched([special], [special]) == 1


def test_the_backends_fast_decoding_gives_the_tokenizers_own_texts(tokenizer, monkeypatch):
    fast = TokenTexts.from_tokenizer(tokenizer)
    monkeypatch.setattr(token_texts, "_decoded", lambda sequences, tok, options: tok.batch_decode(sequences, **options))
    slow = TokenTexts.from_tokenizer(tokenizer)
    assert fast.texts == slow.texts and fast.whitespace == slow.whitespace


def test_a_tokenizer_that_decodes_its_own_way_is_decoded_its_way(tokenizer):
    class Odd:  # a wrapper whose decoding differs from its backend's
        backend_tokenizer = tokenizer.backend_tokenizer

        def batch_decode(self, sequences, **options):
            return [text.upper() for text in tokenizer.batch_decode(sequences, **options)]

    options = dict(skip_special_tokens=False, clean_up_tokenization_spaces=False)
    sequences = [[i] for i in range(len(tokenizer))]
    assert token_texts._decoded(sequences, Odd(), options) == Odd().batch_decode(sequences, **options)
    assert token_texts._decoded(sequences, tokenizer, options) == tokenizer.batch_decode(sequences, **options)

