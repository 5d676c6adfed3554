"""What every method, dense included, needs of a model's cache, checked at load.

The engine drives transformers' ``DynamicCache`` itself: it passes the cache to the model's
forward, reads how many tokens it holds, and extends a filled cache by several ids in one forward
(a prompt after a reused or stored prefix, a draft verified in one step, a replayed reply).
``generate`` extends a cache one id at a time, so a model can pass every transformers test and
still break here, some silently: a recurrent model that keeps its state under another keyword
ignores the cache and decodes without its prompt; multi-head latent attention in transformers
cannot take several ids onto a filled cache; models with caches of their own refuse the
``DynamicCache``. Three forwards of 7 ids at load find each of these and refuse the model with
:class:`~.errors.UnsupportedModelError`, instead of a crash or wrong tokens mid-call: about half
a second for the embedded model on a 2-core CPU (the weights are read once per forward), once
per model object however many engines serve it.
"""

from __future__ import annotations

import weakref

import torch
from transformers import PreTrainedModel

from .engines import hf
from .errors import UnsupportedModelError
from .model_config import sliding_window, text_config

__all__ = ["check_cache"]

_IDS = 7  # the check's sequence: 4 ids into an empty cache, then 3 onto the filled one
_FILLED = 4
_NOT_SUPPORTED = "run it with plain transformers' generate"
_PASSED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()  # models checked already


@torch.no_grad()
def check_cache(model: PreTrainedModel) -> None:
    """Refuse ``model`` unless a forward fills the cache it is given and a forward of several ids
    onto a filled cache gives the ``[3, vocab]`` logits one forward of the whole sequence gives
    (to float rounding: 1e-3 of the largest logit in float32, 5e-2 in half precision), in eval
    mode (the model's mode is restored). A sliding window of 7 tokens or less is not checked.

    Raises:
        UnsupportedModelError: what failed, with the model's own error where it raised one.
    """
    if model in _PASSED:
        return
    model_type = getattr(text_config(model.config), "model_type", "?")
    window = sliding_window(model.config)
    if window is not None and window <= _IDS:  # the cache keeps the window only: nothing to compare (test-sized)
        return
    device = hf.input_device(model)
    ids = (torch.arange(3, 3 + _IDS, device=device) % model.get_input_embeddings().weight.shape[0])[None]
    positions = torch.arange(_IDS, device=device)[None]
    training = model.training
    model.eval()  # dropout would tell the two computations apart
    try:
        whole = hf.run_forward(model, ids, hf.new_cache(model), position_ids=positions, last_logits_only=False)
        cache = hf.new_cache(model)
        hf.run_forward(model, ids[:, :_FILLED], cache, position_ids=positions[:, :_FILLED])
        filled = hf.num_cached(cache)
        rest = hf.run_forward(model, ids[:, _FILLED:], cache, position_ids=positions[:, _FILLED:], last_logits_only=False)
    except Exception as error:  # noqa: BLE001 - any failure here means the model cannot be served
        raise UnsupportedModelError(
            f"'{model_type}' cannot run on a transformers DynamicCache as every method here drives it, extending a "
            f"filled cache by several ids in one forward ({type(error).__name__}: {error}); {_NOT_SUPPORTED}",
            dense_fallback=False,
        ) from error
    finally:
        model.train(training)
    if filled != _FILLED:
        raise UnsupportedModelError(
            f"'{model_type}' does not keep its context in the transformers cache it is given (it held {filled} of "
            f"{_FILLED} ids after a forward: a recurrent state under another keyword?); {_NOT_SUPPORTED}",
            dense_fallback=False,
        )
    expected = whole[0, _FILLED:].float()
    error = float((rest[0].float() - expected).abs().max() / expected.abs().max().clamp_min(1e-6))
    tolerance = 1e-3 if model.dtype in (torch.float32, torch.float64) else 5e-2  # the weights', not the logits'
    if error > tolerance:
        raise UnsupportedModelError(
            f"'{model_type}' gives other logits for ids added onto a filled cache than for the same ids in one "
            f"forward (relative difference {error:.1e}, tolerance {tolerance:.0e}); {_NOT_SUPPORTED}",
            dense_fallback=False,
        )
    _PASSED.add(model)
