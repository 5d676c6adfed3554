"""Is a version computed after *nearly* the reader's context closer than the base? KL against
how many ids of context the version shares with the reader (issue 32's "nearest version").

The default reuses a recorded version of a segment only where its whole 64-id context window
matches the reader's prompt (:mod:`kvcomm_agents.versions.match`); elsewhere it takes the base
(the KV where the text was first computed) re-rotated, or computes the text. A version computed
after a different prefix may still be closer than the base when the last ids before the text
are the same: this script measures by how much, as a function of those ids.

For each workload (development range), every reader call is replayed through a re-rotating
engine with dense replies (the store then holds the base versions a default engine has). Each
shared run of at least ``--min-run`` ids the re-rotation plan finds (heads, tails and run rules
off: the occurrence as found) is served, alone, from:

- ``base``: the stored segment's KV (what re-rotation only takes), with the number of ids its
  recorded context shares with the reader's (``base_match``);
- ``k=N``: the same text computed after a *foreign* prefix (another request's first prompt of the
  same workload, its first 256 ids) followed by the reader's last ``N`` ids before the text: a
  version whose context matches the reader's over ``N`` ids and differs before them;
- ``short k=N``: the same with the foreign prefix cut to its first 8 ids (the chat template's
  opening): little unrelated text before the matching ids;
- ``exact``: computed after the reader's own ids before it (a check: within float error of 0).

Everything else in the reader's prompt is computed, so each KL is the one run's cost:
``KL(dense || reader with that run reused)`` on the first token, the run's first ``head`` ids
computed (0 and the default's 16; keyed ``"0"``, ``"16"`` in the JSON). No timing is involved.
``summarize`` prints, per version, the runs it was measured on against the base on the same runs.

    python -m benchmarks.nearest_version [--phases a,c,d,f,g,h,j] [--requests 2]
                                         [--out benchmarks/out/nearest_version.json]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from kvcomm_agents import KVCommConfig, KVCommEngine
from kvcomm_agents.engines import hf
from kvcomm_agents.fidelity import first_token_kl
from kvcomm_agents.kv.block import KVBlock
from kvcomm_agents.planner import plan_call
from kvcomm_agents.prompt import render_prompt
from kvcomm_agents.versions.match import common_suffix

from . import measure
from .models import load
from .short_samples import dev_workloads

__all__ = ["reader_kl", "version_kv"]

MATCHES = (0, 16, 64, 256)
HEADS = (0, 16)
FOREIGN = 256
SHORT_FOREIGN = 8


def version_kv(model, context: torch.Tensor, text: torch.Tensor) -> KVBlock:
    """KV of ``text`` (``[T]`` ids) computed right after ``context`` (``[C]`` ids), keys where
    they were computed (token ``i`` at position ``C + i``: :func:`reader_kl`'s ``frame`` is ``C``)."""
    ids = torch.cat([context, text])
    pre = hf.prefill(model, ids, torch.arange(ids.numel()))
    return hf.kv_at_positions(pre.cache, pre.slot_positions, torch.arange(context.numel(), ids.numel()))


def reader_kl(model, rotator, prompt: torch.Tensor, dense_logits: torch.Tensor, start: int, kv: KVBlock,
              frame: int, head: int) -> float:
    """First-token KL of ``prompt`` (``[N]``) with ``kv`` (``T`` tokens, token ``i`` at position
    ``frame + i``) reused at ``start + head .. start + T``, every other id computed."""
    length = kv.num_tokens
    reused_positions = torch.arange(start + head, start + length)
    block = kv.window(head, length).shifted(rotator, start - frame)
    keep = torch.ones(prompt.numel(), dtype=torch.bool)
    keep[reused_positions] = False
    pre = hf.prefill(model, prompt, keep.nonzero().flatten(), block, reused_positions, masked=True)
    return first_token_kl(dense_logits, pre.logits)


def _runs(engine: KVCommEngine, layout, agent: str, min_run: int):
    """The occurrences re-rotation only finds in ``layout``'s prompt, as found (no head, tail or
    run rule), of at least ``min_run`` ids."""
    config = KVCommConfig(method="rerotate", dense_when_cheaper=False, recompute_head=0, recompute_cut_head=0,
                          recompute_tail=0, recompute_last_run=0, recompute_short_runs=0)
    plan = plan_call(layout, store=engine.store, fingerprint=engine.fingerprint, config=config, agent=agent)
    return plan, [run for run in plan.runs if run.length >= min_run and not run.own_text]


def measure_reader(model, engine: KVCommEngine, layout, agent: str, foreign: torch.Tensor, min_run: int) -> list[dict]:
    """One row per shared run of ``layout``'s prompt: KL per version and head."""
    plan, runs = _runs(engine, layout, agent, min_run)
    if not runs:
        return []
    prompt, rotator = plan.prompt_ids, engine.info.rotator
    dense = hf.prefill(model, prompt, torch.arange(prompt.numel())).logits
    rows = []
    for run in runs:
        start, end = run.prompt_start, run.prompt_end
        before, text = prompt[:start], prompt[start:end]
        seg = run.segment
        base = seg.kv.window(run.segment_start, run.segment_start + run.length)
        base_context = list(seg.context_ids) + list(seg.token_ids[:run.segment_start])
        versions = {"base": (base, run.segment_start)}
        for k in MATCHES:
            for name, prefix in ((f"k={k}", foreign), (f"short k={k}", foreign[:SHORT_FOREIGN])):
                if k <= start:
                    context = torch.cat([prefix, before[start - k:]])
                    versions[name] = (version_kv(model, context, text), context.numel())
        versions["exact"] = (version_kv(model, before, text), start)
        kls = {name: {str(head): reader_kl(model, rotator, prompt, dense, start, kv, frame, head) for head in HEADS}
               for name, (kv, frame) in versions.items()}
        rows.append({"agent": agent, "start": start, "length": run.length, "kind": seg.ref.kind,
                     "base_match": common_suffix(base_context, before.tolist()), "kl": kls})
    return rows


def summarize(rows: list[dict]) -> None:
    """Print, per version and head, the median and mean KL over the runs it was measured on (a
    ``k`` longer than the ids before a run is not) and how often it is below the base's."""
    names = ("base", *[f"{p}k={k}" for p in ("", "short ") for k in MATCHES], "exact")
    print(f"{len(rows)} runs; base's context matches the reader's over a median "
          f"{statistics.median(r['base_match'] for r in rows):.0f} ids")
    for head in HEADS:
        print(f"\nhead {head}: version | runs | median KL | mean KL | base's mean on them | below base")
        for name in names:
            mine = [r for r in rows if name in r["kl"]]
            if not mine:
                continue
            kls, base = [r["kl"][name][str(head)] for r in mine], [r["kl"]["base"][str(head)] for r in mine]
            below = sum(a < b for a, b in zip(kls, base))
            print(f"  {name:>11} | {len(mine)} | {statistics.median(kls):.5f} | {statistics.fmean(kls):.5f} | "
                  f"{statistics.fmean(base):.5f} | {below}/{len(mine)}")


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--phases", default="a,c,d,f,g,h,j")
    parser.add_argument("--requests", type=int, default=2)
    parser.add_argument("--min-run", type=int, default=64)
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/nearest_version.json"))
    args = parser.parse_args(argv)
    loaded = load(args.model, device="cpu", dtype=torch.float32)
    model, tokenizer = loaded.model, loaded.tokenizer
    rows = []
    for phase in args.phases.split(","):
        workload = dev_workloads(tokenizer, args.requests + 1)[phase]()
        refs = measure.references(workload, model, tokenizer,
                                  args.out.parent / "refs" / f"{loaded.tag}-dev" / f"{workload.name}.pt")
        engine = KVCommEngine(model, tokenizer, config=KVCommConfig(method="rerotate"))
        requests = workload.requests
        with torch.inference_mode():
            for r, request in enumerate(requests[:-1]):
                other = requests[r + 1]  # the foreign prefix: the next request's first prompt
                first = other.messages(0, [])
                foreign = render_prompt(tokenizer, first).ids[:FOREIGN]
                replies = refs[request.key]
                for k, agent in enumerate(request.agents):
                    messages = request.messages(k, [c["text"] for c in replies[:k]])
                    if k > 0:
                        found = measure_reader(model, engine, render_prompt(tokenizer, messages), agent, foreign,
                                               args.min_run)
                        for row in found:
                            row.update(phase=phase, request=request.key, k=k)
                            cells = "  ".join(f"{n} {v['16']:.4f}" for n, v in row["kl"].items())
                            print(f"({phase}) {request.key} {agent} run {row['start']}+{row['length']} "
                                  f"{row['kind']} base_match {row['base_match']}: {cells}", flush=True)
                        rows.extend(found)
                    engine.replay(messages, agent=agent, reply_ids=replies[k]["ids"])
    measure.write_json(rows, args.out)
    summarize(rows)
    return rows


if __name__ == "__main__":
    main()
