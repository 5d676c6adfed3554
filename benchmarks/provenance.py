"""Which code produced a result: every results file names the commit it ran at."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

import torch

__all__ = ["git_commit", "versions", "device_text"]


def git_commit() -> str:
    """The checkout's commit, ``+changes`` where tracked files differ from it; ``unknown``
    outside a git checkout."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def versions(device: torch.device) -> dict:
    """The code and libraries a figure comes from: the commit (and whether the tree had
    uncommitted changes), Python, torch, transformers, the device."""
    import transformers

    info = {"commit": git_commit(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "device": str(device), "threads": torch.get_num_threads()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    if device.type == "cpu":
        from kvcomm_agents.engines.weight_layout import host_cpu

        info["cpu"] = host_cpu()
    return info


def device_text(info: dict) -> str:
    """A run line's device: ``cpu: AMD EPYC, AVX2 (2 threads)``; results written before the CPU
    was recorded read ``cpu (2 threads)``."""
    device = info.get("device", "cpu")
    host = f": {info['cpu']}" if info.get("cpu") else ""
    return f"{device}{host} ({info['threads']} threads)"
