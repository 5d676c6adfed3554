"""Graph shapes the ten workloads do not contain, run with the graph protocol.

The ten workloads (``python -m benchmarks``) cover the shapes the default was built on; a user's
graph is another. Six more: ``tool`` shaped one rule of the default once run (below); ``board``
and ``excerpts`` were written after the default's rules were fixed and shaped none:

- ``reflection``: writer -> critic -> writer -> critic; the writer's second call continues its
  first conversation (its draft an assistant turn, the critique a user turn), the critic's too.
- ``tool``: a researcher calls a documentation tool (an assistant turn, then the tool's page as a
  user turn after the task); a coder reads the page first, then the notes, then the task, last;
  a reviewer reads the task, the coder's code as its own turn, then the page and the notes.
- ``chain``: each agent reads only the previous agent's reply, at the start of its prompt.
- ``instructed``: ``tool`` with each agent's system text a paragraph of instructions (over 64
  ids, as agent frameworks write them), so every shared text is first computed after a whole
  64-id window of context. Written to test the position capture records for such texts
  (``KVSegment.computed_at``) once it was built; nothing was tuned on it.

Two data splits: ``probed``, the rows and pages first run while looking for what the default
missed (``recompute_last_run`` came from ``tool`` there: benchmarks/LAB.md, "The run right
before the reader's text"), and ``unseen``, rows and pages nothing was run on before the rule
was fixed. Quote ``unseen``.

``--noise-floor`` adds dense run in bfloat16 (float32 for a bfloat16 model) on every reader's
call: what a dtype change alone moves each shape's readers (KL and 32-token agreement), to read
the strategies' figures against.

    python -m benchmarks.held_out_shapes [--split unseen] [--shapes reflection,tool,chain,instructed]
        [--strategies dense,prefix,rerotate,kvcomm-mean] [--requests 5] [--noise-floor]
        [--out benchmarks/out/held_out_shapes]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from examples.tasks import stdlib_doc

from .graph import ModelMeter, run_graph
from .graph_report import noise_floor_readers, summarize_graphs
from .graph_tables import format_graphs, noise_floor_line, workload_tables
from .graphs import Request, Workload, gsm8k_rows, humaneval_rows, last_reply_number
from .models import load
from .provenance import device_text, versions
from .strategies import build, noise_floor

__all__ = ["SHAPES", "SPLITS", "workload", "described"]

#: per split: the GSM8K and HumanEval offsets in the report range, and the tool's pages
SPLITS = {
    "probed": {"gsm8k": 60, "humaneval": 20, "pages": ("collections", "json", "pathlib", "csv", "re", "shutil")},
    "unseen": {"gsm8k": 120, "humaneval": 30, "pages": ("argparse", "logging", "random", "datetime", "threading",
                                                         "subprocess")},
}
PAGE_CHARS = 3500  # about 700-900 ids of pydoc text


def reflection(requests: int, split: str, reply_tokens: int) -> Workload:
    writer = "You are a careful math writer. Solve the problem and show short steps."
    critic = "You are a strict reviewer. Point out any error in the solution, then give the right number."
    built = []
    for row, problem in gsm8k_rows("report", SPLITS[split]["gsm8k"], requests):
        q = problem["question"]

        def messages(k: int, replies: list[str], q=q) -> list[dict]:
            if k == 0:
                return [{"role": "system", "content": writer}, {"role": "user", "content": q}]
            review = [{"role": "system", "content": critic},
                      {"role": "user", "content": f"Question: {q}\n\nProposed solution:\n{replies[0]}\n\nReview it."}]
            if k == 1:
                return review
            if k == 2:
                return [{"role": "system", "content": writer}, {"role": "user", "content": q},
                        {"role": "assistant", "content": replies[0]},
                        {"role": "user", "content": f"A reviewer said:\n{replies[1]}\n\nWrite your final answer."}]
            return review + [{"role": "assistant", "content": replies[1]}, {"role": "user", "content":
                             f"The writer revised it:\n{replies[2]}\n\nIs it right now? Give the number."}]

        built.append(Request(f"r{row}", ("writer", "critic", "writer", "critic"), messages, shared=(q,)))
    return Workload("reflection", "reflection loop, multi-turn", built, reply_tokens, final_answer=last_reply_number)


#: per agent of ``tool``: its role line, and the instructions ``instructed`` adds to it
TOOL_ROLES = {
    "researcher": ("You are a research assistant. Summarize what in the tool output helps with the task.",
                   "Work in three steps. First read the task and note which functions, arguments and return "
                   "values it needs. Then go through the tool output and keep only the parts that bear on "
                   "those needs, quoting names exactly as they are written. Finally write at most five short "
                   "bullet points, most useful first, and say plainly when the output lacks something the "
                   "task needs. Do not write code, and do not guess at behaviour the output does not state."),
    "coder": ("You write Python. Reply with code only.",
              "Follow the task's signature and docstring exactly, keep the function pure unless the task "
              "says otherwise, and prefer the standard library. Handle empty inputs and the edge cases the "
              "docstring's examples show. Name variables for what they hold, keep each function short, and "
              "add no prints, no tests and no explanations outside the code: the reply is run as it is."),
    "reviewer": ("You review Python code for bugs, briefly.",
                 "Read the code against the task first, then against the documentation. Report only real "
                 "defects: a wrong result on some input, an unhandled edge case from the docstring, a misused "
                 "library call, or a crash. For each, give the line, the input that shows it and the fix in one "
                 "sentence. If the code is correct, say so in one line. Never restate the code or praise it."),
}


def tool(requests: int, split: str, reply_tokens: int, instructed: bool = False) -> Workload:
    pages = SPLITS[split]["pages"]
    system = {agent: f"{role} {rules}" if instructed else role for agent, (role, rules) in TOOL_ROLES.items()}
    built = []
    for i, (row, problem) in enumerate(humaneval_rows("report", SPLITS[split]["humaneval"], requests)):
        page, task = stdlib_doc(pages[i % len(pages)], max_chars=PAGE_CHARS), problem["prompt"]

        def messages(k: int, replies: list[str], page=page, task=task) -> list[dict]:
            if k == 0:
                return [{"role": "system", "content": system["researcher"]},
                        {"role": "user", "content": f"Task:\n{task}"}, {"role": "assistant", "content": "Calling search_docs."},
                        {"role": "user", "content": f"Tool output (search_docs):\n{page}"}]
            if k == 1:
                return [{"role": "system", "content": system["coder"]},
                        {"role": "user", "content": f"Documentation:\n{page}\n\nResearch notes:\n{replies[0]}\n\n"
                                                    f"Implement:\n{task}"}]
            return [{"role": "system", "content": system["reviewer"]},
                    {"role": "user", "content": f"Implement:\n{task}"}, {"role": "assistant", "content": replies[1]},
                    {"role": "user", "content": f"Check it against the docs:\n{page}\n\nNotes: {replies[0]}"}]

        built.append(Request(f"t{row}", ("researcher", "coder", "reviewer"), messages, shared=(page, task)))
    if instructed:
        return Workload("instructed", "tool result read at three places, instructions over 64 ids", built,
                        reply_tokens)
    return Workload("tool", "tool result read at three places", built, reply_tokens)


def chain(requests: int, split: str, reply_tokens: int) -> Workload:
    built = []
    for row, problem in gsm8k_rows("report", SPLITS[split]["gsm8k"], requests):
        def messages(k: int, replies: list[str], q=problem["question"]) -> list[dict]:
            if k == 0:
                return [{"role": "user", "content": f"{q}\nSolve it step by step."}]
            return [{"role": "user", "content": f"{replies[k - 1]}\n\nRewrite the text above more clearly, keeping "
                                                "every number."}]

        built.append(Request(f"c{row}", ("solver", "editor1", "editor2", "editor3"), messages,
                             reads=((), (0,), (1,), (2,))))
    return Workload("chain", "chain, the previous reply only", built, reply_tokens)


def instructed(requests: int, split: str, reply_tokens: int) -> Workload:
    return tool(requests, split, reply_tokens, instructed=True)


#: per agent of ``board``: its system text, and what it is asked after the board
BOARD_ROLES = (
    ("solver", "You solve grade-school math problems. Show short steps and end with the number.", "Solve it."),
    ("checker", "You check arithmetic. Redo each calculation on the board and name any that is wrong.",
     "Check the work above."),
    ("skeptic", "You look for misread problems: a quantity used twice, a unit mixed up, a step that answers "
     "a different question than the one asked.", "What, if anything, was misread?"),
    ("judge", "You decide. Weigh the board and state the final number on the last line.", "Final answer?"),
)


def board(requests: int, split: str, reply_tokens: int) -> Workload:
    built = []
    for row, problem in gsm8k_rows("report", SPLITS[split]["gsm8k"], requests):
        def messages(k: int, replies: list[str], q=problem["question"]) -> list[dict]:
            name, system, ask = BOARD_ROLES[k]
            if k == 0:
                return [{"role": "system", "content": system}, {"role": "user", "content": q}]
            posts = "\n\n".join(f"[{BOARD_ROLES[j][0]}] {replies[j]}" for j in reversed(range(k)))
            return [{"role": "system", "content": system},
                    {"role": "user", "content": f"Board, newest post first:\n\n{posts}\n\nProblem: {q}\n\n{ask}"}]

        built.append(Request(f"b{row}", tuple(role[0] for role in BOARD_ROLES), messages,
                             shared=(problem["question"],)))
    return Workload("board", "board, newest post first, problem last", built, reply_tokens,
                    final_answer=last_reply_number)


def _windows(page: str, bounds: tuple[tuple[float, float], ...]) -> list[str]:
    """``page`` cut at line starts into one window per ``(from, to)`` share of its lines."""
    lines = page.split("\n")
    return ["\n".join(lines[int(a * len(lines)):int(b * len(lines))]).strip("\n") for a, b in bounds]


def excerpts(requests: int, split: str, reply_tokens: int) -> Workload:
    pages = SPLITS[split]["pages"]
    built = []
    for i, (row, problem) in enumerate(humaneval_rows("report", SPLITS[split]["humaneval"], requests)):
        page, task = stdlib_doc(pages[(i + 3) % len(pages)], max_chars=PAGE_CHARS), problem["prompt"]
        first, middle, last = _windows(page, ((0.0, 0.6), (0.2, 0.8), (0.4, 1.0)))

        def messages(k: int, replies: list[str], page=page, task=task, cuts=(first, middle, last)) -> list[dict]:
            if k == 0:
                return [{"role": "system", "content": "You index documentation. List the names it defines."},
                        {"role": "user", "content": f"{page}\n\nList the names in this page."}]
            if k == 1:
                return [{"role": "system", "content": "You write Python. Reply with code only."},
                        {"role": "user", "content": f"{task}\n\nRetrieved passage:\n{cuts[0]}\n\n"
                                                    f"Index of the page: {replies[0]}"}]
            if k == 2:
                return [{"role": "system", "content": "You write tests for Python functions."},
                        {"role": "user", "content": f"{task}\n\nRetrieved passage:\n{cuts[1]}\n\n"
                                                    f"Write three asserts for this code:\n{replies[1]}"}]
            return [{"role": "system", "content": "You review Python code for bugs, briefly."},
                    {"role": "user", "content": f"Retrieved passage:\n{cuts[2]}\n\n{task}\n\nCode:\n{replies[1]}"
                                                f"\n\nTests:\n{replies[2]}\n\nIs the code right?"}]

        built.append(Request(f"x{row}", ("indexer", "coder", "tester", "reviewer"), messages,
                             reads=((), (0,), (1,), (1, 2)), shared=(task, first, middle, last)))
    return Workload("excerpts", "overlapping passages of one page, retrieved per agent", built, reply_tokens)


SHAPES = {"reflection": reflection, "tool": tool, "chain": chain, "instructed": instructed, "board": board,
          "excerpts": excerpts}


def workload(shape: str, split: str, requests: int, reply_tokens: int = 64) -> Workload:
    """One held-out shape's workload on ``split`` (:data:`SPLITS`)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; known: {', '.join(SPLITS)}")
    return SHAPES[shape](requests, split, reply_tokens)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--split", default="unseen", choices=sorted(SPLITS))
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--strategies", default="dense,prefix,rerotate,kvcomm-mean")
    parser.add_argument("--requests", type=int, default=5, help="per shape, the first one a warm-up")
    parser.add_argument("--reply-tokens", type=int, default=64)
    parser.add_argument("--noise-floor", action="store_true", help="dense in another dtype on every reader's call too")
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/held_out_shapes"))
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    loaded = load(args.model, device="cpu", dtype=torch.float32)
    from kvcomm_agents.engines.weight_layout import choose_layout
    from kvcomm_agents.support import inspect_model

    info = versions(torch.device("cpu"))
    layout = choose_layout(loaded.model, "measured")  # as the front run: every strategy on one layout
    info["weight_layout"] = f"{layout.layout} ({layout.reason})"
    eos = set(inspect_model(loaded.model, loaded.tokenizer, reuse=False).eos_ids)
    meter = ModelMeter(loaded.model)
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"kind": "held_out_shapes", "versions": info, "split": args.split, "model": args.model,
               "dtype": "float32", "phases": {}}
    for shape in args.shapes.split(","):
        shape_load = workload(shape, args.split, args.requests, args.reply_tokens)
        strategies = [build(name, loaded.model, loaded.tokenizer) for name in args.strategies.split(",")]
        if args.noise_floor:
            floor = noise_floor(loaded.model, loaded.tokenizer, requests=range(1, args.requests))
            floor.decider_only = False
            meter.watch(floor.engine.model)
            strategies.append(floor)
        records, _ = run_graph(shape_load, strategies, warmup=1, phase=shape, tokenizer=loaded.tokenizer, eos_ids=eos,
                               meter=meter)
        graphs = summarize_graphs(records)
        floor = noise_floor_readers(records)
        results["phases"][shape] = {"title": shape_load.title, "requests": {"measured": args.requests - 1, "warmup": 1},
                                    "graphs": graphs, "noise_floor": floor}
        (args.out / f"{shape}-{args.split}.records.json").write_text(json.dumps(records))
        print(f"\n{shape} ({shape_load.title}), {args.split}, {args.requests - 1} measured after 1 warm-up\n"
              + format_graphs(graphs) + (f"\n{noise_floor_line(floor)}" if floor else ""), flush=True)
    path = args.out / f"held_out_shapes-{args.split}.json"
    path.write_text(json.dumps(results, indent=1))
    print(f"written {path}")
    return results


def described(summary: dict) -> str:
    """The docs' tables of a run summary: its provenance line, then each shape's whole-graph rows
    (the front run's columns) and noise floor."""
    v = summary["versions"]
    return (f"Run: commit `{v['commit'][:12]}`, {summary['model']} model, {summary['dtype']}, {device_text(v)}, "
            f"weights {v['weight_layout']}, held-out shapes, {summary['split']} split.\n\n"
            + workload_tables(summary))


if __name__ == "__main__":
    main()
