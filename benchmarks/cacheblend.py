"""CacheBlend-style selective recompute (Yao et al., EuroSys 2025, arXiv 2405.16444), our own take.

Re-rotated KV is exact at layer 0 and drifts above it because the reused tokens attended to a
different context when they were computed. CacheBlend recomputes the few tokens whose KV deviates
most. Here: run only the first ``probe_layers`` decoder layers densely over the prompt (after the
exact prefix), compare the real KV of the last probed layer with the reused KV at the same
positions, and hand the top ``share`` of reused tokens back to the prefill forward, which computes
them in context (attending to the reused KV around them, under the position mask). The probe's
cost is part of the call's time to first token.

A baseline, not part of the product: it plugs into the engine through its one plan hook
(``KVCommEngine(plan_hook=CacheBlend(share))``), between planning and prefill.
"""

from __future__ import annotations

import dataclasses
import math
import threading

import torch
from transformers import PreTrainedModel

from kvcomm_agents import forwards
from kvcomm_agents.engines import hf
from kvcomm_agents.kv.rope import RopeRotator
from kvcomm_agents.plan import CallPlan

__all__ = ["CacheBlend", "select_recompute", "deviation_per_token"]


class _ProbeDone(Exception):
    """Raised from a forward hook to stop the forward after the probed layers."""


def _decoder_layers(model: PreTrainedModel) -> torch.nn.ModuleList:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    return decoder.layers


def _probe_layer_kv(model: PreTrainedModel, plan: CallPlan, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense KV of layer ``layer`` for every prompt position (``[1, kv_heads, N, head_dim]``),
    computing only layers ``0..layer``; the exact prefix is taken from the plan, not recomputed."""
    device = hf.input_device(model)
    prefix = plan.prefix_length
    if prefix:
        cache = hf.cache_from_block(model, plan.prefix.entry.kv.window(0, prefix))
    else:
        cache = hf.new_cache(model)

    prober = threading.get_ident()

    def stop(*_):
        if threading.get_ident() == prober:  # another engine sharing the model runs on
            raise _ProbeDone

    handle = _decoder_layers(model)[layer].register_forward_hook(stop)
    try:
        hf.run_forward(
            model, plan.prompt_ids[prefix:][None].to(device), cache,
            position_ids=torch.arange(prefix, plan.num_prompt, device=device)[None],
        )
    except _ProbeDone:
        # charged as a whole forward (the engine's tally and a hook on the model both count it
        # so), although only layers 0..layer ran: CacheBlend's compute is overstated a little
        forwards.charge(plan.num_prompt - prefix)
    finally:
        handle.remove()
    return hf.layer_kv(cache, layer)


def _runs_at_layer(plan: CallPlan, rotator: RopeRotator, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The runs' reused ``(keys, values)`` ``[1, kv_heads, R, head_dim]`` of one layer, keys at
    their prompt positions (offsets, if any, added as the engine's assembly adds them)."""
    keys, values = [], []
    for run in plan.runs:
        kv = run.segment.kv.window(run.segment_start, run.segment_start + run.length)
        k, v = kv.with_offsets(run.key_offsets, run.value_offsets).layer(layer)
        keys.append(rotator.shift(k, run.shift))
        values.append(v)
    return torch.cat(keys, dim=2), torch.cat(values, dim=2)


def deviation_per_token(
    real: tuple[torch.Tensor, torch.Tensor], reused: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """``[n]`` squared L2 distance between two ``(keys, values)`` pairs of ``[1, kv_heads, n,
    head_dim]``, keys and values together, over heads and channels."""
    dk = (real[0].float() - reused[0].float()).pow(2).sum(dim=(0, 1, 3))
    dv = (real[1].float() - reused[1].float()).pow(2).sum(dim=(0, 1, 3))
    return (dk + dv).cpu()


def select_recompute(
    model: PreTrainedModel, rotator: RopeRotator, plan: CallPlan, *, share: float, probe_layers: int = 2
) -> tuple[CallPlan, int]:
    """Move the ``share`` of re-rotated tokens whose KV deviates most from dense into the computed set.

    Args:
        plan: a plan with re-rotated runs (offsets, if any, already attached).
        share: fraction of the runs' tokens to recompute, rounded up (0 < share <= 1).
        probe_layers: decoder layers run densely to measure the deviation (at the last of them;
            layer 0 of re-rotated KV is exact, so at least 2).

    Returns:
        ``(new_plan, recomputed)``: the plan with the chosen positions in ``recompute`` (the
        assembly drops their reused KV, the prefill computes them), and how many were chosen.
    """
    reused = sum(run.length for run in plan.runs)
    count = min(reused, math.ceil(share * reused))
    if count == 0:
        return plan, 0
    layer = min(probe_layers, model.config.num_hidden_layers) - 1
    real_k, real_v = _probe_layer_kv(model, plan, layer)
    positions = torch.cat([torch.arange(run.prompt_start, run.prompt_end) for run in plan.runs])
    index = positions.to(real_k.device)
    reused_kv = _runs_at_layer(plan, rotator, layer)
    deviation = deviation_per_token(
        (real_k.index_select(2, index), real_v.index_select(2, index)), reused_kv
    )
    chosen = positions[torch.topk(deviation, count).indices].sort().values
    return dataclasses.replace(plan, recompute=chosen), count


class CacheBlend:
    """The engine's plan hook for CacheBlend-style recompute of ``share`` of the re-rotated tokens,
    measured at decoder layer ``probe_layers - 1``. ``calls`` and ``recomputed`` count its work."""

    def __init__(self, share: float, probe_layers: int = 2) -> None:
        if not 0.0 < share <= 1.0 or probe_layers < 2:
            raise ValueError("share must be in (0, 1] and probe_layers >= 2")
        self.share, self.probe_layers = share, probe_layers

    def __call__(self, engine, plan: CallPlan) -> CallPlan:
        new_plan, _ = select_recompute(engine.model, engine.info.rotator, plan, share=self.share,
                                       probe_layers=self.probe_layers)
        return new_plan
