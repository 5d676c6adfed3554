"""The vLLM connector's reuse policy, measured without vLLM: ``python -m benchmarks.broker_fidelity``.

The connector's decisions are the broker's (:class:`kvcomm_agents.paged.broker.KVCommBroker`), and
:class:`kvcomm_agents.testing.PrefixOnlyRuntime` runs the broker on transformers exactly as vLLM
runs a claim (load positions ``0 .. claim``, compute the rest); ``tests_vllm`` checks that the
connector on vLLM's CPU build matches it. This runs workload (b) (the GSM8K debate of
``benchmarks.vllm_serving``) through it, greedy, and measures per downstream call the
first-token KL against a dense prefill of the same ids and the share of prompt tokens claimed,
for the connector's default settings and for ``kl_budget=None``. Minutes on a CPU, no vLLM.

    python -m benchmarks.broker_fidelity --graphs 8 --warmup 3 --out benchmarks/out/broker

Prints a table and writes ``broker_fidelity.json`` (every call, with its decisions).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

AGENTS = 4
SETTINGS = {"default": {}, "unaudited": {"kl_budget": None}}


def run(name: str, model, tokenizer, graphs: int, reply_tokens: int) -> list[dict]:
    from benchmarks.workloads import gsm8k_debate
    from kvcomm_agents.fidelity import first_token_kl
    from kvcomm_agents.testing import PrefixOnlyRuntime

    runtime = PrefixOnlyRuntime(model, tokenizer, **SETTINGS[name])
    records = []
    for graph, request in enumerate(gsm8k_debate(requests=graphs, split="dev", agents=AGENTS).requests):
        replies: list[str] = []
        for k, agent in enumerate(request.agents):
            ids = runtime.ids(request.messages(k, replies))
            logits, out, report, _, _ = runtime.run(ids, agent, new_tokens=reply_tokens)
            records.append({
                "settings": name, "graph": graph, "agent_index": k + 1, "prompt_tokens": len(ids),
                "reused_tokens": report.get("reused_tokens", 0), "prefix_tokens": report.get("prefix_tokens", 0),
                "kl": float(first_token_kl(runtime.dense_logits(ids), logits)),
                "decisions": [{key: d.get(key) for key in ("found_by", "span", "status", "reason")}
                              | {"offsets": (d.get("gate") or {}).get("offsets")} for d in report.get("decisions", [])],
            })
            replies.append(tokenizer.decode(out, skip_special_tokens=True))
    return records


def summarize(records: list[dict], warmup: int) -> dict:
    table = {}
    for name in SETTINGS:
        calls = [r for r in records if r["settings"] == name and r["graph"] >= warmup and r["agent_index"] > 1]
        if calls:
            table[name] = {"calls": len(calls), "mean_kl": sum(r["kl"] for r in calls) / len(calls),
                           "max_kl": max(r["kl"] for r in calls),
                           "token_share": sum(r["reused_tokens"] for r in calls) / sum(r["prompt_tokens"] for r in calls)}
    return table


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--graphs", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3, help="graphs not measured (the broker warms up)")
    parser.add_argument("--reply-tokens", type=int, default=48)
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--out", default="benchmarks/out/broker")
    args = parser.parse_args(argv)

    from kvcomm_agents import KVCommEngine

    loaded = KVCommEngine.from_pretrained(dtype=torch.float32)
    started = time.perf_counter()
    records = []
    for name in args.settings.split(","):
        records += run(name, loaded.model, loaded.tokenizer, args.graphs, args.reply_tokens)
    table = summarize(records, args.warmup)
    print(f"workload (b) through the broker's reference runtime, {args.graphs} graphs ({args.warmup} warm-up), "
          f"agents after the first, replies <= {args.reply_tokens} tokens")
    print(f"{'settings':<12} {'calls':>5} {'mean KL':>9} {'max KL':>8} {'tokens':>7}")
    for name, row in table.items():
        print(f"{name:<12} {row['calls']:>5} {row['mean_kl']:>9.4f} {row['max_kl']:>8.4f} {row['token_share']:>7.0%}")
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "broker_fidelity.json").write_text(json.dumps(
        {"args": vars(args), "elapsed_s": time.perf_counter() - started, "summary": table, "records": records}))
    print(f"written {folder / 'broker_fidelity.json'}")


if __name__ == "__main__":
    main()
