"""Fidelity of KV reuse against dense prefill on a 4-solver GSM8K debate (embedded model).

Protocol (identical ids for every strategy):
1. Dense, on its own engine, answers every question: solver k sees the question and the dense
   replies of solvers 1..k-1. Its replies, first-token logits and ids are the reference.
2. Each strategy runs on a fresh engine over the same questions in order, learning only from its
   own calls. Each solver call gets dense's reply forced (``force_reply_ids``), so the upstream
   KV it reuses is what this engine would have made for that reply and only the KV approximation
   differs. The call reports its first-token logits (-> KL against dense) and how many leading
   reply tokens greedy decoding would also have produced (-> 32-token agreement, exactly, by
   teacher forcing).
3. The noise floor: dense in bf16 against dense in fp32, same protocol.

    python -m benchmarks.fidelity_gsm8k --questions 40 [--reply-tokens 48] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kvcomm_agents import KVCommConfig, KVCommEngine
from kvcomm_agents.fidelity import first_token_kl, mean

from .workloads import debate_messages, gsm8k_questions

AGREE_K = 32


def dense_references(engine: KVCommEngine, questions: list[dict], agents: int, reply_tokens: int) -> list[list[dict]]:
    """Per question, per solver: dense reply ids, text and first-token logits."""
    refs = []
    for qi, row in enumerate(questions):
        replies, calls = [], []
        for k in range(1, agents + 1):
            result = engine.chat(debate_messages(k, agents, row["question"], replies), agent=f"solver-{k}",
                                 max_new_tokens=reply_tokens, return_logits=True)
            calls.append({"ids": result.token_ids, "text": result.text, "logits": result.first_token_logits})
            replies.append(result.text)
        refs.append(calls)
        print(f"  dense reference {qi + 1}/{len(questions)}", flush=True)
    return refs


def agreement_window(ids: list[int], eos_ids) -> int:
    for i, token in enumerate(ids[:AGREE_K]):
        if token in eos_ids:
            return i + 1
    return min(AGREE_K, len(ids))


def evaluate(engine: KVCommEngine, questions, refs, agents: int) -> list[dict]:
    """Run one strategy with dense's replies forced; one record per solver call."""
    records = []
    for qi, row in enumerate(questions):
        replies = [call["text"] for call in refs[qi]]
        for k in range(1, agents + 1):
            ref = refs[qi][k - 1]
            messages = debate_messages(k, agents, row["question"], replies[: k - 1])
            result = engine.chat(messages, agent=f"solver-{k}", force_reply_ids=ref["ids"], return_logits=True)
            s = result.stats
            found = [d for d in s.decisions if d.reason != "exact_prefix"]
            records.append({
                "question": qi, "agent": k, "kl": first_token_kl(ref["logits"], result.first_token_logits),
                "agree": result.forced_greedy_tokens >= agreement_window(ref["ids"], engine.info.eos_ids),
                "prompt_tokens": s.prompt_tokens, "reused_tokens": s.reused_tokens,
                "segments_found": len(found), "segments_prefilled": sum(d.status == "prefilled" for d in found),
                "prefilled_reasons": [d.reason for d in found if d.status == "prefilled"],
                "ttft_s": s.ttft_s, "align_s": s.align_s,
            })
    return records


def summarize(name: str, records: list[dict]) -> dict:
    downstream = [r for r in records if r["agent"] > 1]
    eligible = [r for r in downstream if r["segments_found"]]
    return {
        "strategy": name, "calls": len(downstream),
        "kl_mean": mean(r["kl"] for r in downstream),
        "agree_32": mean(float(r["agree"]) for r in downstream),
        "reuse_rate": mean(float(r["segments_prefilled"] == 0) for r in eligible),
        "token_share": sum(r["reused_tokens"] for r in downstream) / max(1, sum(r["prompt_tokens"] for r in downstream)),
        "agent1_kl_mean": mean(r["kl"] for r in records if r["agent"] == 1),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--questions", type=int, default=40)
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--reply-tokens", type=int, default=48)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/fidelity_gsm8k.json"))
    args = parser.parse_args(argv)
    started = time.perf_counter()
    questions = gsm8k_questions(args.questions)
    base = KVCommEngine.from_pretrained(device="cpu", config=KVCommConfig(reuse=False))
    model, tokenizer = base.model, base.tokenizer
    print(f"{len(questions)} questions x {args.agents} solvers, replies <= {args.reply_tokens} tokens, fp32 CPU")
    refs = dense_references(base, questions, args.agents, args.reply_tokens)
    strategies = {
        "rerotate-only": lambda: KVCommEngine(model, tokenizer),
        "kvcomm-mean (min_anchors=2)": lambda: KVCommEngine(model, tokenizer, config=KVCommConfig(offsets="mean")),
    }
    summaries, all_records = [], {}
    for name, make in strategies.items():
        all_records[name] = evaluate(make(), questions, refs, args.agents)
        summaries.append(summarize(name, all_records[name]))
        print(f"  {name} done", flush=True)
    bf16 = KVCommEngine(model.to(torch.bfloat16), tokenizer, config=KVCommConfig(reuse=False))
    all_records["noise-floor (dense bf16)"] = evaluate(bf16, questions, refs, args.agents)
    summaries.append(summarize("noise-floor (dense bf16)", all_records["noise-floor (dense bf16)"]))
    model.to(torch.float32)
    print(f"\n{'strategy':<28} {'calls':>5} {'KL mean':>8} {'32-agree':>8} {'reuse rate':>10} {'token share':>11}")
    for s in summaries:
        rate = "-" if s["reuse_rate"] is None else f"{100 * s['reuse_rate']:.0f}%"
        print(f"{s['strategy']:<28} {s['calls']:>5} {s['kl_mean']:>8.4f} {100 * s['agree_32']:>7.0f}% {rate:>10} {100 * s['token_share']:>10.0f}%")
    print("(solvers 2..N; KL = KL(dense || strategy) of the first token, nats; 32-agree = greedy runs equal to dense over 32 tokens)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "summary": summaries,
                                    "records": all_records}, indent=1))
    print(f"written {args.out}; {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
