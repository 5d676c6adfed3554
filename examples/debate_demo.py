"""Debate demo: N fully connected solver agents on GSM8K, with and without KV reuse.

For each question, solvers 1..N answer in turn; solver k sees its own system prompt, the
question, and every earlier solver's reply pasted verbatim ("Solver j answered:\n..."). Each
call runs twice on the same messages: on the reuse engine (the reply is kept and fed to later
solvers) and on a dense baseline engine on its own copy of the same weights, as loaded, with its
own empty store (8 tokens only, for its time to first token and its first 8 token ids).

The table shows, per solver position (mean over questions): prompt size, the share of the prompt
served from the KV store, time to first token with reuse and dense, the speed-up, whether the
first 8 greedy tokens agree with dense, and what the engine decided for each shared segment.
Below it: the share of prompt tokens served from cache and the agent-level reuse rate (KVCOMM's
metric: calls in which no shared segment was computed; short texts are computed on purpose, so
it can be low while most tokens come from cache), over all questions and after the warm-up.

Run from the repository root:
    python -m examples.debate_demo [--questions 5] [--agents 4] [--max-new-tokens 64] [--warmup 2]
                                   [--method kvcomm|rerotate|exact_prefix] [--own-text in_context|reuse]
                                   [--data ../shared/data/gsm8k-dev.jsonl] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

import torch

from .tasks import DEFAULT_GSM8K, debate_messages, gold_answer, gsm8k_questions, last_number
from kvcomm_agents import KVCommConfig, KVCommEngine, ReuseSummary

COMPARE = 8  # first generated token ids compared with dense


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    defaults = KVCommConfig()
    p.add_argument("--questions", type=int, default=5)
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--warmup", type=int, default=2, help="questions that fill the anchor pools (reported apart)")
    p.add_argument("--method", choices=["kvcomm", "rerotate", "exact_prefix"], default=defaults.method)
    p.add_argument("--own-text", choices=["in_context", "reuse"], default=defaults.experimental.own_text,
                   help="experimental: reuse the solvers' own text around shared segments")
    p.add_argument("--data", type=Path, default=DEFAULT_GSM8K, help="GSM8K jsonl (default: %(default)s)")
    p.add_argument("--json", type=Path, default=None, help="write per-call results here")
    args = p.parse_args(argv)
    if min(args.questions, args.agents, args.max_new_tokens) < 1:
        p.error("--questions, --agents and --max-new-tokens must be at least 1")
    return args


def load_questions(path: Path, n: int) -> tuple[list[dict], str]:
    source = str(path) if path.is_file() else f"built-in questions ({path} not found)"
    return gsm8k_questions(n, path), source


def same_number(a: str | None, b: str | None) -> bool:
    try:
        return a is not None and b is not None and float(a) == float(b)
    except ValueError:
        return False


def first_tokens_agree(reuse_ids: list[int], dense_ids: list[int]) -> bool:
    """token_ids include the eos id, so a reply that stopped early only matches a dense run that
    stopped at the same place; comparing up to the shorter list is therefore enough."""
    n = min(COMPARE, len(reuse_ids), len(dense_ids))
    return reuse_ids[:n] == dense_ids[:n]


def run_agent(reuse: KVCommEngine, dense: KVCommEngine, k: int, messages: list[dict], max_new: int):
    name = f"solver-{k}"
    r = reuse.chat(messages, agent=name, max_new_tokens=max_new, temperature=0.0)
    d = dense.chat(messages, agent=name, max_new_tokens=COMPARE, temperature=0.0)
    s = r.stats
    record = {
        "stats": s,
        "agent": k, "prompt_tokens": s.prompt_tokens, "reused_tokens": s.reused_tokens,
        "prefix_tokens": s.prefix_tokens, "reused_share": s.reused_share, "mode": s.mode,
        "dense_reason": s.dense_reason, "ttft_reuse_s": s.ttft_s, "ttft_dense_s": d.stats.ttft_s,
        "speedup": d.stats.ttft_s / s.ttft_s,
        "first8_agree": first_tokens_agree(r.token_ids, d.token_ids),
        "decisions": [{"segment_id": x.segment_id, "span": list(x.span), "status": x.status,
                       "reason": x.reason, "reused_tokens": x.reused_tokens} for x in s.decisions],
        "reply": r.text, "finish_reason": r.finish_reason,
    }
    return r.text, record


def summarize_decisions(records: list[dict]) -> str:
    """Segment decisions over all questions, e.g. '6x reused:content'; exact-prefix hits too."""
    counts = Counter((x["status"], x["reason"]) for rec in records for x in rec["decisions"])
    parts = [f"{n}x {status}:{reason}" for (status, reason), n in sorted(counts.items())]
    prefix = sum(rec["prefix_tokens"] > 0 for rec in records)
    return ", ".join(parts + ([f"{prefix}x exact prefix"] if prefix else [])) or "-"


def print_reuse(records: list[dict], warmup: int) -> None:
    """The agent-level reuse rate and token share of solvers 2..N, overall and after warm-up."""
    def line(label: str, rows: list[dict]) -> None:
        summary = ReuseSummary.of(r["stats"] for r in rows if r["agent"] > 1)
        rate = "-" if summary.reuse_rate is None else f"{100 * summary.reuse_rate:.0f}%"
        print(f"  {label:<26} prompt tokens from cache {100 * summary.token_share:>3.0f}%, "
              f"reuse rate {rate:>4} ({summary.fully_reused}/{summary.eligible} calls)")
    print("\nReuse, solvers 2..N (reuse rate: calls that computed none of their shared text; short texts, and "
          "replies with no version computed for this reader, are computed on purpose, so it can read 0% while "
          "most tokens come from cache):")
    line("all questions", records)
    late = [r for r in records if r["question"] > warmup]
    if late:
        line(f"after warm-up (q > {warmup})", late)
    anchors = records[-1]["stats"].anchor_bytes
    if anchors:
        print(f"  anchor pools hold {anchors / 2**20:.0f} MiB")


def print_table(records: list[dict], n_agents: int) -> None:
    head = ("agent", "prompt tok", "reused %", "TTFT reuse ms", "TTFT dense ms", "speed-up", "first-8",
            "decisions (all questions)")
    print("\n" + "  ".join(f"{h:>{w}}" for h, w in zip(head, (5, 10, 8, 13, 13, 8, 7, 0))))
    for k in range(1, n_agents + 1):
        rows = [r for r in records if r["agent"] == k]
        mean = lambda key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
        agree = sum(r["first8_agree"] for r in rows)
        reuse_ms, dense_ms = 1000 * mean("ttft_reuse_s"), 1000 * mean("ttft_dense_s")
        print(f"{k:>5}  {mean('prompt_tokens'):>10.0f}  {100 * mean('reused_share'):>8.1f}  "
              f"{reuse_ms:>13.1f}  {dense_ms:>13.1f}  {dense_ms / reuse_ms:>7.2f}x  "
              f"{agree:>3}/{len(rows):<3}  {summarize_decisions(rows)}")
    print("(means over questions; speed-up = mean TTFT dense / mean TTFT reuse; --json has each call)")


NOTE = """
Notes. Solver 1 has nothing upstream to reuse: at most the exact prefix of its prompt (its own
system prompt, left by the previous question) comes from the store; on the first question it runs
dense. Later solvers reuse the question and the earlier solvers' replies, found verbatim inside
their messages. Reuse shortens the prefill (time to first token), not decoding, which dominates
the wall time here. Speed-ups are bounded: a 135M model on a couple of CPU cores with prompts of a
few hundred tokens, where the computed remainder, re-rotation and cache assembly still cost time,
and CPU timings are noisy (other busy processes distort them; rerun on an idle machine). Reused
keys are re-rotated to their new positions exactly; with --method kvcomm (the default) the context they
were computed in is corrected by KVCOMM's anchor offsets, and a segment the anchor gate judges new
is prefilled (reason new_anchor) and recorded, so the first questions are a warm-up. Reuse
outputs only approximately match dense ones: 'first-8' counts the calls whose first 8 greedy
token ids equal dense's (docs/fidelity.md measures the drift properly)."""


