"""How a model's linear weights lie in memory on the CPU: as loaded, or transposed, measured.

``nn.Linear`` keeps its weight as ``[out, in]``, row-major, and computes ``x @ weight.T``; a
decode step multiplies a few rows ``x`` by every weight of the model. Which memory order of the
same values the CPU's matrix kernels stream faster depends on the CPU and the BLAS build: on 2
cores of an AMD EPYC with torch's MKL build, the embedded model's (fp32) forward after 300 cached
took, as loaded -> with each weight stored ``[in, out]``: 1 id 40.4 -> 33.8 ms, 2 ids 68.0 -> 50.7,
3 ids 81.3 -> 64.1, 5 ids 56.0 -> 58.3; a prefill of 300 ids 0.84x the time
(``python -m benchmarks.batched_steps --layouts as_loaded,transposed``). The transposed weight is
the same tensor to every reader (``weight[i, j]`` unchanged, only its strides differ: ``weight.T``
is then contiguous), so the model computes the same function; only float rounding of the
products' order may differ.

:func:`choose_layout` times the engine's own forward shapes (a decode step of 1 id and a drafted
one of 5) with each layout on the model itself and keeps the faster, where it is faster by
a clear margin. The choice is written into the model's parameters in place (``param.data``:
tied weights stay tied, the identity digest is unchanged and not read again,
:func:`kvcomm_agents.identity.values_kept`) and
remembered on the model, so engines sharing it measure once (:func:`weights_as_loaded` undoes
it, before ``save_pretrained``). Off the CPU nothing is done (GPU kernels read either order
well). Build the first engine on a model before serving from it: the
probe times forwards, and a model busy in another thread would time the contention.

The probe costs 32 forwards, each layout timed twice in turns (a turn took 0.26-0.27 s for the
embedded model on an AVX2 host; a 7B model on a CPU takes seconds per forward). Where a folder is given (the engine's
``remember_measurements`` folder), a measured choice is written to ``<folder>/layout-<key>.json``
and read back by the next process: the key is what the timing depends on (the CPU's name and
vector instructions, torch's version and thread count, each weight's shape and dtype), not the
weights' values, so a fine-tuned copy of a model reads its base's choice. A missing, unreadable or
foreign file costs a measurement, never an error.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import platform
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal, Optional

import torch

from ..identity import values_kept
from . import hf

__all__ = ["FORMAT", "Layout", "LayoutChoice", "choose_layout", "layout_key", "linear_weights", "pin_layout",
           "set_layout", "weights_as_loaded", "host_cpu"]

Layout = Literal["as_loaded", "transposed"]
FORMAT = "kvcomm-weight-layout/1"  # the remembered choice's file format
_CHOSEN = "_kvcomm_weight_layout"  # the model attribute that remembers the choice
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
#: a probe forward slower than this is timed once per shape, not three times: at that length a
#: run's noise is a small share of it, and a large model would pay seconds per repeat
SLOW_FORWARD_S = 0.25
#: The order the probe times the layouts in (balanced against a load that rises or falls).
PROBE_TURNS: tuple[Layout, ...] = ("as_loaded", "transposed", "transposed", "as_loaded")
logger = logging.getLogger("kvcomm_agents")


@dataclass(frozen=True)
class LayoutChoice:
    """The layout an engine's model runs with, and why.

    Attributes:
        layout: ``"as_loaded"`` or ``"transposed"``.
        reason: how it was chosen (``"measured"``, ``"remembered"`` from an earlier process's
            measurement, ``"set"`` by the setting, ``"chosen before"`` by an earlier engine on
            the model, or why nothing was done: ``"not on the CPU"``, ``"no linear weights"``).
        seconds: per layout measured, the seconds of the probe forwards (empty where none ran;
            remembered: the earlier process's).
    """

    layout: Layout
    reason: str
    seconds: dict = field(default_factory=dict)


def linear_weights(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The 2-D float weights of the model's plain ``nn.Linear`` modules (each parameter once:
    a tied output head is also the input embedding). Subclasses (quantized layers) are left
    alone."""
    seen, weights = set(), []
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if type(module) is torch.nn.Linear and weight is not None and id(weight) not in seen:
            if weight.dim() == 2 and weight.dtype in _FLOATS:
                seen.add(id(weight))
                weights.append(weight)
    return weights


def _on_cpu(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """:func:`linear_weights` held in CPU memory (not on an accelerator, not offloaded to meta)."""
    return [w for w in linear_weights(model) if w.device.type == "cpu"]


def _nothing_on_cpu(model: torch.nn.Module) -> LayoutChoice:
    """The choice where no linear weight is in CPU memory: nothing done, and why."""
    return LayoutChoice("as_loaded", "not on the CPU" if linear_weights(model) else "no linear weights")


def set_layout(weights: list[torch.nn.Parameter], layout: Layout) -> None:
    """Store each of ``weights`` in ``layout`` in place (same values, same parameter objects)."""
    with torch.no_grad():
        for weight in weights:
            data = weight.data
            if layout == "transposed" and not data.t().is_contiguous():
                weight.data = data.t().contiguous().t()
            elif layout == "as_loaded" and not data.is_contiguous():
                weight.data = data.contiguous()


def _layout_of(weights: list[torch.nn.Parameter]) -> Layout:
    """The layout ``weights`` lie in: transposed where every weight whose two orders differ
    (not a ``[1, n]`` or ``[n, 1]`` one, contiguous both ways) is stored ``[in, out]``."""
    telling = [w.data for w in weights if not (w.data.is_contiguous() and w.data.t().is_contiguous())]
    transposed = bool(telling) and all(w.t().is_contiguous() and not w.is_contiguous() for w in telling)
    return "transposed" if transposed else "as_loaded"


def _probe_seconds(model: torch.nn.Module, repeats: int = 3) -> float:
    """Median seconds of a forward of 1 id and of one of 5 ids, summed: a decode step's and a
    drafted step's shapes (each on an empty cache: their cost is the weights', which a short
    cache hardly changes, and no cache has to be cut back, which a sliding window cannot).
    A shape whose warm-up forward took over :data:`SLOW_FORWARD_S` is timed once."""
    device = hf.input_device(model)
    vocab = model.get_input_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)

    def seconds(ids: torch.Tensor) -> float:
        started = time.perf_counter()
        hf.run_forward(model, ids, hf.new_cache(model), last_logits_only=False)
        return time.perf_counter() - started

    total = 0.0
    with torch.inference_mode():
        for q in (1, 5):
            ids = torch.randint(0, vocab, (1, q), generator=generator).to(device)
            warm = seconds(ids)  # warms the kernels for this shape
            total += statistics.median(seconds(ids) for _ in range(repeats if warm <= SLOW_FORWARD_S else 1))
    return total


def host_cpu() -> str:
    """The CPU's model name (Linux: ``/proc/cpuinfo``, else what ``platform`` says) and the
    vector instructions torch's kernels use on it (``AVX2``, ``AVX512``): one model name can
    cover hosts whose kernels differ twofold in speed."""
    name = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    return f"{name}, {torch.backends.cpu.get_cpu_capability()}"


def layout_key(weights: list[torch.nn.Parameter]) -> dict:
    """What a layout's timing depends on: the CPU (:func:`host_cpu`), torch's version and thread
    count, and each of ``weights``' shape and dtype (not their values)."""
    shapes = sorted({(tuple(w.shape), str(w.dtype).removeprefix("torch.")) for w in weights})
    return {"cpu": host_cpu(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "weights": [[list(shape), dtype] for shape, dtype in shapes]}


def _layout_file(folder: Path, key: dict) -> Path:
    return folder / f"layout-{hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]}.json"


def _remembered(folder: Optional[Path], key: dict, margin: float) -> Optional[LayoutChoice]:
    """The choice an earlier process measured for ``key`` in ``folder`` (None: none readable),
    decided again from its seconds under ``margin`` where the file holds both layouts' seconds
    (a file written under another margin is read under this one)."""
    if folder is None:
        return None
    path = _layout_file(folder, key)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as error:  # RecursionError: JSON nested past the parser's depth
        logger.warning("remembered weight layout %s unreadable (%s): measuring again", path, error)
        return None
    if (not isinstance(data, dict) or data.get("format") != FORMAT or data.get("key") != key
            or data.get("layout") not in ("as_loaded", "transposed")):
        return None
    seconds = data.get("seconds") if isinstance(data.get("seconds"), dict) else {}
    timed = [seconds.get(layout) for layout in ("as_loaded", "transposed")]
    if all(isinstance(s, (int, float)) and math.isfinite(s) and s > 0 for s in timed):
        return LayoutChoice(_faster(*timed, margin), "remembered", seconds)
    return LayoutChoice(data["layout"], "remembered", seconds)


def _remember(folder: Optional[Path], key: dict, choice: LayoutChoice) -> None:
    """Write ``choice`` for ``key`` into ``folder`` atomically (a folder that cannot be written:
    said, then the next process measures again)."""
    if folder is None:
        return
    path = _layout_file(folder, key)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")  # per writer: an atomic replace
    data = {"format": FORMAT, "key": key, "layout": choice.layout, "seconds": choice.seconds}
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except OSError as error:
        logger.warning("cannot remember the weight layout in %s (%s): the next process measures again", folder, error)
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def choose_layout(model: torch.nn.Module, setting: str, margin: float = 0.95,
                  probe: Optional[Callable[[torch.nn.Module], float]] = None,
                  folder: Optional[os.PathLike | str] = None) -> LayoutChoice:
    """Lay out ``model``'s linear weights as ``setting`` says and return the choice.

    Args:
        model: the engine's model (its weights are changed in place where a layout is chosen).
        setting: ``"measured"`` (time both on the CPU, keep the transposed layout where it took
            at most ``margin`` times as long), ``"transposed"`` (CPU weights transposed,
            unmeasured) or ``"keep"`` (touch nothing: the layout the model has, which another
            engine on it may have chosen). An earlier choice on the same model is kept.
        margin: how much faster the transposed layout must be to be kept (the probe's ratio
            moved by about 0.02 between repeats on this machine; it read 0.80-0.92 across
            sessions, so a margin of 0.9 flipped the choice from one process to the next).
        probe: seconds a layout takes (:func:`_probe_seconds` by default; a seam for tests).
        folder: where measured choices are remembered across processes (None: nowhere); a
            ``"measured"`` setting reads the choice there before it measures, and writes what it
            measured.
    """
    weights = _on_cpu(model)
    if not weights:
        return _nothing_on_cpu(model)
    chosen = getattr(model, _CHOSEN, None)
    if chosen is not None:
        return LayoutChoice(chosen.layout, "chosen before", chosen.seconds)
    if setting == "keep":
        return LayoutChoice(_layout_of(weights), "set")
    with values_kept(model):
        if setting == "transposed":
            set_layout(weights, "transposed")
            choice = LayoutChoice("transposed", "set")
        else:
            folder = None if folder is None else Path(folder)
            key = layout_key(weights)
            choice = _remembered(folder, key, margin) or _measure(model, weights, margin, probe or _probe_seconds)
            set_layout(weights, choice.layout)
            if choice.reason == "measured":
                _remember(folder, key, choice)
    object.__setattr__(model, _CHOSEN, choice)  # a plain attribute, not a module or parameter
    return choice


def _measure(model: torch.nn.Module, weights: list[torch.nn.Parameter], margin: float,
             probe: Callable[[torch.nn.Module], float]) -> LayoutChoice:
    """Time ``probe`` with ``weights`` as loaded and transposed, in turns (as loaded, transposed,
    transposed, as loaded), each layout's faster turn kept: a burst of load from another process
    during one turn does not decide the layout a host remembers. The transposed layout where it
    took at most ``margin`` times as long."""
    turns: dict[str, list[float]] = {"as_loaded": [], "transposed": []}
    for layout in PROBE_TURNS:
        set_layout(weights, layout)
        turns[layout].append(probe(model))
    seconds = {layout: min(times) for layout, times in turns.items()}
    return LayoutChoice(_faster(seconds["as_loaded"], seconds["transposed"], margin), "measured", seconds)


def _faster(as_loaded: float, transposed: float, margin: float) -> Layout:
    """The transposed layout where it took at most ``margin`` times as long as the loaded one."""
    return "transposed" if transposed <= margin * as_loaded else "as_loaded"


def pin_layout(model: torch.nn.Module, layout: Layout) -> LayoutChoice:
    """Lay out ``model``'s CPU linear weights in ``layout`` and remember it as chosen, so every
    engine built on the model keeps it (a benchmark comparing layouts; unmeasured)."""
    weights = _on_cpu(model)
    if not weights:
        return _nothing_on_cpu(model)
    with values_kept(model):
        set_layout(weights, layout)
    choice = LayoutChoice(layout, "set")
    object.__setattr__(model, _CHOSEN, choice)
    return choice


def weights_as_loaded(model: torch.nn.Module) -> None:
    """Lay ``model``'s linear weights out as loaded again and forget the choice (the next
    engine built on it measures again). Call it before ``model.save_pretrained``: transformers
    checks tied weights through a flat view, which a transposed tied weight does not have.
    Weights moved off the CPU after the choice are restored too (``Tensor.to`` keeps a dense
    tensor's strides, so a transposed weight stays transposed on the GPU)."""
    with values_kept(model):
        set_layout([w for w in linear_weights(model) if w.device.type != "meta"], "as_loaded")
    model.__dict__.pop(_CHOSEN, None)
