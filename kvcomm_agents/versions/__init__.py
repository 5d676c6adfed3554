"""Versions of a segment's KV: its base (where it was first computed) and the receivers' recorded
offsets, and which one fits a new context (:mod:`.match`, :class:`.book.Versions`)."""

from .book import Versions
from .match import MIN_CONTEXT_MATCH, RecordedVersion, best_recorded_version, framed_receiver, is_framed

__all__ = ["Versions", "MIN_CONTEXT_MATCH", "RecordedVersion", "best_recorded_version", "framed_receiver", "is_framed"]
