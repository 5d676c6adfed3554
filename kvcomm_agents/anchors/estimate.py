"""KVCOMM's offset estimate for a segment from the anchors the gate consulted.

``"mean"`` (the default): the plain average of the consulted anchors' offsets, per token.
``"weighted"`` (the paper): per-token softmax weights over the anchors' base-KV distances for the
segment's own offsets (anchors left-aligned), per (layer, head, channel) weights over the anchors'
last tokens for the own-text piece after it (right-aligned). On 40 GSM8K debates both cut
first-token KL against dense by the same 3x (docs/fidelity.md), so the cheaper mean is default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import torch

from .pool import AnchorPool

__all__ = ["Estimator", "OffsetEstimate", "estimate_offsets"]

Estimator = Literal["mean", "weighted"]


@dataclass
class OffsetEstimate:
    """Estimated canonical-frame offsets, ``[L-1, kv_heads, tokens, head_dim]`` float32.

    ``own_text_keys``/``own_text_values`` (``[L-1, kv_heads, P, head_dim]``) are for the own-text
    piece after the segment (None when the anchors hold none for it)."""

    keys: torch.Tensor
    values: torch.Tensor
    own_text_keys: Optional[torch.Tensor] = None
    own_text_values: Optional[torch.Tensor] = None


def estimate_offsets(
    pool: AnchorPool,
    receiver: str,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor,
    estimator: Estimator,
    temperature: float,
    piece: Optional[str] = None,
    source: Optional[str] = None,
) -> OffsetEstimate:
    """Offsets of a segment with canonical base ``keys``/``values`` ``[L-1, H, T, D]`` for
    ``receiver``, from the anchors in ``slots`` (``[N]``, all holding this receiver's offsets and
    at least ``T`` tokens long); with ``piece``, also the own-text offsets of that piece.
    ``source``: whose placeholder offsets the anchors are read from (default ``receiver``; a
    recorded version of the segment, :mod:`kvcomm_agents.versions`)."""
    t = keys.shape[2]
    stack = pool.placeholder[source or receiver]
    k_off, v_off = stack.dense(slots, t)
    device = k_off.device
    query_k, query_v = keys.float().to(device), values.float().to(device)
    if estimator == "weighted":
        base_k, base_v = pool.base_dense(slots, t)
        w_k = torch.softmax(-(base_k - query_k[None]).abs().mean(dim=(1, 2, 4)) / temperature, dim=0)  # [N, T]
        w_v = torch.softmax(-(base_v - query_v[None]).abs().mean(dim=(1, 2, 4)) / temperature, dim=0)
        est_k = torch.einsum("nt,nlhtd->lhtd", w_k, k_off)
        est_v = torch.einsum("nt,nlhtd->lhtd", w_v, v_off)
    else:
        est_k, est_v = k_off.mean(dim=0), v_off.mean(dim=0)
    return _with_own_text(OffsetEstimate(est_k, est_v), pool, receiver, slots, keys, query_k, query_v, estimator, temperature, piece)


def _with_own_text(result: OffsetEstimate, pool: AnchorPool, receiver: str, slots: torch.Tensor, keys: torch.Tensor,
                   query_k: torch.Tensor, query_v: torch.Tensor, estimator: Estimator, temperature: float,
                   piece: Optional[str]) -> OffsetEstimate:
    """``result`` with the own-text offsets of ``piece`` (if the anchors hold them)."""
    t = keys.shape[2]
    device = query_k.device
    own = pool.own_text.get((receiver, piece)) if piece is not None else None
    if own is None:
        return result
    chosen = slots[pool.held_by(own)[slots]]
    if not chosen.numel():
        return result
    pk, pv = own.dense(chosen, own.width(chosen))
    if estimator == "weighted":
        # right-aligned: each anchor's last T tokens, nearest the following piece
        index = (pool.lengths[chosen] - t)[:, None] + torch.arange(t)[None]  # [N, T]
        gather = index.to(device)[:, None, None, :, None].expand(-1, *keys.shape[:2], -1, keys.shape[3])
        base_k, base_v = pool.base_dense(chosen, int(pool.lengths[chosen].max()))
        near_k, near_v = base_k.gather(3, gather), base_v.gather(3, gather)
        u_k = torch.softmax(-(near_k - query_k[None]).norm(dim=3) / temperature, dim=0)  # [N, L, H, D]
        u_v = torch.softmax(-(near_v - query_v[None]).norm(dim=3) / temperature, dim=0)
        result.own_text_keys = torch.einsum("nlhd,nlhpd->lhpd", u_k, pk)
        result.own_text_values = torch.einsum("nlhd,nlhpd->lhpd", u_v, pv)
    else:
        result.own_text_keys, result.own_text_values = pk.mean(dim=0), pv.mean(dim=0)
    return result
