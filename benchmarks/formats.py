"""(j) Prompt formats the other workloads do not use, held out by split.

How a graph pastes a task and the earlier agents' replies into a prompt is the graph author's
choice, and no benchmark covers them all. (j) is one coding team (3-4 agents drawn per request
from :data:`CODERS`, every agent reading the task, a reference page and every earlier reply)
whose prompt *format* is drawn per request from the split's own list in :data:`FORMATS`: the
development split's six formats are the only ones tests, tracing and tuning see; the report
split's six are different formats, so a report figure measures formats nothing was shaped on.

Some formats paste text verbatim (tags, turns, headers), some change it on the way: a reply cut to
its first line, replies quoted line by line, everything escaped inside one JSON document. A
text a format changes is not shared text for the limit (:attr:`Request.quote` says what of a
reply a reader's prompt holds verbatim), so the limit and the share from cache count only what
could be reused exactly.
"""

from __future__ import annotations

import json
from typing import Callable, Optional

from examples.tasks import stdlib_doc

from .graphs import Request, Workload, check_split, humaneval_rows, seeded

__all__ = ["CODERS", "FORMATS", "REFERENCE_PAGES", "prompt_formats"]

#: (j)'s roles and their instructions; 3-4 of them speak per request, in a drawn order.
CODERS = {
    "planner": "You plan how to implement the Python function: list the steps briefly, without code.",
    "coder": "You write the body of the Python function. Reply with code only.",
    "reviewer": "You review the team's proposal and name the one bug or risk that matters most, briefly.",
    "tester": "You write two short assert statements that test the function.",
    "simplifier": "You propose the simplest correct implementation, in as few lines as you can.",
}
#: Standard-library pages a request's agents get as reference, one per request, per split.
REFERENCE_PAGES = {
    "dev": ("itertools", "functools", "heapq", "bisect", "string"),
    "report": ("statistics", "operator", "textwrap", "fnmatch", "difflib"),
}
#: Characters of the reference page (about 300-450 tokens of pydoc text).
REFERENCE_CHARS = 1500

Notes = list[tuple[str, str]]  # (role, reply) of the earlier agents, in speaking order
Build = Callable[[str, str, str, Notes], list[dict]]  # (role, task, reference, notes) -> messages


def _tags(role: str, task: str, reference: str, notes: Notes) -> list[dict]:
    body = [f"<reference>\n{reference}\n</reference>", f"<task>\n{task}\n</task>"]
    body += [f'<note from="{name}">\n{reply}\n</note>' for name, reply in notes]
    return [{"role": "system", "content": CODERS[role]},
            {"role": "user", "content": "\n".join(body) + f"\nAct as the {role}."}]


def _turns(role: str, task: str, reference: str, notes: Notes) -> list[dict]:
    out = [{"role": "system", "content": CODERS[role]}, {"role": "user", "content": f"{reference}\n\n{task}"}]
    out += [{"role": "assistant", "content": f"({name}) {reply}"} for name, reply in notes]
    return out + [{"role": "user", "content": f"Continue as the {role}."}]


def _notes_first(role: str, task: str, reference: str, notes: Notes) -> list[dict]:
    team = "\n\n".join(f"{name}: {reply}" for name, reply in notes) or "(none yet)"
    return [{"role": "system", "content": CODERS[role]},
            {"role": "user", "content": f"Team notes:\n{team}\n\nReference:\n{reference}\n\nTask:\n{task}\n\n"
                                        f"Your turn, {role}."}]


def _blockquotes(role: str, task: str, reference: str, notes: Notes) -> list[dict]:
    quoted = ["\n".join(f"> {line}" for line in reply.split("\n")) for _, reply in notes]
    body = [reference, task] + [f"The {name} wrote:\n{text}" for (name, _), text in zip(notes, quoted)]
    return [{"role": "system", "content": CODERS[role]}, {"role": "user", "content": "\n\n".join(body)}]


def _no_system(role: str, task: str, reference: str, notes: Notes) -> list[dict]:
    said = "".join(f"\n\n{name.capitalize()} says: {reply}" for name, reply in notes)
    return [{"role": "user", "content": f"{CODERS[role]}\n\n{reference}\n\n{task}{said}"}]


def _numbered(role: str, task: str, reference: str, notes: Notes) -> list[dict]:
    out = [{"role": "system", "content": CODERS[role]}, {"role": "user", "content": reference},
           {"role": "user", "content": task}]
    if notes:
        steps = "\n".join(f"{i}. ({name}) {reply}" for i, (name, reply) in enumerate(notes, start=1))
        out.append({"role": "user", "content": f"Previous steps:\n{steps}"})
    return out


