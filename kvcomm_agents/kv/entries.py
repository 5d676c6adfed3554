"""What a segment store holds: KV segments (:mod:`.segments`) and exact prefix entries."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch

from .block import KVBlock
from .segments import KVSegment

__all__ = ["PrefixEntry", "Entry"]


@dataclass(eq=False)
class PrefixEntry:
    """Exact KV of a token sequence from position 0, as a dense prefill would compute it.

    Attributes:
        id: store key.
        token_ids: ``[n]`` int64 tensor on the CPU.
        kv: the KV of those ``n`` tokens, keys at their true positions ``0..n-1`` (no
            re-rotation needed).
        fingerprint: fingerprint of the model that computed them.
    """

    id: str
    token_ids: torch.Tensor
    kv: KVBlock
    fingerprint: str

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes

    def ids_tensor(self) -> torch.Tensor:
        """``[n]`` int64 (CPU): the ids the KV is for (as on every store entry)."""
        return self.token_ids

    def common_prefix(self, ids: torch.Tensor) -> int:
        """Length of the common prefix of this entry's ids and ``ids`` (``[n]`` int64, CPU)."""
        n = min(self.token_ids.numel(), ids.numel())
        if n == 0:
            return 0
        differ = (self.token_ids[:n] != ids[:n]).nonzero()
        return int(differ[0, 0]) if differ.numel() else n


#: A stored entry: a segment (keys in the canonical frame) or an exact prefix (keys at 0..n-1);
#: both give ``id``, ``fingerprint``, ``ids_tensor()``, ``kv`` and ``nbytes``.
Entry = Union[KVSegment, PrefixEntry]
