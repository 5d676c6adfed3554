"""Workloads shared by the benchmark, the evaluation scripts and the demos: defined once, fed
identically to every strategy.

A workload is a list of requests; each request is a pipeline of agents in which agent ``k``'s
prompt is ``request.messages(k, replies)`` given the replies of agents ``0..k-1``.

- ``paper_shape``: (a) the KVCOMM paper's TTFT setting: N fully connected agents, each prompt = its
  own leading text of P tokens + the shared user input of I tokens + every earlier reply (O tokens).
- ``gsm8k_debate``: (b) 4 fully connected GSM8K solvers.
- ``rag_handoff``: (c) a reader, a critic and an editor over long documentation pages.
- ``coding_pipeline``: (d) HumanEval: planner, coder, reviewer.
"""

from __future__ import annotations

import importlib
import json
import pydoc
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
DEFAULT_GSM8K = DATA / "gsm8k-dev.jsonl"
DEFAULT_HUMANEVAL = DATA / "humaneval-dev.jsonl"
BUILTIN_GSM8K = [
    {"question": "A baker makes 12 loaves in the morning and 9 in the afternoon. He sells 15. How many loaves are left?", "answer": "#### 6"},
    {"question": "Tom has 3 boxes with 8 pencils each. He gives away 5 pencils. How many pencils does he have now?", "answer": "#### 19"},
    {"question": "A ticket costs $7. How much do 6 tickets cost if there is a $4 discount on the total?", "answer": "#### 38"},
]


def gsm8k_questions(n: int, path: Path = DEFAULT_GSM8K) -> list[dict]:
    """The first ``n`` GSM8K dev problems (built-in ones when the data folder is absent)."""
    if not path.is_file():
        return BUILTIN_GSM8K[:n]
    with path.open() as handle:
        return [json.loads(line) for line, _ in zip(handle, range(n))]


def debate_messages(k: int, agents: int, question: str, replies: list[str]) -> list[dict]:
    """Solver ``k``'s prompt in a fully connected debate: its own system text, the question, and
    every earlier solver's reply pasted verbatim (the KVCOMM paper's GSM8K setting)."""
    system = (f"You are solver {k} of {agents} in a team solving a math word problem. Reason step "
              "by step, check the other solvers' answers, and end with the final number.")
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    for j, reply in enumerate(replies, start=1):
        messages.append({"role": "user", "content": f"Solver {j} answered:\n{reply}"})
    return messages


def last_number(text: str) -> str | None:
    """The last number in a text (how GSM8K answers are scored), commas and a final dot removed."""
    found = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
    return found[-1].replace(",", "").rstrip(".") if found else None


def gold_answer(row: dict) -> str | None:
    """The gold number of a GSM8K row (after '####')."""
    return last_number(row["answer"].split("####")[-1])


# ---- HumanEval ------------------------------------------------------------------------------
BUILTIN_PROBLEMS = [{
    "name": "builtin_count_vowels", "entry_point": "count_vowels",
    "prompt": 'def count_vowels(text: str) -> int:\n    """Return how many of the characters of text are vowels (a, e, i, o, u, either case).\n    >>> count_vowels("Agent")\n    2\n    """\n',
    "test": "assert count_vowels('Agent') == 2\nassert count_vowels('') == 0\nassert count_vowels('xyz') == 0\n",
}]


def load_problems(n: int, path: Path = DEFAULT_HUMANEVAL) -> list[dict]:
    """The first ``n`` HumanEval-style problems (a built-in one when the data folder is absent)."""
    if not path.is_file():
        return BUILTIN_PROBLEMS[:n]
    with path.open() as handle:
        return [json.loads(line) for line, _ in zip(handle, range(n))]


