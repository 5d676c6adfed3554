"""Settings users knew under other names: a clear error saying what to write instead, rather than
pydantic's "extra inputs are not permitted"."""

from __future__ import annotations

__all__ = ["MOVED", "RENAMED", "refuse_old_names"]

#: Settings that left ``ExperimentalSettings``, and what a user writes instead (a clear error
#: rather than pydantic's "extra inputs are not permitted").
MOVED = {
    "recompute_head": "KVCommConfig(recompute_head=...)",
    "recorded_versions": "KVCommConfig(recorded_versions=...)",
    "shared_runs": "KVCommConfig(shared_runs=...)",
    "framed_replies": "KVCommConfig(reply_copies=...)",
    "framed_texts": "KVCommConfig(text_copies=...)",
    "anchor_lengths": "nothing: removed (anchors at least as long as the segment are consulted, the paper's rule)",
    "new_segment": "nothing: removed (a new segment and everything after it are computed)",
    "recompute_spread": "nothing: removed (measured and lost, benchmarks/LAB.md)",
}

#: Settings of ``KVCommConfig`` that were renamed, and their names now.
RENAMED = {"text_copies_when_cheaper": "copies_when_cheaper"}


def refuse_old_names(data, old: dict[str, str], message: str):
    """``data`` (a model's raw input), or a clear error for a setting it names in ``old``
    (``message`` formatted with the setting's ``name`` and what to write instead, ``new``)."""
    if isinstance(data, dict):
        for name in data:
            if name in old:
                raise ValueError(message.format(name=name, new=old[name]))
    return data
