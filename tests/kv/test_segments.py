"""Segment references survive JSON; a segment's KV must fit its ids; content hashes see edits."""

import json

import pytest
import torch

from kvcomm_agents import SegmentRef
from kvcomm_agents.kv.block import KVBlock
from kvcomm_agents.kv.segments import KVSegment, content_hash


def make_segment(text="hello world", tokens=4, layers=2, fingerprint="m1", kind=("user", None)):
    kv = KVBlock.stacked(torch.zeros(layers, 2, tokens, 8), torch.ones(layers, 2, tokens, 8))
    spans = [(i, i + 1) for i in range(tokens)]
    return KVSegment.create(kind=kind, text=text, token_ids=list(range(tokens)), char_spans=spans, kv=kv,
                            fingerprint=fingerprint)


def test_ref_survives_json_round_trip():
    ref = make_segment(kind=("solver-1", "assistant"), fingerprint="fp").ref
    restored = SegmentRef.model_validate(json.loads(ref.model_dump_json()))
    assert restored == ref
    assert SegmentRef.coerce(ref.model_dump()) == ref
    assert restored.kind == ("solver-1", "assistant") and restored.fingerprint == "fp"
    assert restored.num_tokens == 4 and restored.text_hash == content_hash("hello world", [0, 1, 2, 3])


def test_ref_of_another_version_is_refused():
    ref = make_segment().ref.model_dump()
    ref["model"] = ref.pop("fingerprint")  # the field's old name
    with pytest.raises(ValueError):
        SegmentRef.coerce(ref)


def test_content_hash_changes_with_text_and_ids():
    assert content_hash("a b", [1, 2]) != content_hash("a c", [1, 2])
    assert content_hash("a b", [1, 2]) != content_hash("a b", [1, 3])
    assert content_hash("a b", [1, 2]) == content_hash("a b", (1, 2))


def test_segment_rejects_mismatched_kv():
    kv = KVBlock.stacked(torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 3, 4))
    with pytest.raises(ValueError):
        KVSegment.create(kind=("user", None), text="x", token_ids=[1, 2], char_spans=[(0, 1), None], kv=kv,
                         fingerprint="m")
    with pytest.raises(ValueError):  # one span per id
        KVSegment.create(kind=("user", None), text="x", token_ids=[1, 2, 3], char_spans=[(0, 1)], kv=kv,
                         fingerprint="m")


def test_index_of_finds_a_token_by_its_character_offset_and_id():
    kv = KVBlock.stacked(torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 3, 4))
    segment = KVSegment.create(kind=("user", None), text="abcd", token_ids=[7, 8, 9],
                               char_spans=[(0, 2), None, (2, 4)], kv=kv, fingerprint="m")
    assert segment.index_of(0, 7) == 0 and segment.index_of(2, 9) == 2
    assert segment.index_of(2, 8) is None  # the id at offset 2 is 9; token 1 maps onto no text
    assert segment.index_of(1, 7) is None
    assert segment.nbytes == 2 * 3 * 4 * 4
