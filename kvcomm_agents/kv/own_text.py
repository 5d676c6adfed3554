"""Per-agent own-text KV: the canonical KV of the receiver's own text after shared segments.

A receiver's prompt is ``own_0 | shared_1 | own_1 | ... | shared_m | own_m``: its own-text pieces
(role headers, connective text such as "Solver 2 answered:") recur call after call with the same
ids. The first time a piece is computed, its KV (keys de-rotated to the canonical frame) is kept
here, keyed by the agent and the piece's ids; with ``experimental.own_text="reuse"`` later calls
re-rotate it instead of computing it, adding the anchors' estimated own-text offsets.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Optional, Sequence

import torch

from .block_count import BlockCount
from ..plan import Observation, OwnTextPiece, ReusedRun
from .segments import KVSegment

__all__ = ["OwnTextStore", "own_text_pieces", "piece_key"]


def piece_key(ids: Sequence[int]) -> str:
    """Stable key of an own-text piece's token ids."""
    return hashlib.sha256(",".join(map(str, ids)).encode("ascii")).hexdigest()[:24]


class OwnTextStore:
    """Own-text pieces per agent, least recently used beyond ``max_bytes``.

    Pieces are :class:`KVSegment` of kind ``(agent, "own_text")``; they are never found by
    content search (they live outside the segment store) and are never handed out. ``freeze``:
    the engine's freeze count (shared with its anchors).
    """

    def __init__(self, max_bytes: int, freeze: Optional[BlockCount] = None) -> None:
        self.max_bytes = max_bytes
        self._pieces: OrderedDict[tuple[str, str], KVSegment] = OrderedDict()
        self._lock = threading.RLock()
        self._freeze = freeze or BlockCount()

    @property
    def frozen(self) -> bool:
        """True inside a ``freeze_anchors`` block: no piece is kept."""
        return self._freeze.active

    def get(self, agent: str, key: str) -> Optional[KVSegment]:
        with self._lock:
            piece = self._pieces.get((agent, key))
            if piece is not None:
                self._pieces.move_to_end((agent, key))
            return piece

    def put(self, agent: str, key: str, piece: KVSegment) -> bool:
        """Keep a piece (first one wins); False when frozen or larger than the budget."""
        if self.frozen or piece.nbytes > self.max_bytes:
            return False
        with self._lock:
            if (agent, key) in self._pieces:
                return True
            self._pieces[(agent, key)] = piece
            while self.nbytes() > self.max_bytes:
                self._pieces.popitem(last=False)
            return True

    def nbytes(self) -> int:
        with self._lock:
            return sum(piece.nbytes for piece in self._pieces.values())

    def __len__(self) -> int:
        return len(self._pieces)

    def clear(self) -> None:
        with self._lock:
            self._pieces.clear()


def own_text_pieces(
    ids: torch.Tensor, runs: list[ReusedRun], observations: list[Observation], agent: str,
    own_texts: Optional[OwnTextStore],
) -> tuple[list[ReusedRun], list[OwnTextPiece]]:
    """A plan's own-text pieces, given its ``[n]`` prompt ``ids``: after each segment that runs
    to its last token, the text up to the next shared segment (reused or observed) or the last
    prompt token. A piece is reused from the agent's own-text KV when there is one
    (``own_texts`` given). Returns the runs (own-text runs added) and the pieces."""
    n = int(ids.numel())
    ends = [(run.found_start, run.prompt_end + run.tail, run, None) for run in runs]
    ends += [(seen.prompt_start, seen.prompt_start + seen.length, None, seen) for seen in observations]
    ends.sort(key=lambda item: item[0])
    pieces, new_runs = [], []
    for i, (_, end, run, seen) in enumerate(ends):
        segment = run.segment if run is not None else seen.segment
        if run is not None and run.segment_start + run.length + run.tail != segment.num_tokens:
            continue
        if seen is not None and not seen.reaches_end:
            continue
        stop = ends[i + 1][0] if i + 1 < len(ends) else n - 1
        if stop <= end:
            continue
        piece = tuple(ids[end:stop].tolist())
        key = piece_key(piece)
        kv = own_texts.get(agent, key) if run is not None and own_texts is not None else None
        reused = kv is not None and kv.num_tokens == stop - end
        pieces.append(OwnTextPiece(end, stop, key, piece, segment, reused=reused, observed=seen is not None))
        if reused:
            new_runs.append(ReusedRun(kv, end, 0, stop - end, own_text=True, verdict=run.verdict))
    return sorted(runs + new_runs, key=lambda r: r.prompt_start), pieces
