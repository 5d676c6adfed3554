"""The vLLM benchmark's child processes (:mod:`benchmarks.vllm_serving`): each strategy's
engine lives in a process of its own, and in the ``ttft`` phase the strategies take turns graph
by graph, so that no two run at once and a drift of the machine's speed falls on all alike."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

__all__ = ["child_command", "child_env", "interleaved_ttft"]


def child_command(strategy: str, args, requests: int, mode: list[str]) -> list[str]:
    """The command line of a child process running ``strategy``."""
    python = args.hf_python if strategy == "hf" else sys.executable
    return [python, "-m", "benchmarks.vllm_serving", *mode, "--requests", str(requests), "--offset", str(args.offset),
            "--batch", str(args.batch), "--reply-tokens", str(args.reply_tokens), "--workload", args.workload,
            *(["--time-hooks"] if getattr(args, "time_hooks", False) else [])]


def child_env() -> dict:
    # vLLM drops to 1 torch thread "for serving" unless OMP_NUM_THREADS says otherwise;
    # the HF engine uses 2: both get the machine's 2 cores
    return dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))


def _line(child: subprocess.Popen, prefix: str, strategy: str, log: Path, handle) -> str:
    """The child's next stdout line starting with ``prefix``; other lines (vLLM's logs) go to
    ``handle``, the child's log file ``log``."""
    for line in child.stdout:
        if line.startswith(prefix):
            return line[len(prefix):]
        handle.write(line)
    raise SystemExit(f"{strategy} ended without '{prefix.strip()}' ({child.wait()}); see {log}")


def interleaved_ttft(strategies: list[str], args, out: Path, command=None) -> list[dict]:
    """The ``ttft`` phase with the strategies taking turns graph by graph: each strategy's engine
    loads in a child process of its own (``vllm_serving.serve``), then for every graph each child in turn
    runs it while the others wait on their stdin, the order rotated by one per graph. A drift of
    the machine's speed over the run then falls on every strategy alike: run one after another,
    two runs of the same strategies spread more than the effect on the whole graph. Every
    strategy's engine stays loaded meanwhile (vLLM's: ``VLLM_CPU_KVCACHE_SPACE`` GiB of KV
    each): where memory is short, ``--sequential``. ``command(strategy)``: a child's command
    line (``vllm_serving --serve``, by default)."""
    command = command or (lambda strategy: child_command(strategy, args, args.requests, ["--serve", strategy]))
    children, logs, handles = {}, {}, []
    try:
        for strategy in strategies:
            print(f"loading {strategy} ...", flush=True)
            logs[strategy] = out / f"ttft-{strategy}.log"
            handles.append(logs[strategy].open("w"))
            children[strategy] = subprocess.Popen(command(strategy), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                  stderr=handles[-1], text=True, env=child_env())
            _line(children[strategy], "READY", strategy, logs[strategy], handles[-1])  # one loads at a time
        records: dict[str, list] = {s: [] for s in strategies}
        for index in range(args.requests):
            turn = strategies[index % len(strategies):] + strategies[:index % len(strategies)]
            for strategy in turn:
                child, handle = children[strategy], handles[strategies.index(strategy)]
                try:
                    child.stdin.write(f"{index}\n")
                    child.stdin.flush()
                except OSError:  # it died between graphs
                    raise SystemExit(f"{strategy} ended before graph {index} ({child.wait()}); see {logs[strategy]}")
                records[strategy] += json.loads(_line(child, "RESULT ", strategy, logs[strategy], handle))
            walls = {s: next(r["wall_s"] for r in records[s] if r.get("graph") == index and "wall_s" in r)
                     for s in strategies}
            print(f"graph {index}: " + ", ".join(f"{s} {w:.1f} s" for s, w in walls.items()), flush=True)
    finally:
        for child in children.values():
            for pipe in (child.stdin, child.stdout):
                try:
                    pipe.close()
                except OSError:
                    pass
        for child in children.values():
            try:
                child.wait(timeout=60)
            except subprocess.TimeoutExpired:  # stuck: never let the benchmark hang on it
                child.kill()
                child.wait()
        for handle in handles:
            handle.close()
    return [{"strategy": s, "phase": "ttft", "records": records[s]} for s in strategies]