# ---- documentation pages (offline, rendered by pydoc) ---------------------------------------
def stdlib_doc(dotted: str, max_chars: int = 1800) -> str:
    """Plain-text pydoc of a standard-library object, capped at ``max_chars``. (The text depends
    on the Python version: compare runs made with the same interpreter.)"""
    module_name, *attrs = dotted.split(".")
    obj = importlib.import_module(module_name)
    for attr in attrs:
        try:
            obj = getattr(obj, attr)
        except AttributeError:
            obj = importlib.import_module(f"{obj.__name__}.{attr}")
    text = pydoc.render_doc(obj, title=f"Documentation of {dotted}:\n%s", renderer=pydoc.plaintext)
    return text[:max_chars].rstrip()


# ---- the benchmark's pipelines --------------------------------------------------------------
@dataclass
class Request:
    """One run of a pipeline. ``messages(k, replies)``: agent ``k``'s prompt given the earlier
    agents' replies (texts). ``gold``: the task's answer, if it has one."""

    key: str
    agents: tuple[str, ...]
    messages: Callable[[int, list[str]], list[dict]]
    gold: Optional[str] = None
    meta: dict = field(default_factory=dict)


@dataclass
class Workload:
    """A named list of requests. ``exact_replies``: replies are generated to exactly
    ``reply_tokens`` tokens (end-of-sequence suppressed), as the paper's TTFT setting fixes O."""

    name: str
    title: str
    requests: list[Request]
    reply_tokens: int
    exact_replies: bool = False
    final_answer: Optional[Callable[[list[str]], Optional[str]]] = None


