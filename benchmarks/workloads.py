"""Workloads of the benchmark and the evaluation scripts: defined once, fed identically to every
strategy (task data from :mod:`examples.tasks`).

A workload is a list of requests; each request is a pipeline of agents in which agent ``k``'s
prompt is ``request.messages(k, replies)`` given the replies of agents ``0..k-1``.

- ``paper_shape``: (a) the KVCOMM paper's TTFT setting: N fully connected agents, each prompt = its
  own leading text of P tokens + the shared user input of I tokens + every earlier reply (O tokens).
- ``gsm8k_debate``: (b) 4 fully connected GSM8K solvers.
- ``rag_handoff``: (c) a reader, a critic and an editor over long documentation pages.
- ``coding_pipeline``: (d) HumanEval: planner, coder, reviewer.
- ``gsm8k_one_message``: (e) (b)'s solvers in the other common prompt format: one user message
  that embeds the task and the other solvers' outputs (as the paper's agents and most hand-written
  graph nodes build it), so shared text never arrives as a whole message of its own.
- ``shared_history``: (f) three agents over two rounds on one growing message list (LangGraph's
  ``MessagesState``): each sees its own system text, the task and every earlier turn as an
  assistant message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from examples.tasks import (  # noqa: F401  (re-exported: the benchmark's task data)
    BUILTIN_GSM8K, BUILTIN_PROBLEMS, DATA, DEFAULT_GSM8K, DEFAULT_HUMANEVAL, debate_messages, gold_answer,
    gsm8k_questions, last_number, load_problems, stdlib_doc,
)


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
    task: Optional[str] = None  # the task's text, which every agent's prompt embeds (shared text)


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


def _solver_requests(requests: int, offset: int, agents: int, prompt) -> list[Request]:
    """GSM8K questions ``offset..`` as requests of ``agents`` solvers; solver ``k``'s prompt is
    ``prompt(k, agents, question, replies)`` (``k`` from 1)."""
    rows = gsm8k_questions(offset + requests)[offset:]
    names = tuple(f"solver-{k + 1}" for k in range(agents))
    built = []
    for i, row in enumerate(rows):
        def messages(k: int, replies: list[str], question=row["question"]) -> list[dict]:
            return prompt(k + 1, agents, question, replies)

        built.append(Request(f"q{offset + i}", names, messages, gold=gold_answer(row), task=row["question"]))
    return built


def gsm8k_debate(*, requests: int, offset: int = 0, agents: int = 4, reply_tokens: int = 128) -> Workload:
    """(b) ``agents`` fully connected GSM8K solvers (no opt-out); questions ``offset..``."""
    return Workload("gsm8k_debate", f"(b) GSM8K debate, {agents} solvers",
                    _solver_requests(requests, offset, agents, debate_messages), reply_tokens,
                    final_answer=majority_or_last)


def one_message_prompt(k: int, agents: int, question: str, replies: list[str]) -> list[dict]:
    """Solver ``k``'s prompt as one user message embedding the task and every earlier solution."""
    system = f"You are solver {k} of {agents}. Be concise and end with the final number."
    parts = [f"Solve this math word problem with the other solvers.\n\nProblem: {question}"]
    parts += [f"Solution from solver {j}:\n{reply}" for j, reply in enumerate(replies, start=1)]
    parts.append("Check the solutions above, then give your own answer.")
    return [{"role": "system", "content": system}, {"role": "user", "content": "\n\n".join(parts)}]


def gsm8k_one_message(*, requests: int, offset: int = 0, agents: int = 4, reply_tokens: int = 128) -> Workload:
    """(e) (b)'s debate with every prompt one user message (:func:`one_message_prompt`)."""
    return Workload("gsm8k_one_message", f"(e) GSM8K, one message per prompt, {agents} solvers",
                    _solver_requests(requests, offset, agents, one_message_prompt), reply_tokens,
                    final_answer=majority_or_last)


SHARED_HISTORY_ROLES = ("proposer", "critic", "judge")


def shared_history(*, requests: int, offset: int = 0, rounds: int = 2, reply_tokens: int = 128) -> Workload:
    """(f) A proposer, a critic and a judge take ``rounds`` turns each on one growing message list:
    every agent sees its own system text, the task, then all earlier turns as assistant messages."""
    rows = gsm8k_questions(offset + requests)[offset:]
    names = tuple(f"{role}-{r + 1}" for r in range(rounds) for role in SHARED_HISTORY_ROLES)
    built = []
    for i, row in enumerate(rows):
        def messages(k: int, replies: list[str], question=row["question"]) -> list[dict]:
            role = SHARED_HISTORY_ROLES[k % len(SHARED_HISTORY_ROLES)]
            history = [{"role": "system", "content": f"You are the {role} of a team solving a math problem. "
                        "Keep your turn short and end with the number you believe is right."},
                       {"role": "user", "content": question}]
            return history + [{"role": "assistant", "content": reply} for reply in replies]

        built.append(Request(f"q{offset + i}", names, messages, gold=gold_answer(row)))
    return Workload("shared_history", f"(f) shared history: {len(SHARED_HISTORY_ROLES)} agents x {rounds} rounds",
                    built, reply_tokens, final_answer=lambda replies: last_number(replies[-1]) if replies else None)


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
