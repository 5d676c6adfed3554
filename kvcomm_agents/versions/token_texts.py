"""Contexts compared as text: the same text split into other ids still matches.

The same text is not always the same ids. A model often generates a non-canonical split
(``'group', 'by'`` where the tokenizer, reading the reply pasted into a reader's prompt, makes
``'groupby'``), and whitespace merges across a paste (a reply ending in a newline, read before
a reader's ``"\\n\\nCheck the solutions above"``, becomes ``'\\n\\n\\n', '\\n'`` where the sender's
copy holds ``'\\n', '\\n\\n'``). Comparing the ids before a stored version (:mod:`.versions.match`)
then stops at the split, and text whose every other id repeats is computed (traced: the
one-message workload (e), two of its three computed calls; the RAG workload (c), both readers of
one reply whose ``groupby`` the reader had generated in two ids).

:class:`TokenTexts` holds the text of every id of one tokenizer (read once, decoding each id
after a fixed word: SentencePiece drops a first piece's leading space) and compares id sequences
by their text: :meth:`TokenTexts.matched` is the number of a context's last ids whose text lies
inside the common text suffix of two contexts, so a match is still counted in the prompt's ids
(the thresholds, :data:`~.versions.match.MIN_CONTEXT_MATCH`, are in ids). An id without a clean
text of its own (a special token, a byte of a multi-byte character) stands for itself: an
escape (its decimal id between two U+FFFF noncharacters) that no clean text holds, so it only
ever matches the same id.
"""

from __future__ import annotations

import bisect
import weakref
from functools import lru_cache
from typing import Optional, Sequence

import torch

__all__ = ["TokenTexts"]

#: What :meth:`TokenTexts.of` built, per tokenizer object.
_BUILT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

#: Id sequences whose text is kept (:meth:`TokenTexts.text`): the contexts compared in one
#: call's planning are few and repeat across calls.
TEXT_CACHE = 4096

_ESCAPE = "\uffff"  # a noncharacter: never in a clean text (:func:`_clean`)


def _escaped(token_id: int) -> str:
    """The text standing for an id that has none of its own: unique per id, and no clean text
    holds it, so a common suffix takes it whole or not at all."""
    return f"{_ESCAPE}{token_id}{_ESCAPE}"


def _clean(text: str) -> bool:
    return bool(text) and "\ufffd" not in text and _ESCAPE not in text