def truncate_to_tokens(tokenizer, text: str, n: int) -> str:
    """The longest start of ``text`` that is at most ``n`` tokens (decoded back to text)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer.decode(ids[:n]).strip() if len(ids) > n else text


def _filler(questions: list[dict], start: int) -> str:
    """Plenty of natural text: GSM8K questions from ``start`` on, cycling."""
    return "\n".join(questions[(start + i) % len(questions)]["question"] for i in range(len(questions)))


def paper_shape(tokenizer, *, requests: int, agents: int = 5, lead_tokens: int = 256, input_tokens: int = 512,
                reply_tokens: int = 128) -> Workload:
    """(a) N fully connected agents: own leading text (P tokens, one per agent, the same in every
    request), the shared user input (I tokens, different per request), every earlier reply."""
    pool = gsm8k_questions(200)
    names = tuple(f"agent-{k + 1}" for k in range(agents))
    leads = [truncate_to_tokens(
        tokenizer,
        f"You are agent {k + 1} of {agents}, a careful analyst. Background notes for your role follow; "
        f"read the user's problems and the other agents' replies, then answer.\n" + _filler(pool, 17 * k + 3),
        lead_tokens) for k in range(agents)]
    built = []
    for r in range(requests):
        shared = truncate_to_tokens(
            tokenizer, "Solve the last of these problems.\n" + _filler(pool, 101 + 7 * r), input_tokens)

        def messages(k: int, replies: list[str], shared=shared) -> list[dict]:
            out = [{"role": "system", "content": leads[k]}, {"role": "user", "content": shared}]
            out += [{"role": "user", "content": f"Agent {j + 1} replied:\n{reply}"} for j, reply in enumerate(replies)]
            return out

        built.append(Request(f"a{r}", names, messages))
    return Workload("paper_shape", f"(a) paper shape: N={agents}, P={lead_tokens}, I={input_tokens}, O={reply_tokens}",
                    built, reply_tokens, exact_replies=True)


def majority_or_last(replies: list[str]) -> Optional[str]:
    """The final answer of a debate: the most common last number of the solvers (ties: the later)."""
    answers = [last_number(r) for r in replies]
    answers = [a for a in answers if a is not None]
    if not answers:
        return None
    return max(reversed(answers), key=answers.count)


def gsm8k_debate(*, requests: int, offset: int = 0, agents: int = 4, reply_tokens: int = 128) -> Workload:
    """(b) ``agents`` fully connected GSM8K solvers (no opt-out); questions ``offset..``."""
    rows = gsm8k_questions(offset + requests)[offset:]
    names = tuple(f"solver-{k + 1}" for k in range(agents))
    built = []
    for i, row in enumerate(rows):
        def messages(k: int, replies: list[str], question=row["question"]) -> list[dict]:
            return debate_messages(k + 1, agents, question, replies)

        built.append(Request(f"q{offset + i}", names, messages, gold=gold_answer(row)))
    return Workload("gsm8k_debate", f"(b) GSM8K debate, {agents} solvers", built, reply_tokens,
                    final_answer=majority_or_last)


RAG_REQUESTS = [
    ("json.dumps", "textwrap.shorten", "What does json.dumps do with the indent argument?"),
    ("textwrap.shorten", "textwrap.dedent", "How does textwrap.shorten truncate text that is too long?"),
    ("shutil.which", "os.path.join", "What does shutil.which return when the command is not found?"),
    ("statistics.median", "bisect.insort", "How does statistics.median handle an even number of data points?"),
    ("itertools.accumulate", "itertools.groupby", "What does itertools.accumulate return by default?"),
    ("os.path.join", "shutil.which", "What happens in os.path.join when a component is an absolute path?"),
    ("collections.Counter.most_common", "statistics.median", "In what order does Counter.most_common list elements?"),
    ("functools.lru_cache", "json.loads", "What does lru_cache do when maxsize is None?"),
    ("json.loads", "json.dumps", "Which argument of json.loads customises how objects are decoded?"),
    ("itertools.groupby", "itertools.accumulate", "Why must the input of itertools.groupby usually be sorted?"),
    ("bisect.insort", "collections.Counter.most_common", "Where does bisect.insort put an item equal to existing ones?"),
    ("textwrap.dedent", "functools.lru_cache", "What whitespace does textwrap.dedent remove?"),
]


def rag_handoff(*, requests: int, offset: int = 0, reply_tokens: int = 128, doc_chars: int = 3000) -> Workload:
    """(c) A reader answers from two documentation pages; a critic reads the pages, the question
    and the answer; an editor reads everything and writes the final answer."""
    systems = [
        "You answer questions about Python from the documentation given. Quote the relevant behaviour.",
        "You check an answer against the documentation given. Point out anything wrong or missing.",
        "You write the final answer from the documentation, a draft answer and a critique. Be brief.",
    ]
    built = []
    for i in range(offset, offset + requests):
        first, second, question = RAG_REQUESTS[i % len(RAG_REQUESTS)]
        documents = f"Documents:\n\n{stdlib_doc(first, doc_chars)}\n\n{stdlib_doc(second, doc_chars)}"

        def messages(k: int, replies: list[str], documents=documents, question=question) -> list[dict]:
            out = [{"role": "system", "content": systems[k]}, {"role": "user", "content": documents},
                   {"role": "user", "content": f"Question: {question}"}]
            labels = ["Draft answer", "Critique"]
            out += [{"role": "user", "content": f"{labels[j]}:\n{reply}"} for j, reply in enumerate(replies)]
            return out

        built.append(Request(f"rag{i}", ("reader", "critic", "editor"), messages))
    return Workload("rag_handoff", "(c) RAG hand-off, long documents", built, reply_tokens)


def coding_pipeline(*, requests: int, offset: int = 0, reply_tokens: int = 128) -> Workload:
    """(d) HumanEval: a planner, a coder (problem + plan) and a reviewer (problem + plan + code)."""
    systems = [
        "You plan the solution of a Python programming task in a few short steps. Do not write code.",
        "You write the Python function for the task, following the plan. Reply with one code block.",
        "You review the code for the task against the plan and the docstring's examples. List any bug.",
    ]
    built = []
    for problem in load_problems(offset + requests)[offset:]:
        task = f"Task: complete this function.\n```python\n{problem['prompt']}```"

        def messages(k: int, replies: list[str], task=task) -> list[dict]:
            out = [{"role": "system", "content": systems[k]}, {"role": "user", "content": task}]
            labels = ["Plan", "Code"]
            out += [{"role": "user", "content": f"{labels[j]}:\n{reply}"} for j, reply in enumerate(replies)]
            return out

        built.append(Request(problem["name"], ("planner", "coder", "reviewer"), messages))
    return Workload("coding_pipeline", "(d) HumanEval coding pipeline", built, reply_tokens)
