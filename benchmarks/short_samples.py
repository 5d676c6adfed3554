"""Can a short sample stand in for a re-rotation check? The whole check against the same
prompt with each long reused run cut to its first ``L`` ids.

A graph's first reader of a long shared text computes it (nothing measured yet) and then
measures what re-rotating it would have cost (:mod:`kvcomm_agents.rerotation_check`): a whole
dense prefill of the text. A short sample keeps the reader's prompt but cuts every reused run
longer than ``L`` to its first ``L`` ids (the text after the run follows at once), and takes the
same measure on that prompt: dense against re-rotated, on the same (cut) ids. If its KL bounds
the whole prompt's, the first reader can be served re-rotated after a sample costing ``L``-id
prompts instead of the whole text.

For each workload (development range), every reader call is replayed through a re-rotating
engine with the dense replies (the store then holds what a default engine would); before each,
the re-rotation check's plan is built on the whole prompt and on each cut prompt, and both are
prefilled dense and re-rotated. No timing is involved: KL and forwarded ids are deterministic.

    python -m benchmarks.short_samples [--phases a,c,d,h,j] [--requests 2] [--lengths 64,128,256]
                                       [--out benchmarks/out/short_samples.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional

import torch

from kvcomm_agents import KVCommConfig, KVCommEngine
from kvcomm_agents.alignment import assemble
from kvcomm_agents.engines import hf
from kvcomm_agents.fidelity import first_token_kl
from kvcomm_agents.planner import plan_call
from kvcomm_agents.prompt import PromptLayout, render_prompt
from kvcomm_agents.rerotation_check import cut_runs

from . import measure
from .models import load
from .workloads import (changing_graph, coding_pipeline, fan_out, long_document, paper_shape, prompt_formats,
                        rag_handoff, shared_history)

__all__ = ["measure_call"]


def dev_workloads(tokenizer, n: int) -> dict:
    """A research script: the development range only."""
    return {
        "a": lambda: paper_shape(tokenizer, requests=n, agents=5, lead_tokens=256, input_tokens=512, reply_tokens=32,
                                 split="dev"),
        "c": lambda: rag_handoff(requests=n, reply_tokens=32, split="dev"),
        "d": lambda: coding_pipeline(requests=n, reply_tokens=32, split="dev"),
        "f": lambda: shared_history(requests=n, reply_tokens=32, split="dev"),
        "g": lambda: changing_graph(requests=n, reply_tokens=32, split="dev"),
        "h": lambda: long_document(requests=n, reply_tokens=24, split="dev", tokenizer=tokenizer),
        "i": lambda: fan_out(requests=n, reply_tokens=32, split="dev"),
        "j": lambda: prompt_formats(requests=n, reply_tokens=32, split="dev"),
    }


def _pair(model, engine: KVCommEngine, config: KVCommConfig, layout: PromptLayout, agent: str) -> Optional[dict]:
    """Dense and re-rotated first-token logits of ``layout``: their KL and the ids each forwards."""
    plan = plan_call(layout, store=engine.store, fingerprint=engine.fingerprint, config=config, agent=agent)
    if not plan.runs:
        return None
    n = plan.num_prompt
    dense = hf.prefill(model, plan.prompt_ids, torch.arange(n)).logits
    reused = hf.prefill(model, plan.prompt_ids, plan.computed_positions(), assemble(plan, engine.info.rotator),
                        plan.reused_positions(), masked=True).logits
    return {"kl": first_token_kl(dense, reused), "ids": n, "computed": n - plan.reused_tokens,
            "runs": [r.length for r in plan.runs], "plan": plan}


def measure_call(model, engine: KVCommEngine, config: KVCommConfig, layout: PromptLayout, agent: str,
                 lengths: list[int]) -> Optional[dict]:
    """The whole check and one short sample per length, for one reader's prompt."""
    whole = _pair(model, engine, config, layout, agent)
    if whole is None:
        return None
    row = {k: v for k, v in whole.items() if k != "plan"}
    for length in lengths:
        cut = cut_runs(whole["plan"].prompt_ids, whole["plan"].runs, length)
        if cut is None:
            continue
        short = _pair(model, engine, config, PromptLayout.of_ids(cut), agent)
        if short is not None:
            row[f"short_{length}"] = {k: v for k, v in short.items() if k != "plan"}
    return row


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--phases", default="a,c,d,h,j")
    parser.add_argument("--requests", type=int, default=2)
    parser.add_argument("--lengths", default="64,128,256")
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/short_samples.json"))
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    loaded = load(args.model, device="cpu", dtype=torch.float32)
    model, tokenizer = loaded.model, loaded.tokenizer
    check = KVCommConfig().model_copy(update={"method": "rerotate", "dense_when_cheaper": False})
    rows = []
    for phase in args.phases.split(","):
        workload = dev_workloads(tokenizer, args.requests)[phase]()
        refs = measure.references(workload, model, tokenizer,
                                  args.out.parent / "refs" / f"{loaded.tag}-dev" / f"{workload.name}.pt")
        engine = KVCommEngine(model, tokenizer, config=KVCommConfig(method="rerotate"))
        with torch.inference_mode():
            for request in workload.requests:
                replies = refs[request.key]
                for k, agent in enumerate(request.agents):
                    messages = request.messages(k, [c["text"] for c in replies[:k]])
                    if k > 0:
                        row = measure_call(model, engine, check, render_prompt(tokenizer, messages), agent, lengths)
                        if row is not None:
                            row.update(phase=phase, request=request.key, agent=agent, k=k)
                            rows.append(row)
                            shorts = "  ".join(f"L={n}: {row[f'short_{n}']['kl']:.4f} ({row[f'short_{n}']['ids']} ids)"
                                               for n in lengths if f"short_{n}" in row)
                            print(f"({phase}) {request.key} {agent}: whole {row['kl']:.4f} ({row['ids']} ids, runs "
                                  f"{row['runs']})  {shorts}", flush=True)
                    engine.replay(messages, agent=agent, reply_ids=replies[k]["ids"])
    measure.write_json(rows, args.out)
    return rows


if __name__ == "__main__":
    main()
