"""Default byte budgets sized from the memory the device has free when the engine starts.

The rule (documented in ``docs/api.md``): the segment store may take 20% and the anchor pools
10% of the memory available on the model's device at engine construction (CUDA: free device
memory; CPU: the kernel's ``MemAvailable``), never less than 64 MiB each; where the available
memory cannot be read, 2 GiB and 1 GiB. Set ``store_max_bytes`` / ``anchor_max_bytes`` to fix them.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["available_bytes", "default_budgets", "STORE_SHARE", "ANCHOR_SHARE"]

STORE_SHARE, ANCHOR_SHARE = 0.20, 0.10
FALLBACK = (2 * 1024**3, 1024**3)
FLOOR = 64 * 1024**2


def available_bytes(device: torch.device) -> Optional[int]:
    """Bytes free for new allocations on ``device`` now, or None if it cannot be read."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as handle:
                for line in handle:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


def default_budgets(device: torch.device) -> tuple[int, int]:
    """``(store_bytes, anchor_bytes)`` by the rule above."""
    free = available_bytes(device)
    if free is None:
        return FALLBACK
    return max(FLOOR, int(STORE_SHARE * free)), max(FLOOR, int(ANCHOR_SHARE * free))
