"""Exact RoPE re-rotation of cached keys, as small pure functions.

For the rotary embedding of Llama, Qwen2, Mistral and most others (non-interleaved halves)
a key at position ``p`` is ``R(p)·k = k ⊙ cos(pθ) + rotate_half(k) ⊙ sin(pθ)`` with
``θ = concat(inv_freq, inv_freq)``. Rotations compose, ``R(a)R(b) = R(a+b)``, so a cached key moves
from position ``p`` to ``p + δ`` by ``R(δ)``; ``δ < 0`` de-rotates. Values carry no position.

Segments are stored in a *canonical frame*: de-rotated so that their first token sits at
position 0. Using one at prompt position ``s`` is then a single rotation by ``δ = s``.

The tables are built from the model's own ``inv_freq`` (which already includes ``linear`` and
``llama3`` scaling), never from ``rotary_emb``'s cos/sin, which carry ``attention_scaling``:
the cached keys already hold it once.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["rotate_half", "rotation_tables", "rotate_keys", "RopeRotator"]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of the last dimension: ``[x1, x2] -> [-x2, x1]``.

    Args:
        x: ``[..., head_dim]``.
    """
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotation_tables(
    inv_freq: torch.Tensor, delta: int | torch.Tensor, *, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of ``R(delta)``.

    Args:
        inv_freq: ``[head_dim // 2]`` rotary frequencies, on the target device.
        delta: an int (one shift for every token) or a ``[tokens]`` integer tensor.
        dtype: dtype of the returned tables (:meth:`RopeRotator.shift` asks float32, or float64
            for float64 keys: half-precision keys are rotated in float32).

    Returns:
        ``(cos, sin)``, each ``[head_dim]`` for an int delta or ``[tokens, head_dim]`` for a tensor.
        Angles are computed in float64 where the device supports it, so shifts by thousands of
        positions stay exact to float32 rounding.
    """
    wide = torch.float32 if inv_freq.device.type == "mps" else torch.float64
    freq = inv_freq.to(wide)
    if isinstance(delta, torch.Tensor):
        angles = delta.to(device=freq.device, dtype=wide)[:, None] * freq[None, :]
    else:
        angles = float(delta) * freq
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_keys(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Apply a rotation to post-RoPE keys.

    Args:
        keys: ``[..., tokens, head_dim]`` (e.g. ``[batch, kv_heads, tokens, head_dim]``).
        cos, sin: ``[head_dim]`` or ``[tokens, head_dim]`` from :func:`rotation_tables` (each
            row the same angles twice, one copy per half of the head).
        out: where to write the result (shaped and typed like ``keys``), or None for a new
            tensor.

    Returns:
        The rotated keys (``out`` when given), typed like ``keys``; half-precision keys are
        rotated in float32 and rounded once. Full-precision keys are rotated half by half
        (``[k1, k2] -> [k1 c - k2 s, k2 c + k1 s]``): two passes over the keys and one
        allocation, where ``k ⊙ cos + rotate_half(k) ⊙ sin`` makes five; a long reused prompt's
        alignment is mostly this.
    """
    if cos.shape[-1] != keys.shape[-1] or sin.shape[-1] != keys.shape[-1]:
        raise ValueError(f"rotation tables of width {cos.shape[-1]} for keys of head_dim {keys.shape[-1]}")
    if keys.dtype in (torch.float16, torch.bfloat16) or (
            out is not None and out.untyped_storage().data_ptr() == keys.untyped_storage().data_ptr()):
        wide = keys.float() if keys.dtype in (torch.float16, torch.bfloat16) else keys
        rotated = (wide * cos + rotate_half(wide) * sin).to(keys.dtype)  # a temporary: out may alias keys
        return rotated if out is None else out.copy_(rotated)
    half = keys.shape[-1] // 2
    cos, sin = cos[..., :half].to(keys.dtype), sin[..., :half].to(keys.dtype)  # both halves share them
    out = torch.empty_like(keys) if out is None else out
    first, second = keys[..., :half], keys[..., half:]
    torch.mul(first, cos, out=out[..., :half]).addcmul_(second, sin, value=-1)
    torch.mul(second, cos, out=out[..., half:]).addcmul_(first, sin)
    return out


class RopeRotator:
    """Re-rotates keys of one model, keeping a copy of ``inv_freq`` on every device it meets.

    Args:
        inv_freq: ``[head_dim // 2]``, the model's rotary frequencies.
    """

    def __init__(self, inv_freq: torch.Tensor) -> None:
        self._inv_freq = inv_freq.detach().to(torch.float32).clone()
        self._per_device: dict[torch.device, torch.Tensor] = {}

    @property
    def head_dim(self) -> int:
        """Rotated channels per head (twice the number of frequencies)."""
        return 2 * self._inv_freq.numel()

    def inv_freq_on(self, device: torch.device) -> torch.Tensor:
        """``inv_freq`` on ``device`` (cached)."""
        found = self._per_device.get(device)
        if found is None:
            found = self._inv_freq.to(device)
            self._per_device[device] = found
        return found

    def shift(self, keys: torch.Tensor, delta: int | torch.Tensor,
              out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Move keys by ``delta`` positions.

        Args:
            keys: ``[batch, kv_heads, tokens, head_dim]`` post-RoPE keys.
            delta: an int, or a ``[tokens]`` tensor of per-token shifts.
            out: where to write them (:func:`rotate_keys`), or None.

        Returns:
            Keys as the model would have computed them ``delta`` positions later. ``delta == 0``
            returns ``keys`` itself (copied into ``out`` when given).
        """
        if isinstance(delta, int) and delta == 0:
            return keys if out is None else out.copy_(keys)
        table_dtype = torch.float64 if keys.dtype == torch.float64 else torch.float32
        cos, sin = rotation_tables(self.inv_freq_on(keys.device), delta, dtype=table_dtype)
        return rotate_keys(keys, cos, sin, out)
