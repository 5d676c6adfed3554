"""Which code produced a result: every results file names the commit it ran at."""

from __future__ import annotations

import subprocess
from pathlib import Path

__all__ = ["git_commit"]


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
