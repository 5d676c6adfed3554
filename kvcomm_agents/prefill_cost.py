"""When reusing a little KV costs more than computing the whole prompt.

A prompt computed whole runs one forward with the causal kernel, which skips the key blocks after
each query: ``N`` tokens cost about ``N`` linear-layer passes plus ``N^2 / 2`` attention pairs.
A prompt computed after reused KV (an exact prefix, re-rotated runs) needs an explicit mask,
and the masked kernel computes every query against every key it is given: ``Q`` computed tokens
cost ``Q`` passes plus about ``Q x N`` pairs. So a plan that reuses a small share of a long
prompt can be slower than dense. Measured on the embedded model (2 CPU threads, random ids, best
of 3; benchmarks/LAB.md, "No call slower than dense"): a 2,048-token prompt whose first 2% is
reused costs 1.14x the whole prompt's time, 10% 1.11x, 20% 1.04x, 30% 0.83x; at 1,024 tokens
2% costs 1.06x and 10% 0.94x.

:class:`PrefillCost` compares the two from the model's shape (the FLOPs of one attention pair
against one token's linear layers) and :meth:`PrefillCost.worth_reusing` says whether a plan's
reuse pays; the engine computes the prompt whole otherwise (``dense_reason="little_reuse"``).
Applied on CPUs only: that is where the masked kernel's cost was measured (on CUDA, prefills of
this size are bound by kernel launches; never measured).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .model_config import text_config
from .plan import CallPlan

__all__ = ["PrefillCost", "prefill_cost"]


@dataclass(frozen=True)
class PrefillCost:
    """Prefill cost in units of one token's linear layers.

    Attributes:
        pair_cost: the cost of one query-key attention pair (all layers and heads) relative to
            one token's pass through the linear layers (projections, MLP).
    """

    pair_cost: float

    def causal(self, num_prompt: int) -> float:
        """Cost of computing ``num_prompt`` tokens in one causal forward."""
        return num_prompt * (1.0 + self.pair_cost * num_prompt / 2.0)

    def masked(self, computed: int, num_prompt: int) -> float:
        """Cost of computing ``computed`` of ``num_prompt`` tokens under an explicit mask (every
        computed query against every key of the prompt)."""
        return computed * (1.0 + self.pair_cost * num_prompt)

    def worth_reusing(self, plan: CallPlan) -> bool:
        """Whether ``plan`` (with reused tokens) is cheaper than computing its prompt whole."""
        n = plan.num_prompt
        return self.masked(n - plan.reused_tokens, n) < self.causal(n)


def prefill_cost(model, device: torch.device) -> Optional[PrefillCost]:
    """The :class:`PrefillCost` of ``model`` on ``device``; None off the CPU (not measured there)
    or when the config lacks the attention shape.

    ``pair_cost = 4 * heads * head_dim * layers / (2 * linear parameters)``: a query-key pair
    costs 2 multiply-adds per head dimension (scores, then values) per head and layer; a token
    costs one multiply-add per parameter of the linear layers (every parameter but the
    embeddings)."""
    if torch.device(device).type != "cpu":
        return None
    text = text_config(getattr(model, "config", None))
    heads = getattr(text, "num_attention_heads", None)
    layers = getattr(text, "num_hidden_layers", None)
    hidden = getattr(text, "hidden_size", None)
    if not (heads and layers and hidden):
        return None
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    embeddings = {id(p) for module in (model.get_input_embeddings(), model.get_output_embeddings())
                  if module is not None for p in module.parameters()}
    linear = sum(p.numel() for p in model.parameters() if id(p) not in embeddings)
    if linear <= 0:
        return None
    return PrefillCost(pair_cost=4.0 * heads * head_dim * layers / (2.0 * linear))