class TokenTexts:
    """The text of every id of one tokenizer.

    Args:
        texts: ``texts[i]``: the text of id ``i`` (its escape where it has no clean text).
        whitespace: the ids whose text is whitespace only (spaces, tabs, newlines).
    """

    def __init__(self, texts: Sequence[str], whitespace: frozenset[int]) -> None:
        self.texts = list(texts)
        self.whitespace = frozenset(whitespace)
        self.text = lru_cache(maxsize=TEXT_CACHE)(self._text)
        self._matched = lru_cache(maxsize=TEXT_CACHE)(self._matched_texts)

    @classmethod
    def of(cls, tokenizer) -> Optional["TokenTexts"]:
        """:meth:`from_tokenizer`, built once per tokenizer object (engines of one tokenizer share
        it: it decodes the whole vocabulary)."""
        try:
            return _BUILT[tokenizer]
        except (KeyError, TypeError):
            pass
        built = cls.from_tokenizer(tokenizer)
        try:
            _BUILT[tokenizer] = built
        except TypeError:  # not weak-referenceable: built again next time
            pass
        return built

    @classmethod
    def from_tokenizer(cls, tokenizer) -> Optional["TokenTexts"]:
        """The texts of ``tokenizer``'s ids (special tokens stand for themselves), or None when it
        cannot decode ids (contexts are then compared as ids)."""
        try:
            vocab = len(tokenizer)
            special = set(getattr(tokenizer, "all_special_ids", ()) or ())
            special |= {i for i, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()
                        if getattr(token, "special", False)}  # e.g. <file_sep>: not in all_special_ids
            lead = tokenizer("a", add_special_tokens=False)["input_ids"]
            options = dict(skip_special_tokens=False, clean_up_tokenization_spaces=False)
            before = tokenizer.decode(lead, **options)
            pieces = _decoded([lead + [i] for i in range(vocab)], tokenizer, options)
        except Exception:  # a tokenizer without these
            return None
        texts, whitespace = [], set()
        for i, piece in enumerate(pieces):
            text = piece[len(before):] if piece.startswith(before) else ""
            if i in special or not _clean(text):
                text = _escaped(i)
            elif not text.strip():
                whitespace.add(i)
            texts.append(text)
        return cls(texts, frozenset(whitespace))

    def _text(self, ids: tuple[int, ...]) -> tuple[str, tuple[int, ...]]:
        """The text of ``ids`` and the offset in it where each id's text starts."""
        starts, parts, at = [], [], 0
        for i in ids:
            text = self.texts[i] if 0 <= i < len(self.texts) else _escaped(i)
            starts.append(at)
            parts.append(text)
            at += len(text)
        return "".join(parts), tuple(starts)

    def matched(self, context: Sequence[int], other: Sequence[int]) -> int:
        """How many of ``context``'s last ids have their whole text inside the longest common
        text suffix of ``context`` and ``other`` (the same as the common id suffix's length where
        both split their text alike). Remembered per pair: a plan compares the same contexts
        against every receiver's recorded version."""
        return self._matched(_key(context), _key(other))

    def _matched_texts(self, context: tuple[int, ...], other: tuple[int, ...]) -> int:
        text, starts = self.text(context)
        theirs = self.text(other)[0]
        lo, hi = 0, min(len(text), len(theirs))  # the common suffix's length, by bisection
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if text.endswith(theirs[len(theirs) - mid:]):
                lo = mid
            else:
                hi = mid - 1
        return len(starts) - bisect.bisect_left(starts, len(text) - lo)

    def same_text(self, a: Sequence[int], b: Sequence[int]) -> bool:
        """Whether two id sequences hold the same text."""
        return self.text(_key(a))[0] == self.text(_key(b))[0]

    def leading(self, ids: Sequence[int], keep: int = 1) -> int:
        """How many of ``ids``' first ids are whitespace, leaving at least ``keep`` ids after them."""
        n = 0
        while n < len(ids) - keep and int(ids[n]) in self.whitespace:
            n += 1
        return n


def _key(ids: Sequence[int]) -> tuple[int, ...]:
    """``ids`` as a tuple (the texts' cache key): a tuple of ints as it is (the planner's contexts),
    a tensor through ``tolist``, anything else through ``int``. Planning
    compares hundreds of contexts per call."""
    if type(ids) is tuple and (not ids or type(ids[0]) is int):
        return ids
    return tuple(ids.tolist()) if isinstance(ids, torch.Tensor) else tuple(map(int, ids))


#: Sequences :func:`_decoded` checks the fast path on against the tokenizer's own decoding.
CHECKED_SEQUENCES = 256


def _decoded(sequences: list[list[int]], tokenizer, options: dict) -> list[str]:
    """``tokenizer.batch_decode(sequences, **options)``, through the Rust backend where the
    tokenizer has one and decodes a spread sample of ``sequences`` as its Python wrapper does
    (a tokenizer class may decode its own way): 0.03 s instead of 0.4 s for a 49k vocabulary."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not options.get("clean_up_tokenization_spaces", True):
        try:
            pieces = backend.decode_batch(sequences, skip_special_tokens=options.get("skip_special_tokens", False))
            step = max(1, len(sequences) // CHECKED_SEQUENCES)
            sample = list(range(0, len(sequences), step))
            if tokenizer.batch_decode([sequences[i] for i in sample], **options) == [pieces[i] for i in sample]:
                return pieces
        except Exception:  # a backend that cannot: the wrapper's own decoding below
            pass
    return tokenizer.batch_decode(sequences, **options)
