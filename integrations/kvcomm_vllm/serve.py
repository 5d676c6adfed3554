"""Start vLLM's OpenAI-compatible server with the KVCOMM connector: one command.

    python -m kvcomm_vllm.serve                      # the embedded SmolLM2-135M, port 8000
    python -m kvcomm_vllm.serve --model /path/to/hf-folder --port 8100 --kvcomm '{"method": "rerotate"}'
    python -m kvcomm_vllm.serve --port 8001 --shared-store redis://127.0.0.1:6379/0   # a fleet replica
    bash scripts/run.sh serve-vllm                   # the same, setting up .venv-vllm first

Everything after ``--`` goes to ``vllm serve`` as is. The settings the connector needs are
added: the connector's ``--kv-transfer-config``, ``--scheduling-policy priority`` (prefill-ahead copies after the requests waiting with them), ``--no-enable-prefix-caching`` (approximate KV
must never be hashed as exact blocks), ``--distributed-executor-backend uni`` and
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the worker in the scheduler's process), and on CPU
``--enforce-eager`` (torch.compile warm-up takes minutes on 2 cores) and a 2 GiB KV cache unless
``VLLM_CPU_KVCACHE_SPACE`` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from typing import Iterator, Optional, Sequence

from . import check_vllm_version, kv_transfer_config

__all__ = ["server_command", "start_server", "wait_until_serving", "stop_server", "local_server", "main"]


def server_command(model: str, *, host: str = "127.0.0.1", port: int = 8000, dtype: str = "float32",
                   max_model_len: int = 2048, kvcomm: Optional[dict] = None, eager: bool = True,
                   shared_store: Optional[str] = None, background_capture: bool = False,
                   extra: Sequence[str] = ()) -> list[str]:
    """The server's command line (without the environment; see :func:`main`)."""
    # vLLM's OpenAI server module, not the `vllm serve` CLI: the CLI reads the version of a
    # distribution named "vllm", which the CPU build (distribution "vllm-cpu") lacks, and fails
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--host", host, "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_model_len),
               "--kv-transfer-config", json.dumps(kv_transfer_config(kvcomm, shared_store,
                                                                         background_capture=background_capture)),
               "--no-enable-prefix-caching", "--distributed-executor-backend", "uni", "--max-logprobs", "-1",
               # prefill-ahead copies (kvcomm_vllm.text_ahead) go after the requests waiting with them
               "--scheduling-policy", "priority",
               # the client's ttft_s and a streamed answer's cache_read come from these
               "--enable-per-request-metrics", "--enable-prompt-tokens-details"]
    if eager:
        command.append("--enforce-eager")
    return command + list(extra)


def start_server(*args: str, port: Optional[int] = None, env: Optional[dict] = None,
                 die_with_parent: bool = False) -> tuple[subprocess.Popen, str]:
    """This module's server in a subprocess (``args``: this command's options) on ``port`` (a free
    local one by default), not waited for: :func:`wait_until_serving`. ``env``: added to this
    process's environment. ``die_with_parent``: on Linux the server is sent SIGTERM when this
    process dies (a Ray Serve replica killed outright must not leave its server behind).
    Returns ``(process, url)``; its stderr is a pipe (read on failure)."""
    if port is None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "kvcomm_vllm.serve", "--port", str(port), *args],
                               env=dict(os.environ, **(env or {})), stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True,
                               preexec_fn=_die_with_parent if die_with_parent else None)
    return process, f"http://127.0.0.1:{port}"


def wait_until_serving(process: subprocess.Popen, url: str, timeout_s: float = 600) -> None:
    """Return once the server at ``url`` answers ``/v1/models``. Raises ``RuntimeError`` if it
    exits (with the end of its stderr) or does not answer within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited ({process.returncode}): {process.stderr.read()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not answer within {timeout_s:.0f} s") from None
            time.sleep(2)


def stop_server(process: subprocess.Popen, timeout_s: float = 60) -> None:
    """SIGTERM (vLLM stops its engine), SIGKILL after ``timeout_s``."""
    process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent dies (Linux ``PR_SET_PDEATHSIG``; kept
    across exec). Elsewhere a no-op: the parent's own shutdown stops the server."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


@contextmanager
def local_server(*args: str, timeout_s: float = 600, kv_cache_gib: int = 1) -> Iterator[str]:
    """This module's server in a subprocess on a free local port (tests, benchmarks, a local
    fleet): ``args`` are this command's options (``"--shared-store", url``). Yields its URL once
    it answers; stopped on exit. Raises ``RuntimeError`` if it exits or does not answer in time."""
    process, url = start_server(*args, env={"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)})
    try:
        wait_until_serving(process, url, timeout_s)
        yield url
    finally:
        stop_server(process)


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(prog="python -m kvcomm_vllm.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a Hugging Face model folder (default: the embedded SmolLM2-135M)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kvcomm", default="{}", help="KVCommConfig fields as JSON, e.g. '{\"method\": \"rerotate\"}'")
    parser.add_argument("--shared-store", default=None,
                        help="a Redis URL: the segment tier shared with the fleet's other replicas")
    parser.add_argument("--compile", action="store_true", help="let vLLM torch.compile the model (slow start on CPU)")
    parser.add_argument("--background-capture", action="store_true",
                        help="keep finished requests' KV on a capture thread, off the scheduler's path "
                             "(a tie on a CPU; meant for a GPU, unmeasured there)")
    args = parser.parse_args(argv)
    check_vllm_version()
    model = args.model
    if model is None:
        from kvcomm_agents.paged import embedded_model_dir

        model = str(embedded_model_dir())
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    command = server_command(model, host=args.host, port=args.port, dtype=args.dtype,
                             max_model_len=args.max_model_len, kvcomm=json.loads(args.kvcomm),
                             eager=not args.compile, shared_store=args.shared_store,
                             background_capture=args.background_capture, extra=extra)
    print("starting:", " ".join(command[2:]), flush=True)
    os.execve(command[0], command, env)


if __name__ == "__main__":
    main()
