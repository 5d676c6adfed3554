"""Contexts that differ only in how their whitespace was tokenized.

The same text is not always the same ids: a reply that ends in a newline, pasted before a
reader's ``"\\n\\nCheck the solutions above"``, is read as ``'\\n\\n\\n', '\\n'`` where the sender's
copy of that text holds ``'\\n', '\\n\\n'``. Comparing the ids before a stored version
(:mod:`.anchors.versions`) then finds no match, and text whose every other id repeats is computed
(traced on the one-message workload (e): two of its three computed calls, docs/benchmarks.md).

:class:`WhitespaceIds` maps id sequences to a canonical form in which every maximal run of
whitespace-only ids stands as one value, the hash of its text, so that two contexts compare
equal where their text is equal and only the whitespace's split into ids differs. Nothing else
is merged: a non-whitespace id stays itself, so a match still means the same ids but for the
whitespace between them. Pure bookkeeping over ids; the tokenizer is read once, at build time.
"""

from __future__ import annotations

import threading
import weakref
from typing import Optional, Sequence

__all__ = ["WhitespaceIds"]

#: What :meth:`WhitespaceIds.of` built, per tokenizer object.
_BUILT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class WhitespaceIds:
    """The whitespace-only ids of one tokenizer and their text.

    Args:
        texts: ``{id: text}`` for every id whose text is whitespace only (spaces, tabs,
            newlines), built by :meth:`from_tokenizer`.
    """

    def __init__(self, texts: dict[int, str]) -> None:
        self.texts = dict(texts)
        self._values: dict[str, int] = {}  # whitespace text -> the value standing for it
        self._lock = threading.Lock()

    @classmethod
    def of(cls, tokenizer) -> Optional["WhitespaceIds"]:
        """:meth:`from_tokenizer`, built once per tokenizer object (decoding a vocabulary takes
        0.4 s for the embedded model's 49k ids)."""
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
    def from_tokenizer(cls, tokenizer) -> Optional["WhitespaceIds"]:
        """The whitespace ids of ``tokenizer`` (special tokens excluded), or None when it has none
        or cannot decode ids. Each id is decoded after a fixed word and that word's text cut off:
        SentencePiece tokenizers drop a leading space of a text's first piece (``'▁▁'`` alone
        decodes to one space)."""
        try:
            vocab = len(tokenizer)
            special = set(getattr(tokenizer, "all_special_ids", ()) or ())
            lead = tokenizer("a", add_special_tokens=False)["input_ids"]
            options = dict(skip_special_tokens=False, clean_up_tokenization_spaces=False)
            before = tokenizer.decode(lead, **options)
            pieces = tokenizer.batch_decode([lead + [i] for i in range(vocab)], **options)
        except Exception:  # a tokenizer without these: contexts are compared as ids
            return None
        texts = {i: text[len(before):] for i, text in enumerate(pieces) if text.startswith(before)}
        texts = {i: text for i, text in texts.items()
                 if text and not text.strip() and i not in special and "\ufffd" not in text}
        return cls(texts) if texts else None

    def canonical(self, ids: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``ids`` with each maximal run of whitespace ids replaced by one value standing for its
        text (a negative number, never an id), and how many ids each value stands for."""
        out: list[int] = []
        counts: list[int] = []
        run: list[str] = []
        for i in ids:
            text = self.texts.get(int(i))
            if text is not None:
                run.append(text)
                continue
            if run:
                out.append(self._value("".join(run)))
                counts.append(len(run))
                run = []
            out.append(int(i))
            counts.append(1)
        if run:
            out.append(self._value("".join(run)))
            counts.append(len(run))
        return tuple(out), tuple(counts)

    def leading(self, ids: Sequence[int], keep: int = 1) -> int:
        """How many of ``ids``' first ids are whitespace, leaving at least ``keep`` ids after them."""
        n = 0
        while n < len(ids) - keep and int(ids[n]) in self.texts:
            n += 1
        return n

    def _value(self, text: str) -> int:
        """The negative value standing for whitespace ``text``: one per text, in the order met."""
        with self._lock:
            return self._values.setdefault(text, -1 - len(self._values))