def _json_state(role: str, task: str, reference: str, notes: Notes) -> list[dict]:
    state = {"instruction": CODERS[role], "reference": reference, "task": task,
             "history": [{"agent": name, "output": reply} for name, reply in notes]}
    return [{"role": "user", "content": json.dumps(state, indent=2)}]


def _tool_results(role: str, task: str, reference: str, notes: Notes) -> list[dict]:
    out = [{"role": "system", "content": CODERS[role]}, {"role": "user", "content": task},
           {"role": "tool", "content": reference}]
    out += [{"role": "tool", "content": f"{name} output:\n{reply}"} for name, reply in notes]
    return out + [{"role": "user", "content": f"Go on as the {role}."}]


def _task_last(role: str, task: str, reference: str, notes: Notes) -> list[dict]:
    out = [{"role": "system", "content": CODERS[role]}, {"role": "user", "content": reference}]
    out += [{"role": "user", "content": f"From the {name}:\n{reply}"} for name, reply in notes]
    return out + [{"role": "user", "content": task}]


def _markdown(role: str, task: str, reference: str, notes: Notes) -> list[dict]:
    body = [f"## Reference\n\n{reference}", f"## Task\n\n{task}"]
    body += [f"## {name.capitalize()}\n\n{reply}" for name, reply in notes]
    return [{"role": "user", "content": "\n\n".join(body + [f"## Your role\n\n{CODERS[role]}"])}]


def _first_lines(role: str, task: str, reference: str, notes: Notes) -> list[dict]:
    summary = "\n".join(f"- {name}: {_first_line(reply)}" for name, reply in notes)
    return [{"role": "system", "content": f"{CODERS[role]}\n\nReference:\n{reference}"},
            {"role": "user", "content": task + (f"\n\nSo far:\n{summary}" if notes else "")}]


def _task_twice(role: str, task: str, reference: str, notes: Notes) -> list[dict]:
    said = "".join(f"\n\n[{name}]\n{reply}" for name, reply in notes)
    return [{"role": "system", "content": CODERS[role]},
            {"role": "user", "content": f"{reference}\n\n{task}{said}\n\nRemember the task:\n{task}"}]


def _first_line(reply: str) -> str:
    return reply.strip().split("\n")[0]


def _changed(reply: str) -> None:
    return None


#: Per split, each format's name, how it builds an agent's messages, and what of a reply its
#: prompts hold verbatim (:attr:`Request.quote`; None: the whole reply).
FORMATS: dict[str, dict[str, tuple[Build, Optional[Callable[[str], Optional[str]]]]]] = {
    "dev": {"tags": (_tags, None), "turns": (_turns, None), "notes-first": (_notes_first, None),
            "blockquotes": (_blockquotes, _changed), "no-system": (_no_system, None), "numbered": (_numbered, None)},
    "report": {"json-state": (_json_state, _changed), "tool-results": (_tool_results, None),
               "task-last": (_task_last, None), "markdown": (_markdown, None),
               "first-lines": (_first_lines, _first_line), "task-twice": (_task_twice, None)},
}


def prompt_formats(*, requests: int, split: str = "report", offset: int = 0, reply_tokens: int = 64,
                   seed: int = 0) -> Workload:
    """(j) A coding team in one of the split's :data:`FORMATS` per request: the formats in an
    order shuffled from (``seed``, split), cycled, so any six requests in a row hold each format
    once; per request a generator seeded from (``seed``, split, row) draws how many agents speak
    (3-4) and which of :data:`CODERS` in what order. Every agent reads the HumanEval problem, the
    request's reference page (:data:`REFERENCE_PAGES`, cycled) and every earlier reply."""
    formats, pages = FORMATS[check_split(split)], REFERENCE_PAGES[split]
    order = sorted(formats)
    seeded("prompt_formats", seed, split).shuffle(order)
    built = []
    for i, (row, problem) in enumerate(humaneval_rows(split, offset, requests), start=offset):
        rng = seeded("prompt_formats", seed, split, row)
        name = order[i % len(order)]
        build, quote = formats[name]
        names = tuple(rng.sample(sorted(CODERS), rng.randint(3, 4)))
        reference, task = stdlib_doc(pages[i % len(pages)], REFERENCE_CHARS), problem["prompt"].strip()

        def messages(k: int, replies: list[str], names=names, build=build, task=task,
                     reference=reference) -> list[dict]:
            return build(names[k], task, reference, list(zip(names, replies)))

        pasted = "\n".join(m["content"] for m in messages(0, []))
        shared = tuple(text for text in (task, reference) if text in pasted)  # JSON escapes both
        built.append(Request(f"{problem['name']}-{name}", names, messages, shared=shared, quote=quote,
                             meta={"format": name}))
    return Workload("prompt_formats", f"(j) held-out prompt formats: coding team of 3-4, {split} formats, "
                    f"seed {seed}", built, reply_tokens)
