"""KVCOMM (Ye et al., NeurIPS 2025, arXiv 2510.12872) in one place: anchors and their offsets.

An *anchor* is one earlier shared segment of a kind (the user question, agent X's reply, a tool
result): its base KV (canonical frame, layers 1..L-1) plus, for each receiving agent that computed
it with exact context, the observed offsets ``real - base`` of the segment itself ("placeholder")
and of the receiver's own-text piece that follows it (keyed by the piece's ids). Keys are in the
canonical RoPE frame (token ``t`` at position ``t``), so offsets apply wherever a segment lands.
Layer 0 is never offset (it is exact after re-rotation) and is not stored.

- :mod:`.pool`: storage of one kind's anchors, eviction;
- :mod:`.gate`: the paper's entropy rule;
- :mod:`.estimate`: the offset estimate (mean, or the paper's weights);
- :mod:`.tracker`: whether a kind's offsets help a receiver, from paired audits against dense;
- :mod:`.kvcomm`: :class:`KVCommAnchors`, the three calls the engine makes (decide, attach
  offsets, observe exact KV) and the byte budget over pools.
"""

from .estimate import OffsetEstimate
from .gate import GateVerdict
from .kvcomm import KVCommAnchors
from .pool import AnchorPool
from .tracker import KindRecord, OffsetTracker

__all__ = ["KVCommAnchors", "GateVerdict", "OffsetEstimate", "AnchorPool", "OffsetTracker", "KindRecord"]
