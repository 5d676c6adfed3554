"""What framed copies cost the sender: decode time per token with and without them.

``experimental.framed_replies`` feeds each reply token once more per framing in the sender's
own decode steps (``kvcomm_agents.framing.FramedDecode``): a step computes ``1 + R`` tokens
instead of 1. Where a decode step costs the read of the weights (a GPU), that should be nearly
free; on a CPU it is not. This script measures it on GSM8K debates (4 solvers, greedy, the
same messages for both engines, strategies alternating first): per call, decode seconds per
generated token (``total_s - ttft_s - framed_s`` over the tokens after the first), paired by
call, for the calls whose sender fed copies; the readers' TTFT speed-up is the forced
benchmark's business (``python -m benchmarks --strategies ...,kvcomm-mean,kvcomm-unframed``).

    .venv/bin/python -m benchmarks.framed_decode                       # embedded model, CPU
    .venv/bin/python -m benchmarks.framed_decode --model random:llama-3.2-1b --device cuda --dtype bfloat16

Prints a table; writes ``benchmarks/out/framed_decode/<model>-<device>.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from examples.tasks import debate_messages

from .models import load

QUESTIONS = [
    "Tom has 3 apples and buys 5 more. He gives 2 to Ann. How many apples does Tom have now?",
    "A train travels 60 km per hour for 3 hours, then 40 km per hour for 2 hours. How far does it go?",
    "Sara reads 12 pages a day. How many pages does she read in 2 weeks?",
    "A shop sells pens at 2 dollars each. Mia buys 7 pens and pays with a 20 dollar bill. What change does she get?",
    "There are 24 students in a class. A third of them wear glasses. How many do not wear glasses?",
    "A baker makes 5 trays of 12 rolls and sells 38 of them. How many rolls are left?",
]


def measure(model, tokenizer, *, requests: int, tokens: int) -> list[dict]:
    """Per call of solvers 1-3 (their replies are read) after the first request: decode
    seconds per token with (``framed``) and without (``default``) framed copies."""
    from kvcomm_agents import KVCommConfig, KVCommEngine
    from kvcomm_agents.config import ExperimentalSettings

    engines = {"default": KVCommEngine(model, tokenizer, config=KVCommConfig()),
               "framed": KVCommEngine(model, tokenizer, config=KVCommConfig(
                   experimental=ExperimentalSettings(framed_replies=True)))}
    records = []
    for r in range(requests):
        question = QUESTIONS[r % len(QUESTIONS)]
        replies: list[str] = []  # the default engine's replies feed both: the same messages
        for k in range(1, 5):
            messages = debate_messages(k, 4, question, replies)
            order = list(engines) if (r + k) % 2 else list(engines)[::-1]
            results = {name: engines[name].chat(messages, agent=f"solver{k}", max_new_tokens=tokens) for name in order}
            replies.append(results["default"].text)
            if r == 0 or k == 4:
                continue
            row = {"request": r, "agent_index": k}
            for name, result in results.items():
                s = result.stats
                row[name] = {"tokens": len(result.token_ids), "copies": s.framed_versions,
                             "decode_s_per_token": (s.total_s - s.ttft_s - s.framed_s) / max(1, len(result.token_ids) - 1)}
            records.append(row)
    return records


def summary(records: list[dict]) -> dict:
    fed = [r for r in records if r["framed"]["copies"] and r["framed"]["tokens"] > 8 and r["default"]["tokens"] > 8]
    ratio = [r["framed"]["decode_s_per_token"] / r["default"]["decode_s_per_token"] for r in fed]
    return {"calls": len(records), "calls_with_copies": len(fed),
            "default_ms_per_token": 1000 * statistics.median(r["default"]["decode_s_per_token"] for r in fed) if fed else None,
            "framed_ms_per_token": 1000 * statistics.median(r["framed"]["decode_s_per_token"] for r in fed) if fed else None,
            "framed_over_default": statistics.median(ratio) if ratio else None}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", default="benchmarks/out/framed_decode")
    args = parser.parse_args(argv)
    loaded = load(args.model, device=args.device, dtype=getattr(torch, args.dtype))
    records = measure(loaded.model, loaded.tokenizer, requests=args.requests, tokens=args.tokens)
    result = {"model": args.model, "device": args.device, "dtype": args.dtype, "summary": summary(records),
              "records": records}
    s = result["summary"]
    print(f"{args.model} on {args.device} ({args.dtype}): {s['calls_with_copies']} sender calls with framed copies")
    if s["framed_ms_per_token"] is not None:
        print(f"  decode per token: {s['default_ms_per_token']:.1f} ms without copies, {s['framed_ms_per_token']:.1f} ms "
              f"with them ({s['framed_over_default']:.2f}x, median of paired calls)")
    path = Path(args.out) / f"{args.model.replace(':', '-')}-{args.device}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"written {path}")
    return result


if __name__ == "__main__":
    main()
