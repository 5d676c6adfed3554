"""What framed copies cost the sender and save its readers: whole pipelines timed, with and without.

Copies of each reply (``reply_copies``) and of shared prompt text (``text_copies``), off in the
default and switched on here, are fed inside the sender's own decode steps
(``kvcomm_agents.framing.decode.FramedDecode``): a step computes more than one token. Where a
decode step costs the read of the weights (a GPU) that should be nearly free; on a CPU it is
not. The forced benchmark (``python -m benchmarks``) times the readers' first token and the
sender's work after its reply; this script times everything, per pipeline: two engines
(``framed``: both switches on, ``unframed``: both off) answer the same messages (the unframed engine's
replies feed both), call by call, the engine that goes first alternating. Per call: time to
first token, decode seconds per generated token (``total_s - ttft_s - framed_s`` over the
tokens after the first), the copies' work after the reply; per pipeline: the sum of its calls'
``total_s`` (prefill, decode and copies; its agents run one after another). Ratios are paired
by call or pipeline, medians reported. Warm-up requests (the first) are left out.

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

from . import workloads as W
from .models import load

ENGINES = ("framed", "unframed")


def pipelines(tokenizer, requests: int, tokens: int) -> dict[str, W.Workload]:
    """The workloads timed: text copies ((a) at the quick profile's size, (c) RAG, (d) HumanEval)
    and reply copies ((b) GSM8K debate)."""
    return {"a": W.paper_shape(tokenizer, requests=requests, agents=4, lead_tokens=128, input_tokens=256,
                               reply_tokens=tokens),
            "b": W.gsm8k_debate(requests=requests, reply_tokens=tokens),
            "c": W.rag_handoff(requests=requests, reply_tokens=tokens),
            "d": W.coding_pipeline(requests=requests, reply_tokens=tokens)}


def measure(model, tokenizer, workload: W.Workload, *, tokens: int) -> list[dict]:
    """One record per call after the first request: per engine, TTFT, decode s/token, copies'
    seconds after the reply, ``total_s`` and copies recorded."""
    from kvcomm_agents import KVCommConfig, KVCommEngine

    engines = {"framed": KVCommEngine(model, tokenizer, config=KVCommConfig(reply_copies=True, text_copies=True)),
               "unframed": KVCommEngine(model, tokenizer, config=KVCommConfig(reply_copies=False, text_copies=False))}
    records = []
    for r, request in enumerate(workload.requests):
        replies: list[str] = []
        for k, agent in enumerate(request.agents):
            messages = request.messages(k, replies)
            order = list(ENGINES) if (r + k) % 2 else list(ENGINES)[::-1]
            results = {name: engines[name].chat(messages, agent=agent, max_new_tokens=tokens) for name in order}
            replies.append(results["unframed"].text)
            if r == 0:
                continue
            row = {"request": r, "agent_index": k}
            for name, result in results.items():
                s = result.stats
                row[name] = {"tokens": len(result.token_ids), "copies": s.framed_versions, "ttft_s": s.ttft_s,
                             "total_s": s.total_s, "framed_s": s.framed_s,
                             "decode_s_per_token": (s.total_s - s.ttft_s - s.framed_s) / max(1, len(result.token_ids) - 1)}
            records.append(row)
    return records


def _median(values) -> float | None:
    values = list(values)
    return statistics.median(values) if values else None


def summary(records: list[dict]) -> dict:
    """Paired medians: decode ms/token of calls that fed copies, downstream TTFT speed-up,
    pipeline wall time."""
    fed = [r for r in records if r["framed"]["copies"] and min(r[n]["tokens"] for n in ENGINES) > 8]
    walls: dict[int, dict[str, float]] = {}
    for r in records:
        for name in ENGINES:
            walls.setdefault(r["request"], {}).setdefault(name, 0.0)
            walls[r["request"]][name] += r[name]["total_s"]
    downstream = [r for r in records if r["agent_index"] > 0]
    return {
        "calls": len(records), "calls_with_copies": len(fed),
        "unframed_decode_ms_per_token": _median(1000 * r["unframed"]["decode_s_per_token"] for r in fed),
        "framed_decode_ms_per_token": _median(1000 * r["framed"]["decode_s_per_token"] for r in fed),
        "decode_framed_over_unframed": _median(r["framed"]["decode_s_per_token"] / r["unframed"]["decode_s_per_token"]
                                                for r in fed),
        "downstream_ttft_unframed_over_framed": _median(r["unframed"]["ttft_s"] / r["framed"]["ttft_s"] for r in downstream),
        "pipelines": len(walls),
        "wall_unframed_s": _median(w["unframed"] for w in walls.values()),
        "wall_framed_s": _median(w["framed"] for w in walls.values()),
        "wall_unframed_over_framed": _median(w["unframed"] / w["framed"] for w in walls.values()),
    }


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--requests", type=int, default=4, help="per workload, the first a warm-up")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--workloads", default="a,b,c,d")
    parser.add_argument("--out", default="benchmarks/out/framed_decode")
    args = parser.parse_args(argv)
    loaded = load(args.model, device=args.device, dtype=getattr(torch, args.dtype))
    chosen = pipelines(loaded.tokenizer, args.requests, args.tokens)
    result = {"model": args.model, "device": args.device, "dtype": args.dtype, "tokens": args.tokens, "workloads": {}}
    print(f"{args.model} on {args.device} ({args.dtype}), replies <= {args.tokens} tokens, "
          f"{args.requests - 1} measured requests per workload after 1 warm-up")
    print(f"{'workload':<10}{'calls fed':>10}{'decode ms/tok':>22}{'decode x':>10}"
          f"{'downstream TTFT':>17}{'pipeline wall s':>20}{'wall':>8}")
    print(f"{'':<10}{'copies':>10}{'unframed / framed':>22}{'':>10}{'unframed/framed':>17}"
          f"{'unframed / framed':>20}{'gain':>8}")
    for name in args.workloads.split(","):
        records = measure(loaded.model, loaded.tokenizer, chosen[name], tokens=args.tokens)
        s = summary(records)
        result["workloads"][name] = {"title": chosen[name].title, "summary": s, "records": records}
        print(f"{name:<10}{s['calls_with_copies']:>10}"
              f"{_fmt(s['unframed_decode_ms_per_token'], '.1f') + ' / ' + _fmt(s['framed_decode_ms_per_token'], '.1f'):>22}"
              f"{_fmt(s['decode_framed_over_unframed'], '.2f'):>9}x"
              f"{_fmt(s['downstream_ttft_unframed_over_framed'], '.2f'):>16}x"
              f"{_fmt(s['wall_unframed_s'], '.2f') + ' / ' + _fmt(s['wall_framed_s'], '.2f'):>20}"
              f"{_fmt(s['wall_unframed_over_framed'], '.2f'):>7}x")
    print("decode x: the framed engine's decode time per token over the unframed engine's, calls whose sender "
          "fed copies; downstream TTFT: agents after the first, unframed TTFT / framed TTFT; wall gain: a "
          "pipeline's summed call time, unframed / framed (>1: copies end it sooner). Medians of paired ratios.")
    path = Path(args.out) / f"{args.model.replace(':', '-')}-{args.device}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"written {path}")
    return result


if __name__ == "__main__":
    main()
