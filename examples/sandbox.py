"""Run model-written code isolated: ``python -I`` in a temporary directory, with a wall-clock
timeout and resource limits (CPU seconds, address space, file size, no core dumps), a minimal
environment and no inherited files.

This is a guard against accidents, not a security boundary: the code runs as your user, with
network access if the machine has any. Run untrusted code inside a container or VM.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["run_isolated"]

MEMORY_BYTES = 1 << 30
OUTPUT_CHARS = 800


def _limits(cpu_seconds: int) -> None:  # runs in the child before exec (POSIX only)
    import resource

    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds))
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run_isolated(source: str, *, timeout: float = 10.0) -> tuple[bool, str]:
    """Run ``source`` as a script; returns (exit status 0, the tail of stdout+stderr)."""
    with tempfile.TemporaryDirectory(prefix="kvcomm-sandbox-") as folder:
        script = Path(folder) / "candidate.py"
        script.write_text(source)
        try:
            done = subprocess.run(
                [sys.executable, "-I", str(script)], cwd=folder, capture_output=True, text=True,
                timeout=timeout, env={"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0"},
                preexec_fn=lambda: _limits(int(timeout) + 1), close_fds=True, stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            return False, f"timed out after {timeout:.0f} s"
        output = (done.stdout + done.stderr).strip()
        return done.returncode == 0, (output[-OUTPUT_CHARS:] or "(no output)")