def print_answers(answers: list[tuple[int, str | None, str | None]]) -> None:
    print("\nFinal answer of the last solver vs gold:")
    for qi, got, gold in answers:
        print(f"  question {qi}: answered {got if got is not None else '(no number)'}, gold {gold}"
              f"  {'correct' if same_number(got, gold) else 'wrong'}")
    right = sum(same_number(g, t) for _, g, t in answers)
    print(f"  {right}/{len(answers)} correct. SmolLM2-135M is a tiny model: expect low GSM8K accuracy;"
          " the demo is about KV reuse, not math.")


def describe_device(engine: KVCommEngine) -> str:
    device = engine.model.device
    if device.type != "cpu":
        return str(device)
    return f"{device} ({torch.get_num_threads()} threads, linear weights {engine.weight_layout.layout})"


def warm_up(*engines: KVCommEngine) -> None:
    """One tiny call per engine, so first-call overheads do not land on solver 1; then empty the
    stores so the demo starts with nothing cached."""
    for engine in engines:
        engine.chat([{"role": "user", "content": "Say hi."}], agent="warm-up", max_new_tokens=2)
        engine.store.clear()
        engine.anchors.clear()
        engine.own_texts.clear()


def main(argv=None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    questions, source = load_questions(args.data, args.questions)
    print("Loading the embedded SmolLM2-135M-Instruct (first run converts it, ~40 s) ...")
    config = KVCommConfig(method=args.method, experimental={"own_text": args.own_text})
    reuse = KVCommEngine.from_pretrained(config=config)
    dense = KVCommEngine.from_pretrained(config=KVCommConfig.plain_transformers())  # weights as loaded
    warm_up(reuse, dense)
    print(f"{len(questions)} question(s) from {source}, {args.agents} solvers, greedy, "
          f"max {args.max_new_tokens} new tokens, on {describe_device(reuse)}; "
          f"method={config.method}, own_text={config.experimental.own_text}")
    records, answers = [], []
    for qi, row in enumerate(questions, start=1):
        replies = []
        for k in range(1, args.agents + 1):
            messages = debate_messages(k, args.agents, row["question"], replies)
            reply, record = run_agent(reuse, dense, k, messages, args.max_new_tokens)
            records.append({"question": qi, **record})
            replies.append(reply)
        gold = gold_answer(row)
        answers.append((qi, last_number(replies[-1]), gold))
        shares = " ".join(f"{100 * r['reused_share']:.0f}%" for r in records[-args.agents:])
        print(f"  question {qi}/{len(questions)} done; reused share per solver: {shares}")
    print_table(records, args.agents)
    print_reuse(records, args.warmup)
    print(NOTE)
    print_answers(answers)
    if args.json:
        args.json.write_text(json.dumps([{**r, "stats": r["stats"].model_dump()} for r in records], indent=2))
        print(f"\nPer-call results written to {args.json}")
    print(f"\nTotal wall time {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
